"""The membership coordinator (membership/coordinator.py) over its sockets and as a process:
leases, epochs that only grow, frames authenticated with a key from the join token, and a
host that outlives the coordinator. The Ledger alone, at fake times: tests/test_ledger.py;
admission at a round boundary: tests/test_admission.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from diloco_jax.membership import coordinator as co
from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import ledger as ledger_lib
from diloco_jax.runtime import security
from diloco_jax.membership.client import CoordinatorLost
from diloco_jax.membership import client as client_lib
from diloco_jax.wire import sealed
from tests.coordinators import LEASE_S
from tests.coordinators import TOKEN
from tests.coordinators import clients
from tests.coordinators import coordinator
from tests.coordinators import free_port


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER = security.JoinToken("another-token-of-another-job", "the test")


def dropped(log: list[str]) -> list[str]:
  return [line for line in log if "dropped a frame" in line]


def test_epochs_follow_registrations_leases_and_leaves():
  port = free_port()
  with coordinator(port) as log, clients(port, 3) as (a, b, c):
    assert a.register("a:1").epoch.number == 1
    rb = b.register("b:1")
    assert (rb.host, rb.epoch.number, rb.epoch.hosts) == (1, 2, (0, 1))
    assert [m.address for m in rb.epoch.members] == ["a:1", "b:1"]
    assert c.register("c:1", host=2).epoch.hosts == (0, 1, 2)
    assert a.heartbeat() == b.heartbeat() == c.heartbeat()  # no change: no new epoch
    assert a.last_epoch == 3
    c.leave()
    assert (a.heartbeat().number, a.heartbeat().hosts) == (4, (0, 1))
    # b stops heartbeating: its lease runs out and a new epoch drops it
    deadline = time.monotonic() + 10 * LEASE_S
    while (epoch := a.heartbeat()).hosts != (0,):
      assert time.monotonic() < deadline, "host 1's lease never ran out"
      time.sleep(LEASE_S / 4)
    assert epoch.number == 5
    assert b.heartbeat() is None  # told to register again, as a new incarnation
    again = b.register("b:2")
    assert (again.host, again.epoch.number) == (1, 6)
    assert again.incarnation != rb.incarnation
    assert a.heartbeat().members[1].address == "b:2"
  assert [line.split(": ", 1)[1] for line in log if ": epoch " in line] == [
      "epoch 1: hosts 0 (host 0 joined)", "epoch 2: hosts 0,1 (host 1 joined)",
      "epoch 3: hosts 0,1,2 (host 2 joined)", "epoch 4: hosts 0,1 (host 2 left)",
      "epoch 5: hosts 0 (lease of host 1 ran out)", "epoch 6: hosts 0,1 (host 1 joined)"]


def test_a_host_that_registers_again_is_a_new_incarnation_and_the_old_one_is_gone():
  port = free_port()
  with coordinator(port), clients(port, 2) as (old, new):
    first = old.register("x:1", host=0)
    second = new.register("x:2", host=0)
    assert second.epoch.number == first.epoch.number + 1
    assert second.epoch.members == (co.Member(0, second.incarnation, "x:2"),)
    assert old.heartbeat() is None


def test_max_hosts_refuses_one_more_host_and_an_id_outside_it():
  port = free_port()
  with coordinator(port, max_hosts=2) as log, clients(port, 4) as (a, b, c, d):
    a.register("a:1")
    b.register("b:1")
    with pytest.raises(co.CoordinatorError, match=r"refused us: all 2 host ids are taken"):
      c.register("c:1")
    with pytest.raises(co.CoordinatorError, match=r"host id 5 is outside 0\.\.1"):
      d.register("d:1", host=5)
    assert a.heartbeat().hosts == (0, 1)
  assert sum("refused" in line for line in log) == 2


def test_another_token_a_forged_frame_and_replays_are_dropped_with_one_line_each():
  port = free_port()
  with coordinator(port) as log, clients(port, 1) as (host,), \
       clients(port, 1, token=OTHER) as (stranger,), clients(port, 1, token=None) as (bare,):
    for intruder in (stranger, bare):  # the coordinator's CURVE key is the token's
      with pytest.raises(client_lib.TokenMismatch, match="ended our handshake"):
        intruder.register("intruder:1")
    epoch = host.register("h:1").epoch  # (each intruder took longer than a lease)

    ctx = zmq.Context()  # a token holder's socket: what it sends is checked all the same
    raw = ctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 2000)
    sealed.connect(raw, co.key_for(TOKEN))
    raw.connect(f"tcp://127.0.0.1:{port}")
    try:
      def send(frames):
        raw.send_multipart(frames)
        return raw.recv_multipart()

      # a well-formed heartbeat with a MAC under no key of ours
      reg = host.registration
      forged = {"op": "heartbeat", "host": 0, "incarnation": reg.incarnation, "seq": 99}
      assert send([co.sign(b"x" * 32, co.C2S, forged)[0], b"\0" * 32])[1] == b""
      # a heartbeat seen on the wire, sent again (its counter does not grow)
      host.heartbeat()
      seen = co.sign(co.key_for(TOKEN), co.C2S, {"op": "heartbeat", "host": 0,
                                                  "incarnation": reg.incarnation, "seq": 2})
      assert co.verify(co.key_for(TOKEN), co.S2C, send(seen))["op"] == "epoch"  # the first time
      assert send(seen)[1] == b""
      # a register whose challenge was answered once already
      hello = co.verify(co.key_for(TOKEN), co.S2C, send(co.sign(
          co.key_for(TOKEN), co.C2S, {"op": "hello", "nonce": "n"})))
      register = co.sign(co.key_for(TOKEN), co.C2S, {
          "op": "register", "challenge": hello["challenge"], "host": 1, "address": "r:1",
          "last_epoch": 0})
      assert co.verify(co.key_for(TOKEN), co.S2C, send(register))["op"] == "registered"
      assert send(register)[1] == b""
    finally:
      ctx.destroy(linger=0)
    lines = dropped(log)
    # one line for both intruders: one reason (the drop log counts the rest)
    assert len(lines) == 4 and sum("its handshake failed" in line for line in lines) == 1, lines
    lines = [line for line in lines if "its handshake failed" not in line]
    assert "not authenticated with this job's key" in lines[0]
    assert "#2 of host 0 after #2 (a replay?)" in lines[1]
    assert "used or expired challenge (a replay?)" in lines[2]
    host._seq = 2  # the raw socket spoke for this host above
    after = host.heartbeat()
    assert after.hosts == (0, 1) and after.number == epoch.number + 1  # only the one register


def test_the_number_only_grows_across_a_restart_of_the_coordinator():
  port = free_port()
  with clients(port, 2) as (a, b):
    with coordinator(port):
      a.register("a:1")
      first = b.register("b:1").epoch
      b.leave()
      assert a.heartbeat().number == 3
    with pytest.raises(CoordinatorLost, match=rf"^no answer from the coordinator at "
                       rf"127\.0\.0\.1:{port} within 1 s \(heartbeat\)"):
      a.heartbeat()
    # (taken before the coordinator starts: it counts its lease from its own start)
    started = time.monotonic()
    with coordinator(port) as log, clients(port, 1) as (newcomer,):
      # it kept nothing: the hosts tell it their ids and the numbers they saw; a newcomer
      # that asks for any id gets one only after a lease, when the others are back
      joined = []
      thread = threading.Thread(target=lambda: joined.append(newcomer.register("c:1")))
      thread.start()
      assert a.heartbeat() is None
      epoch = a.register("a:1").epoch
      assert (epoch.number, epoch.hosts) == (4, (0,)) and epoch.boot != first.boot
      assert b.register("b:1").epoch.number == 5  # under its old id, 1
      while thread.is_alive() and time.monotonic() - started < 5:  # a and b stay alive
        a.heartbeat()
        b.heartbeat()
        thread.join(LEASE_S / 4)
      assert joined[0].host == 2 and joined[0].epoch.number == 6
      assert time.monotonic() - started >= LEASE_S
      assert [line.split(": ", 1)[1] for line in log if ": epoch " in line] == [
          "epoch 4: hosts 0 (host 0 joined)", "epoch 5: hosts 0,1 (host 1 joined)",
          "epoch 6: hosts 0,1,2 (host 2 joined)"]


def test_as_a_process_it_stops_on_sigterm_and_its_loss_is_one_line_on_a_host():
  port = free_port()
  env = dict(os.environ, DILOCO_JOIN_TOKEN="a-join-token-for-the-tests", PYTHONPATH=REPO)
  cmd = [sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={port}",
         "--max_hosts=2", f"--lease_s={LEASE_S}"]

  def start() -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)

  proc = start()
  try:
    with clients(port, 1, timeout_s=5.0) as (host,):
      assert host.register("h:1").epoch.hosts == (0,)  # waits for it to listen
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(5)
      host.timeout_s = 0.5
      with pytest.raises(CoordinatorLost) as lost:
        host.heartbeat()
      assert str(lost.value).count("\n") == 0 and f"127.0.0.1:{port}" in str(lost.value)
      proc = start()
      host.timeout_s = 5.0
      assert host.heartbeat() is None
      assert host.register("h:1").epoch.number == 2
      # SIGTERM stops the job: the coordinator answers until its last host has left
      os.kill(proc.pid, signal.SIGTERM)
      deadline = time.monotonic() + 5
      while not host.stopping and time.monotonic() < deadline:
        host.heartbeat()
      assert host.stopping and proc.poll() is None
      with clients(port, 1, timeout_s=5.0) as (late,):
        with pytest.raises(ledger_lib.JobStopping, match="the job is stopping"):
          late.register("late:1")
      host.leave()
      assert proc.wait(5) == 0
      lines = proc.stderr.read().splitlines()
      assert lines[-1] == "coordinator: stopped", lines
      assert any("asked to stop: every host stops after the same round" in x for x in lines)
  finally:
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(5)


def test_two_hosts_commit_through_sockets_while_heartbeat_threads_share_their_clients():
  port = free_port()
  with coordinator(port), clients(port, 2) as (a, b):
    a.register("a:1")
    e = b.register("b:1").epoch.number
    stop, errors = threading.Event(), []

    def beat(client):
      try:
        while not stop.is_set():
          client.heartbeat()
      except Exception as err:  # noqa: BLE001 -- the test's thread asserts there is none
        errors.append(err)

    verdicts = {}

    def commit(name, client, delay_s):
      try:
        time.sleep(delay_s)
        verdicts[name] = [client.commit(e, step, ok=True) for step in range(3)]
      except Exception as err:  # noqa: BLE001 -- the test's thread asserts there is none
        errors.append(err)

    threads = [threading.Thread(target=beat, args=(c,)) for c in (a, b)]
    threads += [threading.Thread(target=commit, args=("a", a, 0.0)),
                threading.Thread(target=commit, args=("b", b, 0.05))]
    for t in threads[:2]:
      t.start()
    for t in threads[2:]:
      t.start()
    for t in threads[2:]:
      t.join(10)
    stop.set()
    for t in threads[:2]:
      t.join(10)
    assert not errors, errors
    assert verdicts["a"] == verdicts["b"]
    assert [(v.commit, v.epoch.number, v.epoch.hosts) for v in verdicts["a"]] == [
        (True, e, (0, 1))] * 3
    b.close()  # host 1 dies; once its lease runs out, host 0's next vote is a redo without it
    deadline = time.monotonic() + 10 * LEASE_S
    while (epoch := a.heartbeat()).hosts != (0,):
      assert time.monotonic() < deadline, "host 1's lease never ran out"
      time.sleep(LEASE_S / 4)
    redo = a.commit(e, 3, ok=True)
    assert (redo.commit, redo.epoch) == (False, epoch)


def test_a_host_dropped_while_it_waits_for_a_verdict_is_told_so_in_one_line():
  port = free_port()
  with coordinator(port), clients(port, 2) as (a, b):
    a.register("a:1")
    e = b.register("b:1").epoch.number
    # host 1 never votes, and host 0 polls too slowly to keep its own lease
    with pytest.raises(co.CoordinatorError, match=r"^host 0: the coordinator no longer knows "
                       r"this host \(its lease ran out or the coordinator restarted\): it was "
                       r"dropped from the job$"):
      a.commit(e, 0, ok=True, poll_s=2 * LEASE_S, max_poll_s=2 * LEASE_S)


def start_leases(port: int, n: int, grace_s: float) -> list[lease_lib.Lease]:
  """n hosts' leases, started together (each waits for the others)."""
  leases = [None] * n

  def start(h):
    leases[h] = lease_lib.Lease.start(f"127.0.0.1:{port}", host=h, num_hosts=n, token=TOKEN,
                                      timeout_s=5, address=f"127.0.0.1:{h + 1}",
                                      grace_s=grace_s)

  threads = [threading.Thread(target=start, args=(h,)) for h in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(10)
  return leases


def both_commit(leases, epoch: int, step: int, ok: bool = True) -> list:
  out = [None] * len(leases)

  def vote(h):
    try:
      out[h] = leases[h].commit(epoch, step, ok, None)
    except Exception as e:  # noqa: BLE001 -- the test inspects it
      out[h] = e

  threads = [threading.Thread(target=vote, args=(h,)) for h in range(len(leases))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(20)
  return out


def test_hosts_outlive_their_coordinator_and_take_their_verdict_from_its_successor():
  """The coordinator ends while both hosts wait on op 1's verdict; another starts on the same
  port: each host registers again (the same id, the ops it committed) and gets the same
  verdict, a redo in the new coordinator's epoch, numbered above the last. A host whose
  coordinator never comes back stops after the grace, in one line.
  (7bb7343: the loss of the coordinator stopped every host.)"""
  port = free_port()
  with coordinator(port, max_hosts=2):
    leases = start_leases(port, 2, grace_s=30.0)
    e = leases[0].epoch.number
    assert [v.commit for v in both_commit(leases, e, 0)] == [True, True]
  votes = [None]
  thread = threading.Thread(target=lambda: votes.__setitem__(0, both_commit(leases, e, 1)))
  thread.start()  # they vote while no coordinator answers
  time.sleep(3 * LEASE_S)
  assert all(lease.away_since is not None and lease.lost is None for lease in leases)
  with coordinator(port, max_hosts=2) as log:
    thread.join(30)
    verdicts = votes[0]
    assert all(isinstance(v, client_lib.Verdict) for v in verdicts), verdicts
    assert [v.commit for v in verdicts] == [False, False]  # nobody committed op 1: redo it
    assert verdicts[0].epoch == verdicts[1].epoch and verdicts[0].epoch.number > e
    assert verdicts[0].epoch.first_step == 1 and verdicts[0].epoch.hosts == (0, 1)
    assert any("host 1 came back at op 1" in line for line in log), log
    again = both_commit(leases, verdicts[0].epoch.number, 1)
    assert [v.commit for v in again] == [True, True]
  deadline = time.monotonic() + 20  # and now no coordinator comes back: the grace
  for lease in leases:
    lease.grace_s = 1.0
  while any(lease.lost is None for lease in leases) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert all("did not answer for 1 s (--coordinator_grace)" in lease.lost for lease in leases)
  for lease in leases:
    lease.close(leave=False)


def test_a_restarted_members_probe_removes_its_old_incarnation_at_once():
  """A member restarted (a new process, its state gone) starts as the real client does: a
  probe registration (not ready: it is in no list until it can take the members' state).
  The probe alone ends its old incarnation: the members' next epoch is without it, and the
  old incarnation is unknown, so the members stop waiting for it in their sums."""
  port = free_port()
  with coordinator(port) as log, clients(port, 2) as (a, old):
    a.register("a:1")
    old.register("b:1")
    e = a.heartbeat().number
    voted = []
    threads = [threading.Thread(target=lambda c=c: voted.append(c.commit(e, 0, ok=True)))
               for c in (a, old)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(5)
    assert [v.commit for v in voted] == [True, True]  # the job runs
    lease = lease_lib.Lease.start(f"127.0.0.1:{port}", host=1, num_hosts=2, token=TOKEN,
                                  timeout_s=5, address="127.0.0.1:2")
    try:
      assert lease.joining
      after = a.heartbeat()
      assert after.hosts == (0,) and after.number > e
      assert old.heartbeat() is None  # the old incarnation is gone
      assert any("host 1 registered again" in line for line in log), log
    finally:
      lease.close(leave=False)
