"""Live membership (issues 45, 46): 3 hosts with a workdir each, launched with a membership
coordinator (launch/local.py --rejoin_after; no flag for membership). Host 1 is SIGKILLed
mid-run and its disk wiped; the launcher starts it again and it joins the running job;
later host 0 (the
seat of the old coordinator, metrics writer and lock holder) is SIGKILLed, or leaves on a
SIGTERM of its own, and stays away; then a SIGTERM stops the others, each with a
checkpoint. Host 2 trains throughout without a restart, in every mode that takes live
membership (sync: a fourth host id joins too), each with a wire format of its own (int8,
SparseLoCo, 4-bit, a trimmed mean). One run per mode, checked many ways: the
launcher's exit, host 2's one process, the join's line and run.json, the records (the
replicas and hosts of each round's sum going 3 -> 2 -> 3 -> 2), the hosts' anchors compared
every round (debug_checks) and equal in the records of the rounds they share, the joiner's
and host 2's checkpoints on their disks."""

import json
import os
import re
import shutil
import signal
import sys
import time

import pytest

from tests import hostile
from tests import multihost

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ROUNDS = 10


def records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("mode, per_host, leave, hosts, extra", [
    # A workdir per host (on disks of their own) or one shared: either way each host's
    # checkpoints and records are in WORKDIR/host<i>. Host 0 is SIGKILLed, or leaves on
    # SIGTERM (a preemption of that host alone: a checkpoint of its own, exit 0). sync: a
    # fourth host id, never seen before, joins too, a second after the start.
    # Each run sends one of the wire formats slow links need (its sums change K as hosts
    # come and go): int8, SparseLoCo, 4-bit, and a trimmed mean whose trim takes one from
    # each end of 3 or 4 replicas and is the mean of 2 (the rounds without host 0 or 1).
    ("sync", True, signal.SIGKILL, 4, ["--config.outer.compression=int8"]),
    ("delayed", False, signal.SIGTERM, 3, [
        "--config.outer.compression=chunk_topk", "--config.outer.topk_fraction=0.0625",
        "--config.outer.error_feedback_decay=0.95"]),
    ("eager", True, signal.SIGKILL, 3, ["--config.outer.compression=4bit"]),
    ("streaming", False, signal.SIGTERM, 3, ["--config.outer.fragments=2",
                                             "--config.inner_steps=6",
                                             "--config.outer.aggregation=trimmed_mean",
                                             "--config.outer.trim=0.34"])])
