"""The trainer across host processes on localhost: same numbers as one host, and failures
that stop every host quickly and clearly."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import multihost

pytestmark = pytest.mark.multihost


def assert_same_leaves(a, b, atol=0.0):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    if atol == 0.0:
      np.testing.assert_array_equal(x, y)
    else:
      np.testing.assert_allclose(x, y, atol=atol, rtol=0)


TOKEN = "the-join-token-of-this-test-0123456789"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "delayed", "eager", "ddp"])
def test_two_hosts_equal_one_host(tmp_path, mode):
  """2 hosts x 1 replica and 1 host x 2 replicas: the same shards (g = host * R + r), the
  same per-replica programs, and Σ over two replicas is a + b either way: bit-identical.
  The two hosts share a join token, which appears in no output and no file they wrote.
  DiLoCo's two hosts run balance 'speed', as fast as each other give or take 5%: they
  decide equal steps every round, and the weighted rule is then the plain one, bit for bit."""
  (tmp_path / "two").mkdir()
  (tmp_path / "one").mkdir()
  speed = {} if mode == "ddp" else dict(
      balance="speed", balance_every=1, _pace={"seconds": [0.01, 0.01], "jitter": 0.05})
  two = multihost.run_hosts(tmp_path / "two", 2, mode=mode, replicas_per_host=1,
                            debug_checks=True, num_rounds=3, **speed,
                            env={**multihost.ENV, "DILOCO_JOIN_TOKEN": TOKEN})
  if speed:  # every round's steps came with its sum: timed on both hosts from round 2 on
    assert [r["hosts_steps"] for r in two[0]["records"]] == [[4, 4]] * 3
    assert [r["hosts_busy"][1] > 0 for r in two[0]["records"]] == [False, True, True]
  assert "hosts authenticated by the join token from $DILOCO_JOIN_TOKEN" in two[0]["output"]
  assert not any(TOKEN in h["output"] for h in two)
  # gloo's own connection lines are kept out; each host names its devices its own way
  assert not any("[Gloo]" in h["output"] for h in two)
  assert "host 1/2: 1 local device(s) ['cpu:0']" in two[1]["output"]
  written = [p for p in (tmp_path / "two").rglob("*") if p.is_file()]
  assert any(p.name == "run.json" for p in written) and any("checkpoints" in p.parts
                                                             for p in written)
  assert not [p for p in written if TOKEN.encode() in p.read_bytes()]
  one = multihost.run_hosts(tmp_path / "one", 1, mode=mode, replicas_per_host=2, num_rounds=3)
  assert_same_leaves(two[0]["leaves"], two[1]["leaves"])  # every host holds the same anchor
  assert_same_leaves(two[0]["leaves"], one[0]["leaves"])
  if mode == "ddp":  # per step a float32 gradient sum (2 hosts: 4 bytes per param), per
    params = sum(x.size for x in two[0]["leaves"])  # round one float32 loss sum
    assert [r["bytes_sent"] for r in two[0]["records"][1:]] == [4 * 4 * params + 4] * 2
  if mode != "ddp":  # debug checks compared the replicated outer state after every round
    assert [len(r["anchor_hash"]) for r in two[0]["records"]] == [16, 16, 16]
  if mode != "ddp":  # the same math as simulate (float32; see test_trainer_equals_simulate)
    expected = multihost.simulate_trainer(multihost.small_config(
        mode=mode, replicas_per_host=2, num_rounds=3))
    assert_same_leaves(two[0]["leaves"], jax.tree.leaves(expected.params), atol=2e-5)
  # The reported loss is summed in another order (per host, then across): an ulp or so.
  np.testing.assert_allclose([r["train_loss"] for r in two[0]["records"]],
                             [r["train_loss"] for r in one[0]["records"]], rtol=1e-6)


@pytest.mark.slow
def test_fragments_and_compression_identical_on_every_host(tmp_path):
  """3 hosts x 2 replicas, streaming (P = 2, τ = 1, α = 0.5) with 4-bit Δ on the wire,
  error feedback and a trimmed mean, host 2's second replica sending Δ x 1e6 at every
  sync: after every round the debug check hashed both fragments' outer states on every
  host and found them equal; the final models are equal bit for bit and finite, and the
  bytes each host sent are far below a float32 exchange."""
  results = multihost.run_hosts(
      tmp_path, 3, mode="streaming", debug_checks=True, num_rounds=3, **{
          "model.num_layers": 2, "outer.fragments": 2, "outer.overlap_steps": 1,
          "outer.merge_alpha": 0.5, "outer.compression": "4bit",
          "outer.aggregation": "trimmed_mean"},
      _poison={"host": 2, "replica": 1, "value": 1e6})
  for other in results[1:]:
    assert_same_leaves(results[0]["leaves"], other["leaves"])
  assert all(np.isfinite(x).all() for x in results[0]["leaves"])
  records = results[0]["records"]
  assert [len(r["anchor_hash"]) for r in records] == [16, 16, 16]
  assert [r["fragments_synced"] for r in records] == [1, 2, 2]
  params = sum(x.size for x in results[0]["leaves"])
  # A trimmed mean sends every replica's Δ (R = 2 rows): 2 x 0.13 of float32 per sync,
  # against 2 x (n−1)/n x 4 bytes per entry for a float32 ring all-reduce of one row.
  assert records[-1]["bytes_sent"] < 0.3 * (2 * 2 / 3 * 4 * params)
  assert records[-1]["bytes_peak"] < records[-1]["bytes_sent"]


def train_cmd(tmp_path, host, num_hosts, port, *extra):
  return [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
          f"--workdir={tmp_path}/work", f"--coordinator_address=127.0.0.1:{port}",
          f"--num_hosts={num_hosts}", f"--host_id={host}", *extra]


def test_missing_host_stops_the_others_within_timeout(tmp_path):
  """Hosts 0 and 1 of 3 start; host 2 never does. Both stop, non-zero, at the timeout."""
  port = multihost.free_port()
  t0 = time.monotonic()
  procs = [multihost.start(train_cmd(tmp_path, h, 3, port, "--initialization_timeout=5"))
           for h in (0, 1)]
  results = multihost.finish(procs, timeout=90)
  elapsed = time.monotonic() - t0
  for code, text in results:
    assert code != 0
    assert "not every host joined" in text and "--initialization_timeout=5s" in text, text
  assert elapsed < 5 + 30  # the timeout, plus interpreter and jax start-up on a busy CPU


def test_different_configs_stop_every_host(tmp_path):
  port = multihost.free_port()
  procs = [multihost.start(train_cmd(tmp_path, 0, 2, port, "--initialization_timeout=60")),
           multihost.start(train_cmd(tmp_path, 1, 2, port, "--initialization_timeout=60",
                                     "--config.outer.lr=0.5"))]
  for code, text in multihost.finish(procs, timeout=90):
    assert code != 0
    assert "config.outer.lr: host 0=0.7, host 1=0.5" in text, text[-3000:]


def test_join_tokens_that_differ_stop_every_host(tmp_path):
  """Host 0 reads its token from a file, host 1 from the environment, and they differ: host
  1 fails the coordinator's handshake (its key comes from the token) and stops at once,
  naming host 0; host 0 says a connection failed its key, and stops at its initialization
  timeout (a stranger's connection fails the same way: it must not stop a job). Neither
  prints a token."""
  tokens = ["the-token-in-host-zeros-file-4242", "the-token-in-host-ones-env-1717"]
  (tmp_path / "token").write_text(tokens[0] + "\n")
  port = multihost.free_port()
  t0 = time.monotonic()
  procs = [multihost.start(train_cmd(tmp_path, 0, 2, port, "--initialization_timeout=20",
                                     f"--join_token_file={tmp_path}/token")),
           multihost.start(train_cmd(tmp_path, 1, 2, port, "--initialization_timeout=60"),
                           env={**multihost.ENV, "DILOCO_JOIN_TOKEN": tokens[1]})]
  (code0, text0), (code1, text1) = multihost.finish(procs, timeout=90)
  assert code1 != 0
  assert "join token mismatch: host 0's join token differs from this host's" in text1, (
      text1[-3000:])
  assert code0 != 0
  assert "a connection failed this job's key: its handshake failed" in text0, text0[-3000:]
  assert "not every host joined" in text0, text0[-3000:]
  assert not any(t in text0 + text1 for t in tokens)
  assert time.monotonic() - t0 < 60  # host 0's initialization timeout, and start-up


@pytest.mark.slow
def test_a_host_whose_anchor_diverged_is_named(tmp_path):
  """3 hosts; host 1's anchor changes in one entry after round 3. With the default
  anchor_check_every (10) and no debug_checks, every host hashes after round 10, reads the
  others' hashes in round 11 and stops, naming round 10 and host 1."""
  procs = multihost.start_hosts(tmp_path, 3, replicas_per_host=1, num_rounds=12,
                                eval_every=100, _corrupt={"host": 1, "round": 3})
  for code, text in multihost.finish(procs, timeout=180):
    assert code != 0
    assert ("round 10: the outer state differs between hosts: host 1 diverged from the "
            "others") in text, text[-3000:]


@pytest.mark.slow
def test_killed_host_stops_the_launcher(tmp_path):
  """SIGKILL of host 1 mid-run of a job whose hosts share fate (ddp: a gradient sum per
  step, on jax.distributed): host 0 stops at once and the launcher exits non-zero, no
  host left behind. (A DiLoCo job's hosts train on: tests/test_live.py.)"""
  launcher = multihost.start([sys.executable, "launch/local.py", "--hosts=2", "--",
                              "--config=configs/tiny.py", f"--workdir={tmp_path}",
                              "--config.num_rounds=200", "--heartbeat_timeout=20",
                              "--config.mode=ddp"])
  lines = []
  for line in launcher.stdout:  # wait until training runs on both hosts
    lines.append(line)
    if "round   2/200" in line:
      break
  else:
    raise AssertionError("".join(lines[-50:]))
  hosts = [p for p in multihost.children(launcher.pid)  # (not the coordinator beside them)
           if "diloco_jax.train" in open(f"/proc/{p}/cmdline").read()]
  assert len(hosts) == 2, hosts
  victim = next(p for p in hosts if "--host_id=1" in open(f"/proc/{p}/cmdline").read()
                .replace("\0", " "))
  t0 = time.monotonic()
  os.kill(victim, signal.SIGKILL)
  rest = launcher.communicate(timeout=20)[0]  # the heartbeat timeout
  # At once: the launcher sees the exit (it polls every 0.1 s) and kills host 0 (measured:
  # 0.25 s), long before host 0's heartbeat timeout would end it.
  assert time.monotonic() - t0 < 5
  assert launcher.returncode != 0
  assert "host 1 killed by signal 9" in rest
  time.sleep(0.5)
  assert not [p for p in hosts if multihost.alive(p)], "orphaned host processes"


@pytest.mark.slow
def test_slurm_environment_is_detected(tmp_path):
  """No flags under SLURM: JAX's auto-detection finds the coordinator, hosts and ids."""
  port = multihost.free_port()
  procs = []
  for host in range(2):
    env = {**multihost.ENV, "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
           "SLURM_NTASKS": "2", "SLURM_PROCID": str(host), "SLURM_LOCALID": str(host),
           "JAX_COORDINATOR_PORT": str(port)}
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.num_rounds=1", "--config.inner_steps=2",
         "--config.inner.warmup_steps=1", "--config.replicas_per_host=1",
         "--initialization_timeout=60"], cwd=multihost.REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
  results = multihost.finish(procs, timeout=120)
  for code, text in results:
    assert code == 0, text[-3000:]
  assert "host 1/2: 1 local device(s)" in results[1][1]
  assert "round 1/1" in results[0][1] and "2 replicas (2 host(s) x 1)" in results[0][1]
