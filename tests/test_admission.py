"""Admission at a round boundary (issue 46): a host that registers while the job runs is
pending until the members' next boundary commit admits it, in the Ledger at fake times and
through the coordinator's sockets; a restarted coordinator waits for the hosts it lost."""

from __future__ import annotations

import itertools
import threading
import time
import types

from diloco_jax.membership import coordinator as co
from diloco_jax.membership import lease as lease_lib
from tests.coordinators import TOKEN
from tests.coordinators import Hosts
from tests.coordinators import clients
from tests.coordinators import coordinator
from tests.coordinators import free_port
from tests.coordinators import ledger_of


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