def test_a_wiped_host_joins_live_and_the_others_outlive_host_0(tmp_path, mode, per_host,
                                                               leave, hosts, extra):
  launcher = multihost.start([
      sys.executable, "launch/local.py", "--hosts=3", f"--max_hosts={hosts}",
      "--join_later=1", "--lease_s=3", "--rejoin_after=1", "--max_restarts=1",
      *(["--workdir_per_host"] if per_host else []), "--",
      "--config=configs/tiny.py", f"--workdir={tmp_path}", f"--config.mode={mode}",
      # a cap: the run is stopped by SIGTERM a few rounds after host 0's loss
      "--config.replicas_per_host=1", "--config.num_rounds=1000",
      "--config.inner_steps=5", "--config.inner.warmup_steps=5", "--config.eval_every=2",
      "--config.debug_checks=True", "--config.wire_timeout=120", *extra],
      env={**multihost.ENV, "JAX_LOG_COMPILES": "1"})  # jax's line for each program it builds
  pids, lines, joined, events, whole = {}, [], None, [], False
  window = []  # host 1's join, then host 0's loss: the rounds a joiner meets in a whole job
  for line in launcher.stdout:
    lines.append(line)
    if len(pids) < 3:
      for pid in multihost.children(launcher.pid):
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        m = re.search(r"diloco_jax\.train .*--host_id=(\d)", cmd)
        if m:
          pids[int(m.group(1))] = pid
    if joined is None and (m := re.search(r"\[host 1\] host 1 joined at round (\d+)", line)):
      joined = int(m.group(1))
      window.append(len(lines))
    if whole is False and (hosts == 3 or (m := re.search(r"\[host 3\] host 3 joined at round "
                                                    r"(\d+)", line))):
      whole = 0 if hosts == 3 else int(m.group(1)) + 2  # after its catch-up round
    m = re.search(r"\] round +(\d+)/", line)
    if not m:
      continue
    r = int(m.group(1))
    if not events and whole is not False and r >= max(3, whole):  # (the fourth host first)
      os.kill(pids[1], signal.SIGKILL)
      multihost.wait_dead(pids[1])  # its files are no longer written
      shutil.rmtree(os.path.join(tmp_path, "host1"))  # a new machine in its place
      events.append("killed 1")
    elif joined is not None and r >= joined + 3 and len(events) == 1:
      os.kill(pids[0], leave)
      events.append("killed 0")
      window.append(len(lines))
    elif len(events) == 2 and r >= joined + 6 and not multihost.alive(pids[0]):
      launcher.send_signal(signal.SIGTERM)  # the job stops: each host with a checkpoint
      events.append("stopped")
  launcher.wait(timeout=600)
  text = "".join(lines)
  assert launcher.returncode == 0, text[-6000:]
  assert events == ["killed 1", "killed 0", "stopped"], (events, text[-6000:])
  # Host 2 is the process it was at the start: registered once, never started again.
  assert text.count(f"[host 2] host 2 of {hosts} hosts: registering") == 1, text[-6000:]
  assert "host 1 killed by signal 9" in text
  if leave == signal.SIGKILL:
    assert "host 0 killed by signal 9" in text
  else:  # it left: its checkpoint, exit 0 (no restart: the budget was spent on host 1)
    assert "[launcher] host 0 left the job (its checkpoint saved)" in text, text[-6000:]
    assert re.search(r"\[host 0\] preempted: stopped after round \d+", text), text[-6000:]
  assert "starting host 1 again (restart 1/1): it joins the running job" in text
  assert "starting host 0 again" not in text  # the budget was spent on host 1
  # The join, in the members' line and the joiner's run.json.
  m = re.search(r"host\(s\) \[1\] joined at round (\d+): state [0-9.]+ \w+ from host (\d) "
                r"in [0-9.]+ s", text)
  assert m and int(m.group(1)) == joined, text[-6000:]
  with open(os.path.join(tmp_path, "host1", "run.json")) as f:
    start = json.load(f)["start"]
  assert start["joined"]["round"] == joined and start["joined"]["bytes"] > 0, start
  assert start["joined"]["source"] == int(m.group(2))
  assert ("each host keeps its checkpoints and records in" in text) == (not per_host)
  assert "the rehearsal of a round failed" not in text, text[-6000:]  # (join.rehearse)
  # Its rehearsal compiled every program of its catch-up round and of a whole job's rounds
  # (jit keys a program by its arguments' shardings and by which are None): from its join
  # until host 0's loss, host 1 compiles nothing, and the members never wait for it to.
  compiled = [i for i, line in enumerate(lines)
              if line.startswith("[host 1]") and "Compiling jit(" in line]
  assert compiled and compiled[0] < window[0], text[-6000:]  # (jax says so, here)
  late = [lines[i] for i in compiled if window[0] <= i < window[1]]
  assert not late, [re.search(r"Compiling (\S+) with", line).group(1) for line in late]
  # Host 2's records: every round once; 3 replicas, 2 after host 1's loss, 3 once it has
  # joined, 2 after host 0's loss. One replica per host.
  host2 = records(os.path.join(tmp_path, "host2"))
  rounds = [r["round"] for r in host2]
  assert rounds == list(range(1, len(rounds) + 1)), rounds
  replicas = [r["replicas"] for r in host2]
  assert replicas == [r["live_hosts"] for r in host2]
  changes = [replicas[0]] + [b for a, b in zip(replicas, replicas[1:]) if b != a]
  if hosts == 4:  # host 3 joined first: from then on, one host more
    assert re.search(r"\[host 3\] host 3 joined at round \d+: state", text), text[-6000:]
    changes = changes[changes.index(4):]
  assert changes == [hosts, hosts - 1, hosts, hosts - 1], replicas
  # The anchors were compared across the live hosts after every round (debug_checks stops
  # the run on a difference); the joiner's and host 0's records agree with host 2's where
  # they have the same round.
  # (The joiner's record of the round it joined at, in the async modes, holds only the
  # figures of the sum that was in flight: its outer step of that round was the members'.)
  by_round = {r["round"]: r for r in host2}
  for other in ("host1", "host0"):
    theirs = [r for r in records(os.path.join(tmp_path, other))
              if r["round"] in by_round and r["round"] > (joined if other == "host1" else 0)]
    assert len(theirs) >= 3, (other, len(theirs))
    for r in theirs:
      assert by_round[r["round"]]["anchor_hash"] == r["anchor_hash"], (other, r["round"])
  assert min(r["round"] for r in records(os.path.join(tmp_path, "host1"))) >= joined
  # The stop (the launcher's SIGTERM goes to the coordinator): every host left stopped after
  # the same round, with its own checkpoint of it, and its records end there.
  assert "[coordinator] coordinator: stopping the job" in text, text[-6000:]
  stopped_at, last_records = set(), set()
  for host in (1, 2, 3)[:hosts - 1]:
    saved = [int(n) for n in os.listdir(os.path.join(tmp_path, f"host{host}", "checkpoints"))
             if n.isdigit()]
    assert max(saved) >= joined + 6, (host, saved)
    with open(os.path.join(tmp_path, f"host{host}", "checkpoints", str(max(saved)),
                           "meta.json")) as f:
      meta = json.load(f)
    assert not meta["finished"]
    stopped_at.add(max(saved))
    # (a checkpoint that holds a sum in flight, in the async modes, is a round past the
    # last record: that round's record is written when its sum's figures arrive, on resume)
    last_records.add(records(os.path.join(tmp_path, f"host{host}"))[-1]["round"]
                     + int(meta["inflight"]))
  # each host's newest checkpoint is of the round of its last record, the same on every host
  assert len(stopped_at) == 1 and stopped_at == last_records, (stopped_at, last_records)


