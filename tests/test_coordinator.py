"""The membership coordinator (membership/coordinator.py): leases, epochs that only grow, frames
authenticated with a key from the join token, and a host that outlives the coordinator."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import zmq

from bench.harness import free_port
from diloco_jax.membership import coordinator as co
from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import ledger as ledger_lib
from diloco_jax.runtime import security
from diloco_jax.membership.client import Client, CoordinatorLost
from diloco_jax.membership import client as client_lib
from diloco_jax.wire import sealed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = security.JoinToken("a-join-token-for-the-tests", "the test")
OTHER = security.JoinToken("another-token-of-another-job", "the test")
LEASE_S = 0.4


@contextlib.contextmanager
def coordinator(port: int, max_hosts: int = 3, token=TOKEN):
  """A coordinator in a thread; yields its log (a list of lines)."""
  log, stop = [], threading.Event()
  thread = threading.Thread(target=co.serve, args=(port, max_hosts, LEASE_S, co.key_for(token)),
                            kwargs={"stop": stop, "log": log.append}, daemon=True)
  thread.start()
  try:
    yield log
  finally:
    stop.set()
    thread.join(5)


@contextlib.contextmanager
def clients(port: int, n: int, token=TOKEN, timeout_s: float = 1.0):
  made = [Client(f"127.0.0.1:{port}", token, timeout_s) for _ in range(n)]
  try:
    yield made
  finally:
    for c in made:
      c.close()


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
    with coordinator(port) as log, clients(port, 1) as (newcomer,):
      # it kept nothing: the hosts tell it their ids and the numbers they saw; a newcomer
      # that asks for any id gets one only after a lease, when the others are back
      joined = []
      started = time.monotonic()
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


class Hosts:
  """Hosts that speak to a Ledger directly, at fake times: each request carries its host's
  next counter."""

  def __init__(self, ledger: co.Ledger):
    self.ledger, self.incarnation, self.seq = ledger, {}, {}

  def register(self, host: int, now: float = 0.0) -> dict:
    challenge = self.ledger.handle({"op": "hello", "nonce": "n"}, now)["challenge"]
    answer = self.ledger.handle({"op": "register", "challenge": challenge, "host": host,
                                 "address": f"h{host}:1", "last_epoch": 0}, now)
    self.incarnation[host], self.seq[host] = answer["incarnation"], 0
    return answer

  def join(self, host: int, now: float = 0.0) -> dict:
    return self.register(host, now)["epoch"]

  def frame(self, host: int, op: str, **fields) -> dict:
    self.seq[host] += 1
    return {"op": op, "host": host, "incarnation": self.incarnation[host],
            "seq": self.seq[host], **fields}

  def heartbeat(self, host: int, now: float) -> dict:
    return self.ledger.handle(self.frame(host, "heartbeat"), now)

  def leave(self, host: int, now: float) -> dict:
    return self.ledger.handle(self.frame(host, "leave"), now)

  def vote(self, host: int, epoch: int, step: int, now: float, ok: bool = True,
           suspect: int | None = None, boundary: bool = False) -> dict:
    return self.ledger.handle(self.frame(host, "commit", epoch=epoch, step=step, ok=ok,
                                         suspect=suspect, boundary=boundary), now)


def ledger_of(n: int, accuse_s: float | None = None) -> tuple[co.Ledger, Hosts, list[str], int]:
  """A Ledger with hosts 0..n-1 registered at time 0 (lease 10 s); its log, the epoch."""
  log = []
  ledger = co.Ledger(max_hosts=4, lease_s=10.0, log=log.append, accuse_s=accuse_s)
  hosts = Hosts(ledger)
  for h in range(n):
    epoch = hosts.join(h)
  return ledger, hosts, log, epoch["number"]


def verdict(answer: dict) -> tuple[bool, int, tuple[int, ...]]:
  assert answer["op"] == "verdict", answer
  after = co.Epoch.from_json(answer["next"])
  return answer["commit"], after.number, after.hosts


def test_commit_when_every_member_voted_ok_with_the_same_next_for_each():
  ledger, hosts, _, e = ledger_of(3)
  assert hosts.vote(0, e, 7, now=1.0)["op"] == "wait"
  assert hosts.vote(0, e, 7, now=1.1)["op"] == "wait"  # a poll repeats the vote
  assert hosts.vote(2, e, 7, now=1.2)["op"] == "wait"
  last = hosts.vote(1, e, 7, now=1.3)
  assert verdict(last) == (True, e, (0, 1, 2))
  assert (last["epoch"], last["step"]) == (e, 7)
  assert [hosts.vote(h, e, 7, now=1.4) | {"seq": 0} for h in (0, 2)] == [
      last | {"seq": 0, "incarnation": hosts.incarnation[h]} for h in (0, 2)]
  assert ledger.epoch.number == e  # a commit changes no membership


def test_a_member_that_dies_before_voting_makes_every_survivor_redo_without_it():
  ledger, hosts, log, e = ledger_of(4)
  for h in (0, 3):  # voted ok before the expiry
    assert hosts.vote(h, e, 1, now=1.0)["op"] == "wait"
  for h in (0, 1, 3):
    hosts.heartbeat(h, now=9.0)
  ledger.expire(10.0)  # host 2 never voted, and its lease ran out
  assert log[-1].endswith(f"epoch {e + 1}: hosts 0,1,3 (lease of host 2 ran out)")
  hosts.leave(3, now=10.0)  # decided when epoch e ended: a later epoch changes nothing
  # host 1 has the result too: all the living voted ok, but epoch e ended first
  assert verdict(hosts.vote(1, e, 1, now=10.1)) == (False, e + 1, (0, 1, 3))
  assert verdict(hosts.vote(0, e, 1, now=10.1)) == (False, e + 1, (0, 1, 3))
  # an op of the ended epoch that nobody had voted on is a redo as well, in the epoch of
  # its first vote, and every member hears that one
  assert verdict(hosts.vote(0, e, 2, now=10.2)) == (False, e + 2, (0, 1))
  hosts.join(2, now=10.3)  # pending: the job runs
  assert verdict(hosts.vote(1, e, 2, now=10.4)) == (False, e + 2, (0, 1))


def test_a_member_that_voted_ok_and_then_died_still_counts():
  ledger, hosts, _, e = ledger_of(3)
  hosts.vote(2, e, 4, now=1.0)  # and then dies: no heartbeat from it again
  hosts.vote(0, e, 4, now=9.0)
  assert verdict(hosts.vote(1, e, 4, now=9.5)) == (True, e, (0, 1, 2))
  ledger.expire(11.0)  # host 2's lease (renewed by its vote) runs out after the decision
  assert ledger.epoch.hosts == (0, 1)
  assert verdict(hosts.vote(0, e, 4, now=11.5)) == (True, e, (0, 1, 2))  # it stands


def test_a_host_is_dropped_by_a_majority_of_the_others_and_a_lone_accuser_drops_itself():
  """Eviction by evidence, once every vote is in (or accuse_s after the first not-ok): a
  host named by a majority of the others leaves; an accusation no majority backs makes the
  accuser leave (a bad link of its own, or a lie); the op is redone without it. (7bb7343: the
  first not-ok vote decided: one member could evict any live member, and a host with a bad
  NIC whose timer fired first had its healthy peers dropped one by one.)"""
  ledger, hosts, log, e = ledger_of(3, accuse_s=2.0)
  assert hosts.vote(1, e, 5, now=1.0)["op"] == "wait"  # it holds the result
  assert hosts.vote(0, e, 5, now=1.0, ok=False, suspect=2)["op"] == "wait"
  # the last vote is in: judged at once, and nobody else names host 2
  assert verdict(hosts.vote(2, e, 5, now=1.5)) == (False, e + 1, (1, 2))
  assert log[-1].endswith(f"epoch {e + 1}: hosts 1,2 (op 5 of epoch {e} failed on host(s) 0: "
                          "host 0 named host 2, which no majority of the others did)"), log[-1]
  assert hosts.vote(0, e, 5, now=1.6)["op"] == "unknown"  # the accuser was dropped

  # a bad NIC: host 2 names host 0 first, then hosts 0 and 1 both name host 2
  ledger, hosts, log, e = ledger_of(3, accuse_s=2.0)
  hosts.vote(2, e, 5, now=1.0, ok=False, suspect=0)
  hosts.vote(0, e, 5, now=1.2, ok=False, suspect=2)
  assert verdict(hosts.vote(1, e, 5, now=1.4, ok=False, suspect=2)) == (False, e + 1, (0, 1))
  assert "host 2 named by 2 of the 2 others" in log[-1], log[-1]

  # votes missing: judged accuse_s after the first not-ok, with the votes in
  ledger, hosts, log, e = ledger_of(4, accuse_s=2.0)
  hosts.vote(0, e, 5, now=1.0, ok=False, suspect=3)
  hosts.vote(1, e, 5, now=1.5, ok=False, suspect=3)
  for h in range(4):
    hosts.heartbeat(h, now=2.9)
  ledger.expire(2.9)
  assert ledger.epoch.number == e  # not yet: host 2 may still vote
  ledger.expire(3.0)
  assert ledger.epoch.hosts == (0, 1, 2) and "host 3 named by 2 of the 3 others" in log[-1]


def test_the_one_member_every_other_names_leaves_before_its_vote_and_a_lone_one_waits():
  """A host whose port refuses the others (its process ended: wire/departed.py) is named by
  all of them: with at least two accusers it leaves at once, since its own vote could not
  change the judgment; a single accuser (two members) waits accuse_s, as its accusation
  alone might be the one that is wrong."""
  ledger, hosts, log, e = ledger_of(3, accuse_s=20.0)
  assert hosts.vote(0, e, 5, now=1.0, ok=False, suspect=2)["op"] == "wait"
  assert verdict(hosts.vote(1, e, 5, now=1.1, ok=False, suspect=2)) == (False, e + 1, (0, 1))
  assert "host 2 named by 2 of the 2 others" in log[-1], log[-1]

  ledger, hosts, log, e = ledger_of(3, accuse_s=20.0)  # one names another host: no rush
  hosts.vote(0, e, 5, now=1.0, ok=False, suspect=2)
  assert hosts.vote(1, e, 5, now=1.1, ok=False, suspect=0)["op"] == "wait"

  ledger, hosts, log, e = ledger_of(2, accuse_s=5.0)
  assert hosts.vote(0, e, 5, now=1.0, ok=False, suspect=1)["op"] == "wait"
  hosts.heartbeat(1, now=5.9)
  ledger.expire(5.9)
  assert ledger.epoch.number == e
  ledger.expire(6.0)
  assert ledger.epoch.hosts == (0,) and "host 1 named by 1 of the 1 others" in log[-1]


def test_an_op_that_fails_in_every_epoch_ends_the_job_in_one_line():
  """A redo without end (7bb7343: 177 epochs in a simulated 30 minutes, no progress, no
  error): an op tried in MAX_REDOS + 1 epochs gives the job up, every member told why."""
  ledger, hosts, log, e = ledger_of(2, accuse_s=1.0)
  now = 1.0
  for _ in range(ledger_lib.MAX_REDOS + 1):
    e = ledger.epoch.number
    hosts.vote(0, e, 5, now=now, ok=False)
    for h in range(2):
      hosts.heartbeat(h, now=now + 0.5)
    ledger.expire(now + 1.0)
    now += 1.0
  answer = hosts.vote(1, ledger.epoch.number, 5, now=now)
  assert answer["op"] == "abort" and "op 5 was tried in 33 epochs" in answer["why"], answer
  assert log[-1] == f"coordinator: {answer['why']}"


def test_a_not_ok_vote_naming_no_member_opens_an_epoch_of_the_same_hosts():
  ledger, hosts, log, e = ledger_of(2, accuse_s=2.0)
  assert hosts.vote(0, e, 5, now=1.0, ok=False, suspect=None)["op"] == "wait"
  ledger.expire(3.0)
  assert log[-1].endswith(f"epoch {e + 1}: hosts 0,1 (host 0 failed op 5 of epoch {e} and "
                          "named no member (suspect None): the same hosts again)")
  for h in (0, 1):
    assert verdict(hosts.vote(h, e, 5, now=3.1)) == (False, e + 1, (0, 1))


def test_the_suspect_whose_lease_runs_out_first_ends_the_epoch_as_for_any_host():
  ledger, hosts, log, e = ledger_of(2, accuse_s=20.0)
  hosts.vote(0, e, 5, now=9.0, ok=False, suspect=1)
  ledger.expire(10.0)
  assert log[-1].endswith("(lease of host 1 ran out)")
  assert verdict(hosts.vote(0, e, 5, now=10.1)) == (False, e + 1, (0,))


def test_late_votes_get_the_stored_verdict_and_odd_votes_are_dropped():
  ledger, hosts, _, e = ledger_of(3)
  hosts.vote(0, e, 1, now=1.0)
  hosts.vote(2, e, 1, now=1.0)
  assert verdict(hosts.vote(1, e, 1, now=1.0))[0] is True
  hosts.leave(2, now=2.0)  # a new epoch after the commit
  hosts.join(3, now=2.0)  # pending
  # a late vote, even not ok, does not turn a commit into a redo
  assert verdict(hosts.vote(1, e, 1, now=3.0, ok=False, suspect=0)) == (True, e, (0, 1, 2))
  assert verdict(hosts.vote(3, e, 1, now=3.0)) == (True, e, (0, 1, 2))  # a verdict to anyone
  with pytest.raises(co.BadRequest, match=rf"host 3 for op 2 of epoch {e}, which it is not a member"):
    hosts.vote(3, e, 2, now=3.0)
  with pytest.raises(co.BadRequest, match=rf"for epoch {e + 5}, above the current {e + 1}"):
    hosts.vote(0, e + 5, 1, now=3.0)
  with pytest.raises(co.BadRequest, match=r"malformed 'commit' request"):
    ledger.handle(hosts.frame(0, "commit", epoch=e + 1, step=1, ok="yes", suspect=None), 3.0)


def test_only_the_last_verdicts_are_kept_and_an_older_vote_is_not_decided_again():
  _, hosts, _, e = ledger_of(1)
  for step in range(ledger_lib.VERDICTS_KEPT + 1):
    assert verdict(hosts.vote(0, e, step, now=1.0))[0] is True
  assert verdict(hosts.vote(0, e, 1, now=1.0))[0] is True
  with pytest.raises(co.BadRequest, match=r"its verdict is no longer kept"):
    hosts.vote(0, e, 0, now=1.0)


def test_a_replayed_commit_frame_is_dropped_and_a_commit_renews_the_lease():
  ledger, hosts, _, e = ledger_of(2)
  frame = hosts.frame(0, "commit", epoch=e, step=3, ok=True, suspect=None)
  assert ledger.handle(frame, 1.0)["op"] == "wait"
  with pytest.raises(co.BadRequest, match=r"commit #1 of host 0 after #1 \(a replay\?\)"):
    ledger.handle(frame, 1.0)
  hosts.vote(1, e, 3, now=9.0)
  ledger.expire(12.0)  # host 1's commit renewed its lease; host 0's ran out at 10
  assert ledger.epoch.hosts == (1,)


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


# -- admission at a round boundary (issue 46) ----------------------------------------------


def committed(hosts: Hosts, e: int, step: int, members, now: float,
              boundary: bool = False) -> list[dict]:
  """Every member's verdict on op `step` of epoch `e`, each voting ok (and `boundary`)."""
  answers = [hosts.vote(h, e, step, now, boundary=boundary) for h in members]
  return [answers[-1]] + [hosts.vote(h, e, step, now) for h in members[:-1]]


