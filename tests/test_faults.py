"""Fault injection: nothing trained is lost, nothing misleading is said.

Unreadable checkpoints, a second run on a live workdir, torn and garbage metrics lines, a
full disk and Ctrl-C, each injected on purpose; every test is bounded in time."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from diloco_jax.checkpoints import store
from diloco_jax.loop import trainer
from diloco_jax.reporting import writers
from diloco_jax.runtime import preemption
from diloco_jax.runtime import workdir as workdir_lib
from tests import multihost

# Each test trains, kills or restarts whole runs.
pytestmark = pytest.mark.slow

TINY = ["--config=configs/tiny.py", "--config.num_rounds=200", "--config.inner_steps=2",
        "--config.inner.warmup_steps=2", "--config.replicas_per_host=2",
        "--config.debug_checks=True"]


def train_cmd(workdir, *extra):
  return [sys.executable, "-m", "diloco_jax.train", f"--workdir={workdir}", *TINY, *extra]


def read_until(proc, pattern: str, timeout: float = 120) -> str:
  """Output of `proc` up to the first line containing `pattern`."""
  lines, deadline = [], time.monotonic() + timeout
  for line in proc.stdout:
    lines.append(line)
    if pattern in line:
      return "".join(lines)
    assert time.monotonic() < deadline, "".join(lines[-40:])
  raise AssertionError("".join(lines[-40:]))


def snapshot_files(root) -> dict[str, bytes]:
  """Every file under `root` (but the lock) with its bytes."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file() and p.name != workdir_lib.LOCK}


def records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_unreadable_checkpoints_are_refused_every_time_until_restart_from_scratch(tmp_path):
  config = multihost.small_config(num_rounds=2)
  trainer.train_and_evaluate(config, str(tmp_path))
  for meta in (tmp_path / store.CHECKPOINTS).glob("*/meta/metadata"):
    meta.write_text("{not json")
  before = snapshot_files(tmp_path)
  for _ in range(2):  # the first attempt, and the same command again
    with pytest.raises(store.CheckpointError, match=r"no checkpoint .* could be read.*"
                       r"left where they are.*--restart_from_scratch"):
      trainer.train_and_evaluate(config, str(tmp_path))
    assert snapshot_files(tmp_path) == before  # nothing moved, nothing rewritten
  # A launcher restarting the failed host refuses as well, each time.
  proc = multihost.start([sys.executable, "launch/local.py", "--hosts=1", "--max_restarts=1",
                          "--", f"--workdir={tmp_path}", "--config=configs/tiny.py"])
  text = proc.communicate(timeout=180)[0]
  assert proc.returncode != 0 and "restart 1/1" in text, text[-3000:]
  assert text.count("could be read") == 2, text[-3000:]
  assert snapshot_files(tmp_path) == before
  # Explicitly starting over keeps the old run, moved aside.
  result = trainer.train_and_evaluate(config, str(tmp_path), restart_from_scratch=True)
  assert [r["round"] for r in result.records] == [1, 2]
  (old,) = (tmp_path / workdir_lib.PREVIOUS).iterdir()
  assert {k: v for k, v in snapshot_files(old).items()} == before


def test_second_run_on_a_live_workdir_is_refused_and_a_stale_lock_is_not(tmp_path):
  first = multihost.start(train_cmd(tmp_path, "--config.checkpoint.keep=1000"))
  read_until(first, "round   3/200")
  ckpts = tmp_path / store.CHECKPOINTS
  finished = lambda: {d.name: snapshot_files(d) for d in ckpts.iterdir() if d.name.isdigit()}
  before = finished()  # complete checkpoints, which orbax never changes again
  second = subprocess.run(train_cmd(tmp_path, "--config.num_rounds=3"), cwd=multihost.REPO,
                          env=multihost.ENV, capture_output=True, text=True, timeout=120)
  assert second.returncode != 0
  assert f"in use by another run (pid {first.pid} on " in second.stderr, second.stderr
  assert "Traceback" not in second.stderr + second.stdout
  assert {k: v for k, v in finished().items() if k in before} == before  # untouched
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["round"] for line in f][:2] == [1, 2]
  first.kill()  # SIGKILL: the lock file stays, its flock goes with the process
  first.communicate()
  assert (tmp_path / workdir_lib.LOCK).exists()
  third = subprocess.run(train_cmd(tmp_path, "--config.num_rounds=3"), cwd=multihost.REPO,
                         env=multihost.ENV, capture_output=True, text=True, timeout=300)
  # It takes the lock over; the run itself refuses the changed num_rounds, naming it.
  assert "taken over" in third.stdout, third.stdout[-2000:] + third.stderr[-2000:]
  assert "config.num_rounds: checkpoint 200, now 3" in third.stderr


