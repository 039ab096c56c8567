"""Checkpoints of several hosts through the launcher, as a user runs them: a SIGKILL of any
host, or a SIGTERM to the job, resumes bit-identically (every round's anchor hash taken on
every host); a workdir per host heals a lost one and names a damaged file; a NaN
pseudo-gradient is skipped on every host. The uninterrupted references are run once for
this module (`references`). In one process: tests/test_checkpoint.py."""

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

from diloco_jax.algo import state as state_lib
from diloco_jax.checkpoints import store
from diloco_jax.readback import trained
from diloco_jax.checkpoints import files
from tests import multihost
from tests import test_trained


TINY = ["--config=configs/tiny.py", "--config.replicas_per_host=1", "--config.num_rounds=10",
        "--config.inner_steps=5", "--config.inner.warmup_steps=5",
        "--config.debug_checks=True", "--heartbeat_timeout=20"]


# Each host with 2 CPU devices, its replica's params and AdamW state sharded over them.
FSDP = ["--config.mesh.fsdp=2"]
TWO_DEVICES = {**multihost.ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def launch(workdir, *extra, hosts=2, max_restarts=0):
  return multihost.start([sys.executable, "launch/local.py", f"--hosts={hosts}",
                          f"--max_restarts={max_restarts}", "--", f"--workdir={workdir}",
                          *TINY, *extra], env=TWO_DEVICES if FSDP[0] in extra else None)


def records(workdir):
  with open(os.path.join(multihost.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def same_run(workdir, reference):
  """Every round's anchor hash (taken on every host) and losses equal the reference's."""
  got, want = records(workdir), records(reference)
  assert [r["round"] for r in got] == list(range(1, 11))
  for key in ("anchor_hash", "train_loss", "eval_loss"):
    assert [r.get(key) for r in got] == [r.get(key) for r in want], key


def host_pid(launcher, host):
  for pid in multihost.children(launcher.pid):
    with open(f"/proc/{pid}/cmdline") as f:
      if f"--host_id={host}" in f.read().replace("\0", " "):
        return pid
  raise AssertionError(f"host {host} not running")


def wait_for_checkpoint(workdir, round_, launcher, timeout=180):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    ckpts = os.path.join(multihost.host_dir(workdir), store.CHECKPOINTS)
    if os.path.isdir(ckpts) and any(d.isdigit() and int(d) >= round_ for d in os.listdir(ckpts)):
      return
    assert launcher.poll() is None, launcher.communicate()[0][-4000:]
    time.sleep(0.05)
  raise AssertionError(f"no checkpoint {round_} after {timeout}s")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  """Uninterrupted 2-host runs, one per mode, computed once."""
  out = {}

  def get(mode, *extra):
    key = (mode, *extra)
    if key not in out:
      workdir = tmp_path_factory.mktemp(f"reference_{mode}")
      text = launch(workdir, f"--config.mode={mode}", *extra).communicate(timeout=300)[0]
      assert "final eval loss" in text, text[-4000:]
      out[key] = workdir
    return out[key]

  return get


@pytest.mark.parametrize("mode,victim,extra", [("sync", 0, FSDP), ("eager", 1, [])],
                         ids=["sync-coordinator-fsdp", "eager"])
def test_sigkill_restart_resumes_bit_identically(tmp_path, references, mode, victim, extra):
  """SIGKILL of one host at a random moment after checkpoint 3; the launcher restarts
  every host, which resume from the newest checkpoint and end where an uninterrupted run
  ends, every round's anchor hash included. Sync: the coordinator killed, each host's
  replica sharded over its 2 devices (FSDP); eager: another host, the default layout."""
  reference = references(mode, *extra)
  launcher = launch(tmp_path, f"--config.mode={mode}", *extra, max_restarts=1)
  wait_for_checkpoint(tmp_path, 3, launcher)
  time.sleep(random.uniform(0, 0.5))
  os.kill(host_pid(launcher, victim), signal.SIGKILL)
  text = launcher.communicate(timeout=300)[0]
  (tmp_path / "launcher.log").write_text(text)  # kept with the run's files, for a failure
  assert launcher.returncode == 0, text[-4000:]
  assert f"host {victim} killed by signal 9" in text and "restart 1/1" in text
  assert "resumed from checkpoint" in text, text[-4000:]
  same_run(tmp_path, reference)


def test_fsdp_layout_trains_to_the_default_layouts_losses(references):
  """2 hosts x 1 replica: each replica on 2 devices, sharded, or on 1 device; equal but
  for float32 summation order (tests/test_layout.py), the anchors identical on every host
  each round (debug_checks in both runs)."""
  fsdp, default = records(references("sync", *FSDP)), records(references("sync"))
  assert all("anchor_hash" in r for r in fsdp)
  for key in ("train_loss", "eval_loss"):
    assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in default], rel=1e-5)


def test_sigterm_to_the_job_checkpoints_and_exits_zero(tmp_path, references):
  """SIGTERM to the launcher (it goes to the job's coordinator): every host stops after
  the same round with a checkpoint, exit 0, and the same command resumes there. (A
  SIGTERM to one host alone makes that host leave: tests/test_live.py.)"""
  reference = references("sync")
  launcher = launch(tmp_path)
  wait_for_checkpoint(tmp_path, 2, launcher)
  launcher.send_signal(signal.SIGTERM)
  text = launcher.communicate(timeout=120)[0]
  assert launcher.returncode == 0, text[-4000:]
  assert "preempted: stopped after round" in text, text[-4000:]
  # diloco_jax's line only: not JAX's C++ notifier's nor Orbax's (runtime/quiet.py).
  assert "preemption_notifier" not in text, text[-4000:]
  assert "Reached preemption sync point" not in text, text[-4000:]
  stopped = int(text.split("preempted: stopped after round ")[1].split()[0])
  assert stopped < 10
  for host in (0, 1):
    saved = multihost.host_dir(tmp_path, host) / store.CHECKPOINTS
    assert max(int(d) for d in os.listdir(saved) if d.isdigit()) == stopped
  text = launch(tmp_path).communicate(timeout=300)[0]
  assert f"resumed from checkpoint {stopped}" in text, text[-4000:]
  same_run(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.multihost
def test_nan_pseudo_gradient_skips_the_round_on_every_host(tmp_path):
  """NaN in host 1's replica's Δ in round 2: every host skips that outer step (the anchor
  hash, taken on every host, stays that of round 1) and counts it."""
  results = multihost.run_hosts(tmp_path, 2, replicas_per_host=1, num_rounds=4,
                                debug_checks=True,
                                _poison={"host": 1, "replica": 0, "value": "nan", "calls": [2]})
  for host in results:
    recs = host["records"]
    assert [r.get("skipped", 0) for r in recs] == [0, 1, 0, 0]
    assert [r["skipped_rounds"] for r in recs] == [0, 1, 1, 1]
    assert recs[1]["anchor_hash"] == recs[0]["anchor_hash"] != recs[2]["anchor_hash"]
    assert recs[1]["bad_replicas"] == "host 1 replica 0"
    assert all(np.isfinite(x).all() for x in host["leaves"])
  with open(multihost.host_dir(tmp_path / "work") / "metrics.jsonl") as f:
    assert [json.loads(line).get("skipped", 0) for line in f] == [0, 1, 0, 0]


@pytest.mark.slow
@pytest.mark.multihost
def test_repeated_nan_stops_the_job_naming_the_replica(tmp_path):
  port = multihost.free_port()
  overrides = json.dumps({"replicas_per_host": 1, "num_rounds": 6,
                          "outer.max_skipped_rounds": 3,
                          "_poison": {"host": 1, "replica": 0, "value": "nan",
                                      "calls": [2, 3, 4]}})
  procs = [multihost.start([sys.executable, "tests/host_main.py", str(tmp_path), str(h), "2",
                            str(port), overrides]) for h in range(2)]
  for code, text in multihost.finish(procs, timeout=240):
    assert code != 0
    assert "BadPseudoGradientError: round 4: pseudo-gradients with NaN or Inf entries in " \
           "3 rounds in a row" in text and "host 1 replica 0" in text, text[-3000:]


def test_slurm_script_restarts_failed_steps(tmp_path):
  """launch/slurm.sbatch with a fake srun that fails once: the hosts are started again,
  each a replica sharded over its node's GPUs (SLURM_GPUS_ON_NODE) unless told otherwise."""
  calls = tmp_path / "calls"
  fake = tmp_path / "bin" / "srun"
  fake.parent.mkdir()
  fake.write_text(f'#!/bin/bash\necho "srun $*" >> {calls}\n'
                  f'[ "$(wc -l < {calls})" -ge 2 ]\n')
  fake.chmod(0o755)
  env = {**multihost.ENV, "PATH": f"{fake.parent}:{os.environ['PATH']}",
         "WORKDIR": str(tmp_path / "run"), "SLURM_SUBMIT_DIR": multihost.REPO,
         "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
         "SLURM_GPUS_ON_NODE": "4"}
  proc = subprocess.run(["bash", "launch/slurm.sbatch", "--config.num_rounds=3"],
                        cwd=multihost.REPO, env=env, text=True, capture_output=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "restart 1/3" in proc.stdout
  lines = calls.read_text().splitlines()
  assert len(lines) == 2 and "--kill-on-bad-exit=1" in lines[0]
  assert f"--workdir={tmp_path / 'run'}" in lines[0] and "--config.num_rounds=3" in lines[0]
  assert "--config.mesh.fsdp=4 --config.num_rounds=3" in lines[0]


@pytest.mark.slow
def test_sigterm_on_one_host_run(tmp_path):
  """One host, no jax.distributed: SIGTERM is caught by the trainer itself."""
  cmd = [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.num_rounds=200", "--config.inner_steps=2",
         "--config.inner.warmup_steps=2"]
  proc = multihost.start(cmd)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("round   3/200"):
      break
  else:
    raise AssertionError("".join(lines))
  proc.send_signal(signal.SIGTERM)
  text = "".join(lines) + proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, text[-3000:]
  stopped = int(text.split("preempted: stopped after round ")[1].split()[0])
  assert stopped < 200 and os.path.isdir(tmp_path / store.CHECKPOINTS / str(stopped))


@pytest.mark.parametrize("mode", ["sync", "eager"])
def test_trained_model_of_a_two_host_run(references, mode):
  """trained.load in one process reads a 2-host checkpoint (eager: both hosts' replicas,
  averaged): the model it returns scores the run's final eval loss."""
  workdir = references(mode)
  model = trained.load(str(workdir))
  assert model.finished and model.config.mode == mode
  assert test_trained.eval_loss(model) == pytest.approx(test_trained.final_eval_loss(workdir),
                                                        rel=1e-5)


# Hosts with a workdir each (launch/local.py --workdir_per_host), as on machines that share
# no disk: checkpoints/per_host.py and checkpoints/recovery.py.

def launch_per_host(workdir, *extra, hosts=2, max_restarts=0):
  return multihost.start([sys.executable, "launch/local.py", f"--hosts={hosts}",
                          "--workdir_per_host", f"--max_restarts={max_restarts}", "--",
                          f"--workdir={workdir}", *TINY, *extra])


def host_checkpoints(workdir, host):
  path = os.path.join(workdir, f"host{host}", store.CHECKPOINTS)
  return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def checkpoint_files(workdir):
  return sorted((str(p.relative_to(workdir)), p.stat().st_size)
                for p in workdir.rglob("*") if store.CHECKPOINTS in str(p))


@pytest.fixture(scope="module")
def per_host_run(tmp_path_factory):
  """2 hosts, each its own workdir, host 1 SIGKILLed after its checkpoint 3 and both
  restarted by the launcher: (workdir, launcher, its output), run once. The tests below
  check it, each on a copy of its workdirs."""
  work = tmp_path_factory.mktemp("per_host") / "run"
  launcher = launch_per_host(work, max_restarts=1)
  wait_for_checkpoint(work / "host1", 3, launcher)  # round dirs only: partial ones are not
  time.sleep(random.uniform(0, 0.5))
  os.kill(host_pid(launcher, 1), signal.SIGKILL)
  text = launcher.communicate(timeout=300)[0]
  return work, launcher, text


@pytest.mark.slow
@pytest.mark.multihost
def test_per_host_workdirs_resume_bit_identically_heal_and_refuse_a_divergence(
    tmp_path, references, per_host_run):
  """2 hosts, each its own workdir. SIGKILL of host 1 after its checkpoint 3: the launcher
  restarts both, which agree on the newest round both hold and end where the uninterrupted
  shared-workdir run ends, every round's anchor hash included. Then host 1's last
  checkpoint is made to disagree with host 0's (one bit, with a matching hash): refused,
  nothing deleted. Then host 1's workdir is deleted: the same command heals it from host 0
  (bench/chaos.py heals hosts mid-run)."""
  reference = references("sync")
  work = tmp_path / "run"
  shutil.copytree(per_host_run[0], work)
  _, launcher, text = per_host_run
  assert launcher.returncode == 0, text[-4000:]
  assert "host 1 killed by signal 9" in text and "restart 1/1" in text, text[-4000:]
  assert "checkpoints in a workdir per host" in text and "resumed from checkpoint" in text
  same_run(work / "host0", reference)
  # every host keeps its own records (live membership): the same anchors every round
  assert ([r["anchor_hash"] for r in records(work / "host1")]
          == [r["anchor_hash"] for r in records(work / "host0")])
  assert host_checkpoints(work, 0) == host_checkpoints(work, 1) == [8, 9, 10]

  ckpt = work / "host1" / store.CHECKPOINTS / "10"
  meta = json.loads((ckpt / "meta.json").read_text())
  record = meta["files"]["shared.safetensors"]
  shared = {k: v.copy() for k, v in safetensors.numpy.load_file(
      ckpt / "shared.safetensors").items()}
  first = shared[record["leaves"][0]]
  first.reshape(-1).view(np.uint8)[0] ^= 1  # one bit of the anchor, and hashes that match
  safetensors.numpy.save_file(shared, ckpt / "shared.safetensors")  # it: a real divergence
  raw = (ckpt / "shared.safetensors").read_bytes()
  record.update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
  meta["shared_sha256"] = state_lib.fingerprint([shared[n] for n in record["leaves"]])
  del meta[files.META_SHA]
  files.write_meta(str(ckpt / "meta.json"), meta)
  before = checkpoint_files(work)
  launcher = launch_per_host(work)
  text = launcher.communicate(timeout=300)[0]
  assert launcher.returncode != 0
  assert re.search(r"hosts disagree on the shared state of round 10: host 0 \(\S+\): sha256 "
                   r"\w{12}; host 1 \(\S+host1/checkpoints\): sha256", text), text[-3000:]
  assert checkpoint_files(work) == before

  shutil.rmtree(work / "host1")
  text = launch_per_host(work).communicate(timeout=300)[0]
  assert "host 1 healed from host 0: outer state" in text, text[-4000:]
  assert "the run had finished" in text and "final eval loss" in text
  with open(work / "host0" / "run.json") as f:
    start = json.load(f)["start"]
  assert (start["round"], start["hosts_from_anchor"], start["healed_from"]) == (10, [1], 0)
  assert start["heal_bytes"] > 0


def overwrite_middle(path, size=4096):
  """`size` bytes in the middle of the file replaced by others (a disk's bad write)."""
  raw = bytearray(path.read_bytes())
  size = min(size, len(raw) // 4)
  start = (len(raw) - size) // 2
  raw[start:start + size] = bytes(255 - b for b in raw[start:start + size])
  path.write_bytes(bytes(raw))
  return bytes(raw)


@pytest.mark.slow
@pytest.mark.multihost
def test_per_host_damaged_files_are_named_and_never_trained_on(tmp_path, references,
                                                                per_host_run):
  """The per-host run above, its newest checkpoint damaged: 4 KiB overwritten in the
  middle of host 1's own file, then (again) of host 0's shared file. Each time the same
  command names the file in one line (sha256 mismatch), both hosts resume from the round
  before, which both hold, and the run ends where the uninterrupted run ends, every
  round's anchor hash included; the damaged checkpoint is kept in checkpoints_unreadable/.
  (A host left with no readable checkpoint heals from a peer: tests/test_storage.py.)"""
  reference = references("sync")
  work = tmp_path / "run"
  shutil.copytree(per_host_run[0], work)
  for host, item in ((1, "own"), (0, "shared")):
    path = work / f"host{host}" / store.CHECKPOINTS / "10" / f"{item}.safetensors"
    damaged = overwrite_middle(path)
    launcher = launch_per_host(work)
    text = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, text[-4000:]
    named = [line for line in text.splitlines() if str(path) in line]
    assert len(named) == 1 and f"checkpoint 10 not used: {path}: sha256 mismatch" in named[0], (
        named or text[-4000:])
    assert "resumed from checkpoint 9" in text, text[-4000:]
    same_run(work / "host0", reference)
    assert host_checkpoints(work, 0) == host_checkpoints(work, 1) == [8, 9, 10]
    aside = sorted((work / f"host{host}" / store.UNREADABLE).iterdir())[-1]
    assert (aside / path.name).read_bytes() == damaged