def same(answers: list[dict]) -> dict:
  """The one verdict every member got (their echoes aside)."""
  bodies = [{k: v for k, v in a.items() if k not in ("incarnation", "seq")} for a in answers]
  assert all(b == bodies[0] for b in bodies), bodies
  return bodies[0]


def test_start_up_registrations_join_and_after_the_first_vote_one_is_pending():
  ledger, hosts, log, e = ledger_of(2)
  assert ledger.epoch.hosts == (0, 1) and ledger.epoch.first_step == 0
  assert hosts.heartbeat(0, now=0.5)["pending"] == []
  assert hosts.vote(0, e, 0, now=1.0)["op"] == "wait"  # the job runs
  answer = hosts.register(2, now=1.0)
  assert answer["pending"] is True
  assert co.Epoch.from_json(answer["epoch"]) == ledger.epoch
  assert (ledger.epoch.number, ledger.epoch.hosts) == (e, (0, 1))
  assert log[-1] == ("coordinator: host 2 pending: admitted at the next round boundary "
                     f"(epoch {e}, pending 2)")
  for h in (0, 1, 2):  # a pending host heartbeats and sees the epoch without it
    beat = hosts.heartbeat(h, now=2.0)
    assert (beat["pending"], beat["epoch"]["number"]) == ([2], e)
  first = {k: v for k, v in ledger.epoch.to_json().items() if k != "first_step"}
  assert co.Epoch.from_json(first).first_step == 0  # an epoch from before first_step