def test_torn_metrics_line_is_repaired_and_garbage_is_refused(tmp_path, monkeypatch, capfd):
  config = multihost.small_config(num_rounds=4, **{"checkpoint.every": 0})
  reference = trainer.train_and_evaluate(config, str(tmp_path / "ref"))
  run = tmp_path / "run"
  with monkeypatch.context() as m:
    m.setattr(preemption.Preemption, "reached", lambda self, r: r == 2)
    trainer.train_and_evaluate(config, str(run))
  path = run / "metrics.jsonl"
  good = path.read_text()
  path.write_text(good + '{"round": 3, "train_loss": 2.7')  # cut short by a crash
  capfd.readouterr()
  resumed = trainer.train_and_evaluate(config, str(run))
  assert "torn last line" in capfd.readouterr().err
  assert ([(r["round"], r["train_loss"]) for r in records(run)] ==
          [(r["round"], r["train_loss"]) for r in reference.records])
  assert [r["train_loss"] for r in resumed.records] == [r["train_loss"] for r in
                                                        reference.records]
  lines = path.read_text().splitlines()
  path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
  with pytest.raises(writers.MetricsError, match=rf"{path}, line 2: .*'garbage'"):
    trainer.train_and_evaluate(config, str(run))


def test_ctrl_c_saves_and_the_same_command_resumes_bit_identically(tmp_path):
  cmd = lambda workdir: train_cmd(workdir, "--config.num_rounds=12")
  reference = subprocess.run(cmd(tmp_path / "ref"), cwd=multihost.REPO, env=multihost.ENV,
                             capture_output=True, text=True, timeout=300)
  assert reference.returncode == 0, reference.stderr[-3000:]
  proc = multihost.start(cmd(tmp_path / "run"))
  text = read_until(proc, "round  3/12")
  proc.send_signal(signal.SIGINT)
  text += proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, text[-3000:]
  assert "Ctrl-C: finishing this round" in text and "Traceback" not in text, text[-3000:]
  stopped = int(text.split("preempted: stopped after round ")[1].split()[0])
  assert stopped < 12
  again = subprocess.run(cmd(tmp_path / "run"), cwd=multihost.REPO, env=multihost.ENV,
                         capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and f"resumed from checkpoint {stopped}" in again.stdout
  for key in ("anchor_hash", "train_loss", "eval_loss"):
    assert ([r.get(key) for r in records(tmp_path / "run")] ==
            [r.get(key) for r in records(tmp_path / "ref")]), key


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_names_the_checkpoint_and_keeps_the_one_before(tmp_path):
  mount = tmp_path / "small"
  mount.mkdir()
  # A checkpoint of this config is 2.2 MB: room for checkpoint 1, not for 2 beside it.
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3500k", "tmpfs", str(mount)],
                           capture_output=True, text=True, check=False)
  if mounted.returncode:  # root without the right to mount (a container, a dropped cap)
    pytest.skip(f"cannot mount a small tmpfs: {' '.join(mounted.stderr.split())}")
  try:
    proc = subprocess.run(train_cmd(mount / "run", "--config.num_rounds=6",
                                    "--config.replicas_per_host=1"), cwd=multihost.REPO,
                          env=multihost.ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Checkpoint error: checkpoint 2 needs about"), proc.stderr[-3000:]
    assert "free: not written" in last and "Traceback" not in proc.stderr
    assert "host" not in last.split("free")[0]  # one host: no word of another host
    kept = mount / "run" / store.CHECKPOINTS
    assert sorted(p.name for p in kept.iterdir() if p.name.isdigit()) == ["1"]
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(mount / "run"), str(copy)], check=True)
  finally:
    subprocess.run(["umount", str(mount)], check=True)
  resumed = subprocess.run(train_cmd(copy, "--config.num_rounds=6",
                                     "--config.replicas_per_host=1"), cwd=multihost.REPO,
                           env=multihost.ENV, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0 and "resumed from checkpoint 1" in resumed.stdout
  assert np.isfinite([r["train_loss"] for r in records(copy)]).all()


@pytest.mark.multihost
def test_a_host_cut_off_stops_the_job_within_the_link_timeout(tmp_path):
  """A ddp job (its hosts share fate, on jax.distributed; a DiLoCo job's would drop the
  silent host after its lease and train on: tests/test_live.py). Host 1 stops answering
  (SIGSTOP: as if its link were down) while the job trains:
  host 0's link watchdog ends it with one "link lost" line within --link_timeout,
  instead of waiting for the heartbeat timeout (here 120 s). bench/linkdrop.py measures
  real link drops between network namespaces (docs/fault-tolerance.md)."""
  port = multihost.free_port()
  hosts = [multihost.start(train_cmd(
      tmp_path, "--config.replicas_per_host=1", f"--coordinator_address=127.0.0.1:{port}",
      "--num_hosts=2", f"--host_id={h}", "--heartbeat_timeout=120", "--link_timeout=5",
      "--config.mode=ddp"))
      for h in range(2)]
  try:
    read_until(hosts[0], "round   3/200")
    os.kill(hosts[1].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    text = hosts[0].communicate(timeout=60)[0]
    elapsed = time.monotonic() - t0
  finally:
    for h in hosts:
      h.kill()
      h.communicate()
  assert hosts[0].returncode == 1, text[-3000:]
  assert "host 0: link lost: no word from host 1" in text, text[-3000:]
  assert elapsed < 5 + 10, elapsed  # the link timeout, and the watchdog's 1 s period