def _live_job(workdir, *flags, rounds=ROUNDS, env=None):
  return multihost.start([
      sys.executable, "launch/local.py", "--hosts=3", "--lease_s=3", "--",
      "--config=configs/tiny.py", f"--workdir={workdir}", "--config.replicas_per_host=1",
      f"--config.num_rounds={rounds}", "--config.inner_steps=5",
      "--config.inner.warmup_steps=5", "--config.checkpoint.every=1", *flags], env=env)


def _is_coordinator(pid: int) -> bool:
  try:
    return "membership.coordinator" in open(f"/proc/{pid}/cmdline").read()
  except OSError:
    return False


def test_a_live_job_goes_on_through_strangers_frames_and_a_coordinator_restart(tmp_path):
  """A job with a join token, and a stranger who sends junk, 1 GiB frames and messages whose
  last part never comes to the coordinator's port and every host's ports throughout; the
  coordinator SIGKILLed mid-run. The launcher starts it again on its port; the hosts, the
  same processes, keep their state, register again and finish every round together (the
  anchors compared after every round: debug_checks), with no line of failure, and no
  process's memory grows with what the stranger sends. (7bb7343: random bytes ended the
  coordinator, an unfinished message grew a host without bound, and the coordinator's loss
  stopped every host with exit 1.)"""
  env = {**multihost.ENV, "DILOCO_JOIN_TOKEN": "a-join-token-for-the-strangers-test"}
  launcher = _live_job(tmp_path, "--config.debug_checks=True", env=env)
  stranger = hostile.Stranger(lambda: {p: hostile.listening_ports(p)
                                       for p in multihost.children(launcher.pid)})
  stranger.start()
  lines, hosts_at_kill, hosts_later, coordinators = [], None, None, set()
  for line in launcher.stdout:
    lines.append(line)
    if hosts_at_kill is None and re.search(r"\] round +4/", line):
      kids = multihost.children(launcher.pid)
      coordinator = next(p for p in kids if _is_coordinator(p))
      hosts_at_kill = sorted(p for p in kids if p != coordinator)
      coordinators.add(coordinator)
      os.kill(coordinator, signal.SIGKILL)
    if hosts_later is None and re.search(rf"\] round +{ROUNDS - 1}/", line):
      kids = multihost.children(launcher.pid)
      coordinators.update(p for p in kids if _is_coordinator(p))
      hosts_later = sorted(p for p in kids if not _is_coordinator(p))
  launcher.wait(timeout=300)
  stranger.stop()
  text = "".join(lines)
  assert launcher.returncode == 0, text[-6000:]
  assert "[launcher] the coordinator killed by signal 9; starting it again" in text, text[-6000:]
  assert len(hosts_at_kill) == 3 and hosts_later == hosts_at_kill, (hosts_at_kill, hosts_later)
  for h in range(3):
    assert f"[host {h}] host {h}: registered again with the coordinator" in text, text[-6000:]
  assert "Stopped:" not in text and "Traceback" not in text, text[-6000:]
  finals = set()
  for h in range(3):
    mine = records(os.path.join(tmp_path, f"host{h}"))
    assert [r["round"] for r in mine] == list(range(1, ROUNDS + 1)), h
    finals.add(mine[-1]["anchor_hash"])
  assert len(finals) == 1, finals
  # the stranger reached every process, many times: the coordinator before and after its
  # restart, and every host's wire port
  assert min(stranger.sent.values()) >= 10, stranger.sent
  assert set(hosts_at_kill) | coordinators <= set(stranger.peak), (stranger.peak, coordinators)
  figures = {f"{'coordinator' if p in coordinators else 'host'} {p}":
             (round(stranger.first[p]), round(stranger.peak[p])) for p in stranger.peak}
  print(f"RSS MiB (first sample, peak) under {stranger.sent}: {figures}")
  for p in coordinators:
    assert stranger.peak[p] < 150, figures  # a python process with zmq: ~40 MiB
  for p in hosts_at_kill:
    assert stranger.peak[p] < 640, figures  # a tiny job's host: 450 MiB
  # a line per address and reason (per process, per epoch on the wire), then one a minute
  handshakes = [line for line in lines if "handshake failed" in line]
  assert 4 * len(handshakes) <= sum(stranger.sent.values()), (handshakes, stranger.sent)