def test_a_boundary_commit_admits_the_pending_hosts_in_the_verdict_of_every_member():
  _, hosts, log, e = ledger_of(2)
  assert same(committed(hosts, e, 0, [0, 1], now=1.0))["admitted"] == []
  for h in (3, 2):
    assert hosts.register(h, now=1.5)["pending"] is True
  body = same(committed(hosts, e, 1, [0, 1], now=2.0, boundary=True))
  after = co.Epoch.from_json(body["next"])
  assert (body["commit"], body["admitted"], body["pending"]) == (True, [2, 3], [])
  assert (after.number, after.hosts, after.first_step) == (e + 1, (0, 1, 2, 3), 2)
  assert log[-1].endswith(f"epoch {e + 1}: hosts 0,1,2,3 (host(s) 2,3 admitted after op 1 of "
                          f"epoch {e})")
  beat = hosts.heartbeat(2, now=2.5)  # the joiner learns it from its heartbeat
  assert (co.Epoch.from_json(beat["epoch"]), beat["pending"]) == (after, [])
  # it is a member: op 2 needs its vote
  assert [hosts.vote(h, e + 1, 2, now=3.0)["op"] for h in (0, 1, 3)] == ["wait"] * 3
  assert hosts.vote(2, e + 1, 2, now=3.0)["commit"] is True


