"""The coordinator's state and its decisions, without sockets or clocks (membership/coordinator.py
serves it): who is a member of which epoch, leases, and the verdict on each op.

`Ledger.handle` answers one request at a time `now`, `Ledger.expire` ends the leases and
accusations that ran out; the rules are in membership/coordinator.py's docstring. Pure, so the
tests drive it at fake times.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Callable
from collections.abc import Iterable

from diloco_jax import errors
from diloco_jax.membership import protocol
from diloco_jax.membership.protocol import BadRequest
from diloco_jax.runtime import security
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import Member

CHALLENGE_S = 30.0  # how long a register's challenge may be answered
CHALLENGES_PER_HOST = 4  # outstanding challenges kept per host id (the oldest go first)
VERDICTS_KEPT = 256  # a member further behind than this many ops is told nothing

class CoordinatorError(errors.DilocoError, RuntimeError):
  """The coordinator refused a host, answered badly, or could not be reached."""
  prefix = "Coordinator"


class JobStopping(CoordinatorError):
  """The job is stopping (its coordinator was asked to stop it): nothing to join."""
  exit_code = 0


class Ledger:
  """The coordinator's state, without sockets or clocks: `handle` a request at time `now`,
  `expire` the leases and accusations that ran out. Everything in it is rebuilt from the
  hosts' registrations.

  `accuse_s` (default: `lease_s`): how long a not-ok commit vote waits, the epoch unchanged,
  before the ledger drops the peer it names. A vote naming no member (None, or an id not in
  the epoch) drops nobody but still opens a new epoch of the same members: the op must be
  decided, and a redo needs an epoch of its own (keys derived from it keep the failed try's
  frames out of the redo); with no evidence against a host, dropping one could evict the
  healthy. If the failure persists, each redo costs `accuse_s` again: a host should name the
  peer it lost whenever it knows it.

  Once a commit vote has been cast the job runs, and a host that registers is pending (it
  holds a lease, no place in an epoch: it has no state yet, and the members' next op would
  wait for it) until an op that every member voted `boundary` commits: that decision opens
  the next epoch with it. A job whose last member goes has stopped: its pending hosts, and
  whoever registers next, start it again as at start-up.

  `stop` (the coordinator got SIGTERM): the whole job stops at one round on every host. Each
  answer to a member says `stopping`; the hosts put it on their next sum, so every host
  learns it in the same round and stops after it (runtime/preemption.py). From then on no
  host is admitted or registered, and the hosts leave one by one: `idle` once all have.
  """

  def __init__(self, max_hosts: int, lease_s: float, log: Callable[[str], None],
               now: float = 0.0, accuse_s: float | None = None):
    accuse_s = lease_s if accuse_s is None else accuse_s
    if max_hosts < 1 or lease_s <= 0 or accuse_s <= 0:
      raise CoordinatorError(f"max_hosts={max_hosts}, lease_s={lease_s}, accuse_s={accuse_s}: "
                             "expected >= 1, > 0 and > 0")
    self.max_hosts, self.lease_s, self.accuse_s, self._log = max_hosts, lease_s, accuse_s, log
    self.epoch = Epoch(0, (), secrets.token_hex(8))
    self._deadline: dict[int, float] = {}  # host -> when its lease runs out
    self._seq: dict[str, int] = {}  # incarnation -> the last counter it sent
    # outstanding challenge -> when it expires, oldest first; at most a few per host id, so
    # a flood of hellos costs the coordinator no more than that
    self._challenges: collections.OrderedDict[str, float] = collections.OrderedDict()
    self._floor = 0  # the highest epoch number a registering host reported
    # For one lease after a start, every host that was a member before has heard `unknown`
    # and registered again under its own id; until then no free id is given out, so that a
    # newcomer cannot take the id of a host that is still coming back.
    self._rebuilt_at = now + lease_s
    self._joined: dict[str, int] = {}  # incarnation -> the first epoch it is a member of
    self._pending: dict[int, Member] = {}  # registered while the job runs; not yet members
    self._running = False  # a commit vote was cast: a registration waits for a boundary
    self._next_step = 0  # the op after the last one committed
    # The current epoch's undecided ops: step -> host -> (ok, suspect, boundary), in the
    # order voted; and step -> when its first not-ok vote came. A vote for an ended epoch is
    # never pending.
    self._votes: dict[int, dict[int, tuple[bool, int | None, bool]]] = {}
    self._accused: dict[int, float] = {}
    # (epoch, step) -> (commit, the epoch current when decided, the hosts that decision
    # admitted), in the order decided
    self._verdicts: collections.OrderedDict[
        tuple[int, int], tuple[bool, dict, tuple[int, ...]]] = collections.OrderedDict()
    self._forgotten = (-1, -1)  # the highest (epoch, step) whose verdict was let go
    self.stopping: str | None = None  # why the job stops (`stop`), once it does

  def stop(self, why: str) -> None:
    """The whole job stops: every host after the same round (see the class docstring)."""
    if self.stopping is None:
      self.stopping = why
      self._log(f"coordinator: stopping the job ({why}): every host stops after the same "
                f"round (hosts {_ids(self.epoch.hosts) or 'none'}; pending "
                f"{_ids(self._pending) or 'none'} not admitted)")

  @property
  def idle(self) -> bool:
    """No member and no pending host: nobody is left to answer."""
    return not self.epoch.members and not self._pending

  def _open(self, members: dict[int, Member], at_least: int, why: str,
            first_step: int | None = None) -> None:
    """Opens the next epoch of `members`; its ops start at `first_step` (default: the op
    that was undecided, which the members redo, else the one after the last commit)."""
    ended = self.epoch.number
    number = max(self.epoch.number, at_least, self._floor) + 1
    if first_step is None:
      first_step = min(self._votes, default=self._next_step)
    if not members and self._running and self.stopping is None:
      members = self._stopped()
      first_step = 0
      if members:
        why += f"; the job stopped: pending host(s) {_ids(members)} start it again"
    self.epoch = Epoch(number, tuple(members[h] for h in sorted(members)), self.epoch.boot,
                       first_step, nonce=secrets.token_hex(16))
    for m in self.epoch.members:
      self._joined.setdefault(m.incarnation, number)
    self._log(f"coordinator: epoch {number}: hosts {_ids(members) or 'none'} ({why})")
    for step in self._votes:  # rule 2: an op of an ended epoch is redone in this one
      self._decide((ended, step), False)
    self._votes, self._accused = {}, {}

  def _stopped(self) -> dict[int, Member]:
    """No member is left to hold the job's state: it stopped, and the next epoch starts it
    again as at start-up, with the hosts that were pending (returned)."""
    self._running, self._next_step = False, 0
    pending, self._pending = self._pending, {}
    return pending

  def _decide(self, key: tuple[int, int], commit: bool, admitted: tuple[int, ...] = ()) -> None:
    self._verdicts[key] = (commit, self.epoch.to_json(), admitted)
    while len(self._verdicts) > VERDICTS_KEPT:
      self._forgotten = max(self._forgotten, self._verdicts.popitem(last=False)[0])

  def _members(self) -> dict[int, Member]:
    return {m.host: m for m in self.epoch.members}

  def _forget(self, members: dict[int, Member], host: int) -> None:
    """Takes `host` out of `members` (the next epoch's) and forgets its incarnation."""
    incarnation = members.pop(host).incarnation
    self._seq.pop(incarnation, None)
    self._joined.pop(incarnation, None)
    self._deadline.pop(host, None)

  def expire(self, now: float) -> None:
    late = sorted(h for h, t in self._deadline.items() if t <= now)
    while self._challenges and next(iter(self._challenges.values())) <= now:
      self._challenges.popitem(last=False)
    gone = [h for h in late if h in self._pending]
    for h in gone:  # not a member: no epoch to end
      self._forget(self._pending, h)
    if gone:
      self._log(f"coordinator: lease of pending host {_ids(gone)} ran out")
    late = [h for h in late if h not in gone]
    if late:
      members = self._members()
      for h in late:
        self._forget(members, h)
      self._open(members, 0, f"lease of host {','.join(map(str, late))} ran out")
    due = [(t, step) for step, t in self._accused.items() if t + self.accuse_s <= now]
    if due:  # rule 3; opening an epoch ends every accusation, so one at most
      self._accuse(min(due)[1])

  def _accuse(self, step: int) -> None:
    members = self._members()
    votes = [(h, s) for h, (ok, s, _) in self._votes[step].items() if not ok]
    # the first accuser that names a member: of a pair that accuse each other (a link down
    # between them), dropping one is enough to go on
    accuser, suspect = next(((h, s) for h, s in votes if s in members), votes[0])
    e = self.epoch.number
    if suspect in members:
      self._forget(members, suspect)
      why = f"host {suspect} dropped: host {accuser} accused it of failing op {step} of epoch {e}"
    else:
      why = (f"host {accuser} failed op {step} of epoch {e} and named no member "
             f"(suspect {suspect}): the same hosts again")
    self._open(members, 0, why)

  def handle(self, req: dict, now: float) -> dict:
    """The answer to `req`; raises BadRequest for a replay or a malformed request."""
    op = protocol.text(req, "op")
    try:
      if op == "hello":
        nonce = protocol.text(req, "nonce")
        challenge = secrets.token_hex(16)
        self._challenges[challenge] = now + CHALLENGE_S
        while len(self._challenges) > CHALLENGES_PER_HOST * self.max_hosts + 16:
          self._challenges.popitem(last=False)
        return {"op": "challenge", "nonce": nonce, "challenge": challenge}
      if op == "register":
        return self._register(req, now)
      if op in ("heartbeat", "leave", "commit"):
        return self._renew(op, req, now)
    except protocol.Malformed as e:
      raise BadRequest(f"malformed {op[:20]!r} request: {e}") from None
    raise BadRequest(f"unknown op {op[:20]!r}")

  def _register(self, req: dict, now: float) -> dict:
    challenge = protocol.text(req, "challenge")
    host, last_epoch = req.get("host"), protocol.integer(req, "last_epoch")
    address, ready = protocol.text(req, "address"), protocol.flag(req, "ready", True)
    if self._challenges.pop(challenge, 0.0) <= now:
      raise BadRequest("register with an unknown, used or expired challenge (a replay?)")
    members = self._members()
    self._floor = max(self._floor, last_epoch)  # pending or not, numbered above it
    why = ""
    if self.stopping is not None:
      return {"op": "refused", "challenge": challenge, "stopping": True,
              "why": f"the job is stopping ({self.stopping}): nothing to join"}
    if host is None and now < self._rebuilt_at:
      return {"op": "retry", "challenge": challenge, "after_ms": max(1, round((self._rebuilt_at - now) * 1000))}
    if host is None:  # the lowest free id
      host = next((h for h in range(self.max_hosts)
                   if h not in members and h not in self._pending), None)
      why = "" if host is not None else f"all {self.max_hosts} host ids are taken (--max_hosts)"
    elif type(host) is not int or not 0 <= host < self.max_hosts:  # noqa: E721 -- no bool
      why = f"host id {str(host)[:20]} is outside 0..{self.max_hosts - 1} (--max_hosts)"
    if not why:  # a member's peers connect to it: an address they cannot use would fail them
      why = security.address_error(address, f"host {host}'s wire address") or ""
    if why:
      self._log(f"coordinator: refused {address[:80]!r}: {why}")
      return {"op": "refused", "challenge": challenge, "why": why}
    why = f"host {host} joined"
    replaced = host in members
    if replaced:  # a new incarnation: the old one is gone
      self._forget(members, host)
      why = f"host {host} registered again"
    if host in self._pending:  # the same, for a host not yet admitted
      self._forget(self._pending, host)
    incarnation = secrets.token_hex(8)
    member = Member(host, incarnation, address)
    pending = self._running and bool(members)
    if pending and not ready:
      # A probe: the host learns that the job runs (and an old incarnation of it is gone)
      # and registers again once it can take the members' state; until then it is in no
      # list, so no boundary admits a host that is not ready.
      if replaced:
        self._open(members, last_epoch, why)
      return {"op": "registered", "challenge": challenge, "host": host,
              "incarnation": incarnation, "lease_ms": round(self.lease_s * 1000),
              "epoch": self.epoch.to_json(), "pending": True}
    self._deadline[host], self._seq[incarnation] = now + self.lease_s, 0
    if pending:  # the members run on; it waits for a round boundary, when they admit it
      if replaced:
        self._open(members, last_epoch, why)
      self._pending[host] = member
      self._log(f"coordinator: host {host} pending: admitted at the next round boundary "
                f"(epoch {self.epoch.number}, pending {_ids(self._pending)})")
    else:
      if self._running:  # its old incarnation was the last member: the job stopped
        members.update(self._stopped())
      members[host] = member
      self._open(members, last_epoch, why)
    return {"op": "registered", "challenge": challenge, "host": host, "incarnation": incarnation,
            "lease_ms": round(self.lease_s * 1000), "epoch": self.epoch.to_json(), "pending": pending}

  def _renew(self, op: str, req: dict, now: float) -> dict:
    incarnation, seq = protocol.text(req, "incarnation"), protocol.integer(req, "seq", 1)
    echo = {"incarnation": incarnation, "seq": seq}
    if op == "commit":  # its fields checked before it counts as the host's frame
      vote = (protocol.integer(req, "epoch"), protocol.integer(req, "step"),
              protocol.flag(req, "ok"), protocol.optional_integer(req, "suspect"),
              protocol.flag(req, "boundary", False))
    if incarnation not in self._seq:  # lease ran out, registered again, or we restarted
      return {"op": "unknown", **echo}
    if seq <= self._seq[incarnation]:
      raise BadRequest(f"{op} #{seq} of host {req.get('host')} after #{self._seq[incarnation]} "
                    "(a replay?)")
    self._seq[incarnation] = seq
    host = next(m.host for m in (*self.epoch.members, *self._pending.values())
                if m.incarnation == incarnation)
    if op == "leave" and host in self._pending:
      self._forget(self._pending, host)
      self._log(f"coordinator: pending host {host} left")
      return {"op": "left", **echo}
    if op == "leave":
      members = self._members()
      self._forget(members, host)
      self._open(members, 0, f"host {host} left")
      return {"op": "left", **echo}
    self._deadline[host] = now + self.lease_s
    if op == "commit":
      return {**echo, **self._commit(host, incarnation, *vote, now)}
    return {"op": "epoch", **echo, "epoch": self.epoch.to_json(),
            "pending": sorted(self._pending), "stopping": self.stopping is not None}

  def _commit(self, host: int, incarnation: str, e: int, step: int, ok: bool,
              suspect: int | None, boundary: bool, now: float) -> dict:
    """The verdict on op `step` of epoch `e`, or a wait; `host` votes `ok` (or not, naming
    `suspect`), and `boundary`: the op ends a round, where the members can admit pending
    hosts. A vote is counted once: a poll repeats it."""
    key = (e, step)
    self._running = True
    if key not in self._verdicts:
      if e > self.epoch.number:
        raise BadRequest(f"commit vote of host {host} for epoch {e}, above the current "
                      f"{self.epoch.number}")
      if not self._joined.get(incarnation, e + 1) <= e:
        raise BadRequest(f"commit vote of host {host} for op {step} of epoch {e}, which it is not "
                      "a member of, and which has no verdict")
      if key <= self._forgotten:  # decided once maybe; deciding again could contradict it
        raise BadRequest(f"commit vote of host {host} for op {step} of epoch {e}: more than "
                      f"{VERDICTS_KEPT} ops ago, its verdict is no longer kept")
      if e < self.epoch.number:  # rule 2, for an op nobody voted on while e was current
        self._decide(key, False)
      else:
        votes = self._votes.setdefault(step, {})
        ok, _, _ = votes.setdefault(host, (ok, suspect, boundary))
        if not ok:
          self._accused.setdefault(step, now)
        elif all(votes.get(h, (False,))[0] for h in self.epoch.hosts):  # rule 1
          del self._votes[step]
          self._accused.pop(step, None)
          self._next_step = step + 1
          self._decide(key, True, self._admit(e, step, votes))
    if key not in self._verdicts:
      return {"op": "wait"}
    commit, after, admitted = self._verdicts[key]
    return {"op": "verdict", "epoch": e, "step": step, "commit": commit, "next": after,
            "admitted": list(admitted), "pending": sorted(self._pending),
            "stopping": self.stopping is not None}

  def _admit(self, e: int, step: int, votes: dict) -> tuple[int, ...]:
    """The pending hosts admitted by the commit of op `step` of epoch `e` (`votes`: every
    member's): all of them, into the next epoch, when every member voted it a round
    boundary; none otherwise (mid-round, a joiner has no state to take part with)."""
    if (not self._pending or self.stopping is not None
        or not all(votes[h][2] for h in self.epoch.hosts)):
      return ()
    admitted = tuple(sorted(self._pending))
    members = {**self._members(), **self._pending}
    self._pending = {}
    self._open(members, 0, f"host(s) {_ids(admitted)} admitted after op {step} of epoch {e}",
               first_step=step + 1)
    return admitted


def _ids(hosts: Iterable[int]) -> str:
  return ",".join(map(str, sorted(hosts)))