def test_host_0_started_again_serves_the_job_anew_and_host_1_goes_on(tmp_path):
  """The README's command (host 0 serves the coordinator): host 0 SIGKILLed mid-run and
  started again with the same command within the grace. Host 1, the same process, keeps
  its state, registers with host 0's new coordinator and goes on; host 0 finds the job
  running and joins it at a round boundary with its state. Both finish on one anchor.
  (7bb7343: host 1 stopped, and the whole job had to be started again.)"""
  port = multihost.free_port()

  def host(i):
    return multihost.start([
        sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
        f"--workdir={tmp_path}", "--config.replicas_per_host=1",
        f"--config.num_rounds={ROUNDS}", "--config.inner_steps=5",
        "--config.inner.warmup_steps=5", "--config.debug_checks=True",
        f"--coordinator_address=127.0.0.1:{port}", "--num_hosts=2", f"--host_id={i}",
        "--heartbeat_timeout=3"])

  first, other = host(0), host(1)
  seen = []
  for line in first.stdout:
    seen.append(line)
    if re.search(r"round +3/", line):
      break
  os.kill(first.pid, signal.SIGKILL)
  first.wait()
  again = host(0)
  (code0, out0), (code1, out1) = multihost.finish([again, other], timeout=240)
  assert code0 == 0 and code1 == 0, (out0[-3000:], out1[-3000:])
  assert "registered again with the coordinator" in out1, out1[-3000:]
  m = re.search(r"host 0 joined at round (\d+): state", out0)
  assert m, out0[-3000:]
  mine, theirs = (records(os.path.join(tmp_path, f"host{h}")) for h in (0, 1))
  assert [r["round"] for r in theirs] == list(range(1, ROUNDS + 1))
  by_round = {r["round"]: r["anchor_hash"] for r in theirs}
  after = [r for r in mine if r["round"] > int(m.group(1))]
  assert after and all(by_round[r["round"]] == r["anchor_hash"] for r in after)