def test_a_commit_mid_round_or_a_redo_admits_nobody():
  ledger, hosts, _, e = ledger_of(2, accuse_s=1.0)
  hosts.vote(0, e, 0, now=1.0)
  hosts.register(2, now=1.0)
  hosts.vote(1, e, 0, now=1.0)
  # mid-round, and an op only one member calls a boundary: no admission
  assert same([hosts.vote(h, e, 0, now=1.1) for h in (0, 1)])["admitted"] == []
  hosts.vote(0, e, 1, now=1.2, boundary=True)
  assert same([hosts.vote(1, e, 1, now=1.2), hosts.vote(0, e, 1, now=1.2)])["admitted"] == []
  assert (ledger.epoch.number, ledger.epoch.hosts) == (e, (0, 1))
  # a boundary op that fails is redone in an epoch of its own, still without the joiner
  hosts.vote(0, e, 2, now=1.3, ok=False, boundary=True)
  hosts.vote(1, e, 2, now=1.3, boundary=True)
  ledger.expire(2.3)
  body = same([hosts.vote(h, e, 2, now=2.4, boundary=True) for h in (0, 1)])
  after = co.Epoch.from_json(body["next"])
  assert (body["commit"], body["admitted"], body["pending"]) == (False, [], [2])
  assert (after.number, after.hosts, after.first_step) == (e + 1, (0, 1), 2)


