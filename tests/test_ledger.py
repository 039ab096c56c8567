"""The coordinator's Ledger alone, at fake times (membership/ledger.py): a commit when every
member voted ok, a redo without a member that died, eviction by a majority's evidence, and
the votes it drops. Over sockets: tests/test_coordinator.py."""

from __future__ import annotations

import pytest

from diloco_jax.membership import coordinator as co
from diloco_jax.membership import ledger as ledger_lib
from tests.coordinators import ledger_of
from tests.coordinators import verdict


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


def test_a_heartbeat_answer_says_how_long_each_member_has_renewed_nothing():
  """`quiet`: ms since each member's last renewal (a heartbeat, or a commit and its poll):
  what lets a member waiting on a peer tell a frozen host from a slow one (lease.interrupt)."""
  _, hosts, _, e = ledger_of(3)  # every lease renewed at time 0 (registrations)
  hosts.heartbeat(1, now=2.0)
  hosts.vote(2, e, 0, now=3.5)
  assert hosts.heartbeat(0, now=4.0)["quiet"] == [[0, 0], [1, 2000], [2, 500]]