def test_a_refusal_every_host_agrees_on_ends_every_process_with_its_line(tmp_path):
  """An invalid config under live membership: each host its one line and exit 1."""
  launcher = _live_job(tmp_path, "--config.mode=streaming", "--config.outer.fragments=2")
  out, _ = launcher.communicate(timeout=300)
  assert launcher.returncode == 1, out[-6000:]
  for h in range(3):
    refusals = [line for line in out.splitlines() if line.startswith(f"[host {h}] Invalid")]
    assert len(refusals) == 1 and "config.inner_steps = 5" in refusals[0], out[-6000:]
    assert f"host {h} exited with code 1" in out
  assert "Traceback" not in out and "signal 6" not in out and "Check failed" not in out


def test_a_host_frozen_past_its_lease_joins_again_in_the_same_process(tmp_path):
  """Host 2 is SIGSTOPped longer than its lease, mid-run of an async mode (a sum in flight
  on its dispatch thread). The others drop it and train on; woken, it finds itself out of
  the job and joins it again in the same process (no launcher restarts anything here): its
  failed ops end, it takes the members' state at a round boundary and trains on with them
  to the stop, every round's outer state compared across hosts (debug_checks). (7bb7343:
  it stopped with exit 1, and only a launcher with --rejoin_after brought it back.)"""
  launcher = _live_job(tmp_path, "--config.mode=delayed", "--config.debug_checks=True",
                       rounds=1000)
  lines, pid, rejoined, stopped = [], None, None, False
  for line in launcher.stdout:
    lines.append(line)
    m = re.search(r"^\[host \d\] round +(\d+)/", line)
    if pid is None and m and int(m.group(1)) >= 3:
      pid = next(p for p in multihost.children(launcher.pid)
                 if "--host_id=2" in open(f"/proc/{p}/cmdline").read().replace("\0", " "))
      os.kill(pid, signal.SIGSTOP)
      time.sleep(7.0)  # the lease is 3 s
      os.kill(pid, signal.SIGCONT)
    if rejoined is None and (j := re.search(r"^\[host 2\] host 2 joined at round (\d+)", line)):
      rejoined = int(j.group(1))
    if rejoined and m and int(m.group(1)) >= rejoined + 4 and not stopped:
      launcher.send_signal(signal.SIGTERM)  # every host stops after the same round
      stopped = True
  launcher.wait(timeout=300)
  text = "".join(lines)
  assert launcher.returncode == 0 and rejoined, text[-6000:]
  assert re.search(r"\[host 2\] host 2: .*(not in the job any more|dropped from the job).*; "
                   r"it joins the job again", text), text[-6000:]
  assert multihost.alive(pid) is False and "starting host 2 again" not in text
  assert "Traceback" not in text, text[-6000:]
  # The others named it once it had renewed no lease for half of one (lease.interrupt), and
  # it left at once: they did not wait out its lease.
  assert re.search(r"coordinator: epoch \d+: hosts 0,1 \(op \d+ of epoch \d+ failed on "
                   r"host\(s\) 0,1: host 2 named by 2 of the 2 others\)", text), text[-6000:]
  mine = {h: records(os.path.join(tmp_path, f"host{h}")) for h in range(3)}
  assert len({rs[-1]["round"] for rs in mine.values()}) == 1, mine  # stopped together
  assert len({rs[-1]["anchor_hash"] for rs in mine.values()}) == 1
  rounds2 = [r["round"] for r in mine[2]]
  after = [r for r in rounds2 if r > rejoined]  # contiguous from its return on
  assert after == list(range(rejoined + 1, rounds2[-1] + 1)), rounds2