def test_a_pending_host_whose_lease_runs_out_is_forgotten_without_a_new_epoch():
  ledger, hosts, log, e = ledger_of(2)
  hosts.vote(0, e, 0, now=1.0)
  hosts.register(2, now=1.0)  # its lease runs out at 11
  for h in (0, 1):
    hosts.heartbeat(h, now=9.0)
  ledger.expire(11.0)
  assert log[-1] == "coordinator: lease of pending host 2 ran out"
  assert (ledger.epoch.number, ledger.epoch.hosts) == (e, (0, 1))
  assert hosts.heartbeat(0, now=11.5)["pending"] == []
  assert hosts.heartbeat(2, now=11.5)["op"] == "unknown"


def test_a_restarted_member_leaves_at_once_and_is_pending_until_the_next_boundary():
  ledger, hosts, log, e = ledger_of(3)
  same(committed(hosts, e, 0, [0, 1, 2], now=1.0))
  for h in (0, 1):  # host 2 dies in op 1 and starts again under its id
    hosts.vote(h, e, 1, now=2.0)
  old = hosts.frame(2, "heartbeat")
  answer = hosts.register(2, now=2.5)
  redo = co.Epoch.from_json(answer["epoch"])
  assert answer["pending"] is True
  assert (redo.number, redo.hosts, redo.first_step) == (e + 1, (0, 1), 1)
  assert log[-2].endswith(f"epoch {e + 1}: hosts 0,1 (host 2 registered again)")
  assert ledger.handle(old, 2.6)["op"] == "unknown"  # the old incarnation is gone
  body = same([hosts.vote(h, e, 1, now=2.7) for h in (0, 1)])
  assert (body["commit"], body["next"], body["pending"]) == (False, redo.to_json(), [2])
  assert same(committed(hosts, e + 1, 1, [0, 1], now=3.0))["admitted"] == []
  body = same(committed(hosts, e + 1, 2, [0, 1], now=3.5, boundary=True))
  after = co.Epoch.from_json(body["next"])
  assert body["admitted"] == [2]
  assert (after.number, after.hosts, after.first_step) == (e + 2, (0, 1, 2), 3)


def test_when_the_last_member_goes_the_pending_hosts_start_the_job_again():
  ledger, hosts, log, e = ledger_of(1)
  hosts.vote(0, e, 0, now=1.0)
  hosts.register(1, now=1.0)
  hosts.leave(0, now=2.0)  # nobody holds the job's state: nobody could admit host 1
  assert (ledger.epoch.number, ledger.epoch.hosts, ledger.epoch.first_step) == (e + 1, (1,), 0)
  assert log[-1].endswith("(host 0 left; the job stopped: pending host(s) 1 start it again)")
  assert hosts.register(2, now=2.5)["pending"] is False  # as at start-up: no vote since
  assert ledger.epoch.hosts == (1, 2)


def test_a_stop_is_said_to_every_member_admits_nobody_and_ends_when_all_have_left():
  ledger, hosts, log, e = ledger_of(2)
  same(committed(hosts, e, 0, [0, 1], now=1.0))
  hosts.register(2, now=1.0)  # pending
  assert hosts.heartbeat(0, now=1.5)["stopping"] is False
  ledger.stop("asked")
  assert log[-1] == ("coordinator: stopping the job (asked): every host stops after the same "
                     "round (hosts 0,1; pending 2 not admitted)")
  body = same(committed(hosts, e, 1, [0, 1], now=2.0, boundary=True))
  assert (body["commit"], body["admitted"], body["stopping"]) == (True, [], True)
  assert [hosts.heartbeat(h, now=2.5)["stopping"] for h in (0, 1, 2)] == [True] * 3
  refused = hosts.ledger.handle({"op": "register", "host": 3, "address": "h3:1",
                                 "last_epoch": 0, "challenge": hosts.ledger.handle(
                                     {"op": "hello", "nonce": "n"}, 3.0)["challenge"]}, 3.0)
  assert (refused["op"], refused["stopping"]) == ("refused", True)
  for h in (0, 1):  # the last member leaves: the pending host does not start it again
    hosts.leave(h, now=3.5)
  assert ledger.epoch.hosts == () and not ledger.idle
  hosts.leave(2, now=4.0)
  assert ledger.idle


def test_a_host_that_registers_while_two_members_commit_is_admitted_at_their_boundary():
  port = free_port()
  with coordinator(port), clients(port, 3) as (a, b, c):
    a.register("a:1")
    e = b.register("b:1").epoch.number

    def both(step: int, boundary: bool):
      verdicts = [None, None]

      def vote(i, client):
        verdicts[i] = client.commit(e, step, ok=True, boundary=boundary)

      threads = [threading.Thread(target=vote, args=(i, x)) for i, x in enumerate((a, b))]
      for t in threads:
        t.start()
      for t in threads:
        t.join(10)
      assert verdicts[0] == verdicts[1] and verdicts[0].commit, verdicts
      return verdicts[0]

    assert both(0, boundary=True).admitted == ()  # nobody pending yet
    joined = c.register("c:1")
    assert joined.pending and joined.epoch.hosts == (0, 1) and joined.host == 2
    assert a.heartbeat().number == e and a.pending == (2,)
    assert both(1, boundary=False).admitted == ()
    admitted = both(2, boundary=True)
    assert admitted.admitted == (2,) and a.pending == b.pending == ()
    epoch = c.heartbeat()
    assert (epoch, c.pending) == (admitted.epoch, ())
    assert (epoch.number, epoch.hosts, epoch.first_step) == (e + 1, (0, 1, 2), 3)


def test_a_host_that_finds_the_job_running_probes_then_is_admitted_once_ready(monkeypatch):
  """`Lease.start` on a running job only probes (not ready: no lease, in no list, so no
  boundary admits a host still building); `Lease.join` registers ready, and the members'
  next boundary admits it, numbered from the op after it, however long the joiner's clock
  says it waited (an hour at each look: a round may be that long). (7bb7343: a joiner gave
  up after max(600 s, the wire timeout).)"""
  port = free_port()
  with coordinator(port) as log, clients(port, 1) as (a,):
    e = a.register("a:1").epoch.number
    a.commit(e, 0, ok=True)  # the job runs
    lease = lease_lib.Lease.start(f"127.0.0.1:{port}", host=1, num_hosts=2, token=TOKEN,
                                  timeout_s=5, address="127.0.0.1:1")
    assert lease.joining and lease.epoch.hosts == (0,)
    assert a.heartbeat().number == e and a.pending == ()  # no one waits: nothing to admit
    assert not [line for line in log if "pending" in line], log
    assert not a.commit(e, 1, ok=True, boundary=True).admitted
    hours = itertools.count()
    monkeypatch.setattr(lease_lib, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() + 3600.0 * next(hours), sleep=time.sleep))
    joined = threading.Thread(target=lease.join)
    joined.start()
    deadline = time.monotonic() + 5
    while a.heartbeat() and a.pending != (1,) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert a.pending == (1,)
    verdict = a.commit(e, 2, ok=True, boundary=True)
    joined.join(timeout=5)
    assert verdict.admitted == (1,) and lease.epoch.hosts == (0, 1)
    assert (lease.epoch.number, lease.epoch.first_step) == (e + 1, 3)
    monkeypatch.undo()
    lease.close()


def test_a_restarted_coordinator_waits_for_the_hosts_and_continues_at_their_highest_op():
  """The coordinator lost and started again (a new Ledger): hosts come back (`resume`) with
  the ops they committed and the hosts they were with; no op is decided until all of those
  are back; the epoch continues at the highest op (a host one behind holds that op's
  result); a vote on an op of the lost coordinator's epochs is redone in the new one."""
  log = []
  ledger = co.Ledger(max_hosts=4, lease_s=10.0, log=log.append, now=100.0)

  def resume(host, step, now):
    challenge = ledger.handle({"op": "hello", "nonce": "n"}, now)["challenge"]
    return ledger.handle({"op": "register", "challenge": challenge, "host": host,
                          "address": f"h{host}:1", "last_epoch": 41, "resume": True,
                          "step": step, "was": [0, 1, 2]}, now)

  a = resume(0, 7, 101.0)
  assert a["rebuilding"] and a["epoch"]["number"] == 42 and a["epoch"]["first_step"] == 7
  b = resume(1, 8, 102.0)
  assert b["epoch"]["first_step"] == 8 and b["rebuilding"]
  wait = ledger.handle({"op": "commit", "host": 0, "incarnation": a["incarnation"], "seq": 1,
                        "epoch": 40, "step": 7, "ok": True, "suspect": None}, 103.0)
  assert wait["op"] == "wait"  # host 2 is not back yet
  c = resume(2, 8, 104.0)
  assert not c["rebuilding"] and c["epoch"]["first_step"] == 8
  assert [m["host"] for m in c["epoch"]["members"]] == [0, 1, 2]
  redo = ledger.handle({"op": "commit", "host": 0, "incarnation": a["incarnation"], "seq": 2,
                        "epoch": 40, "step": 7, "ok": True, "suspect": None}, 105.0)
  assert redo["op"] == "verdict" and not redo["commit"] and redo["next"] == c["epoch"]
  # a newcomer that probes now finds the job running: pending, as with any coordinator
  challenge = ledger.handle({"op": "hello", "nonce": "n"}, 106.0)["challenge"]
  probe = ledger.handle({"op": "register", "challenge": challenge, "host": 3,
                         "address": "h3:1", "last_epoch": 0, "ready": False}, 106.0)
  assert probe["pending"]
  # a host back after the window is refused: the others went on without it
  late = co.Ledger(max_hosts=4, lease_s=1.0, log=log.append, now=0.0)
  challenge = late.handle({"op": "hello", "nonce": "n"}, 10.0)["challenge"]
  refused = late.handle({"op": "register", "challenge": challenge, "host": 1, "address": "h:1",
                         "last_epoch": 3, "resume": True, "step": 2, "was": [0, 1]}, 10.0)
  assert refused["op"] == "refused" and "went on without it" in refused["why"]


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
