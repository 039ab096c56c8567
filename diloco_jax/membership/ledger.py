"""The coordinator's state and its decisions, without sockets or clocks (membership/coordinator.py
serves it): who is a member of which epoch, leases, and the verdict on each op.

`Ledger.handle` answers one request at a time `now`, `Ledger.expire` ends the leases and
accusations that ran out (the rules: membership/coordinator.py). Pure: tests use fake times.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from collections.abc import Callable
from collections.abc import Iterable

from diloco_jax import errors
from diloco_jax.membership import protocol
from diloco_jax.membership.protocol import BadRequest
from diloco_jax.membership.votes import VERDICTS_KEPT  # noqa: F401 -- callers read it here
from diloco_jax.membership.votes import MAX_REDOS
from diloco_jax.membership.votes import Votes
from diloco_jax.membership.votes import judge
from diloco_jax.membership.votes import unanimous
from diloco_jax.runtime import security
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import Member

CHALLENGE_S = 30.0  # how long a register's challenge may be answered
REBUILD_LEASES = 3  # leases a started coordinator waits for the hosts of a job it lost
CHALLENGES_PER_HOST = 4  # outstanding challenges kept per host id (the oldest go first)

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

  `accuse_s` (default: `lease_s`): how long the ledger waits, after an op's first not-ok
  vote, for the other members' votes before it judges with those in (`votes.judge`); with
  every vote in it judges at once. A judgment that drops nobody still opens a new epoch of
  the same members: the op must be decided, and a redo needs an epoch of its own (keys
  derived from it keep the failed try's frames out of the redo).

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
    self._at: dict[int, tuple[int, bool]] = {}  # host -> (ops committed, in an op now)
    # For REBUILD_LEASES leases after a start, the hosts of a job whose coordinator this one
    # replaces may come back (`resume`: each heard `unknown`, and registers again under its own
    # id with the ops it committed), and while a host they name is still away (`_awaited`) no
    # op is decided. For the first lease no free id is given out, so that a newcomer cannot
    # take the id of a host that is still coming back.
    self._rebuilt_at = now + lease_s
    self._resume_until = now + REBUILD_LEASES * lease_s
    self._awaited: set[int] = set()
    self._resumed: dict[str, int] = {}  # incarnation -> the last epoch it saw before
    self._joined: dict[str, int] = {}  # incarnation -> the first epoch it is a member of
    self._pending: dict[int, Member] = {}  # registered while the job runs; not yet members
    self._running = False  # a commit vote was cast: a registration waits for a boundary
    self._votes = Votes()
    self.stopping: str | None = None  # why the job stops (`stop`), once it does
    self.aborted: str | None = None  # why the job cannot go on (an op failed too often)

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
      first_step = self._votes.first_open()
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
    self._votes.redo_open(ended, self.epoch.to_json())  # rule 2

  def _stopped(self) -> dict[int, Member]:
    """No member is left to hold the job's state: it stopped, and the next epoch starts it
    again as at start-up, with the hosts that were pending (returned)."""
    self._running, self._votes.next_step = False, 0
    pending, self._pending = self._pending, {}
    return pending

  def _members(self) -> dict[int, Member]:
    return {m.host: m for m in self.epoch.members}

  def _forget(self, members: dict[int, Member], host: int) -> None:
    """Takes `host` out of `members` (the next epoch's) and forgets its incarnation."""
    incarnation = members.pop(host).incarnation
    self._at.pop(host, None)
    self._seq.pop(incarnation, None)
    self._joined.pop(incarnation, None)
    self._deadline.pop(host, None)

  def pardon(self, seconds: float) -> None:
    """The coordinator itself was paused for `seconds`: every lease and accusation is
    pushed back by as much (the hosts kept heartbeating into a queue no one read)."""
    self._deadline = {h: t + seconds for h, t in self._deadline.items()}
    self._votes.accused = {step: t + seconds for step, t in self._votes.accused.items()}

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
    due = self._votes.due(now, self.accuse_s)
    if due is not None:  # rule 3, with the votes in; opening an epoch ends every accusation
      self._judge(due)

  def _judge(self, step: int) -> None:
    """Op `step` failed on a member: who leaves, by evidence (`votes.judge`), and the op is
    redone in the next epoch; an op redone more than MAX_REDOS times ends the job."""
    members = self._members()
    named = {h: s for h, (ok, s, _) in self._votes.open[step].items() if not ok}
    leave, why = judge(sorted(members), named)
    for h in leave:
      self._forget(members, h)
    e = self.epoch.number
    failed = f"op {step} of epoch {e} failed on host(s) {_ids(named)}"
    self._open(members, 0, f"{failed}: {why}" if leave else
               f"host{'s' if len(named) > 1 else ''} {_ids(named)} failed op {step} of "
               f"epoch {e} and named no member "
               f"(suspect {', '.join(str(s) for s in named.values())}): the same hosts again")
    if self._votes.tries.get(step, 0) > MAX_REDOS and self.aborted is None:
      self.aborted = (f"op {step} was tried in {MAX_REDOS + 1} epochs and failed in every one "
                      f"(the last time on host(s) {_ids(named)}): the job cannot go on")
      self._log(f"coordinator: {self.aborted}")

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
    programs = protocol.text(req, "programs", "")  # where it serves them (membership/programs.py)
    resume, step = protocol.flag(req, "resume", False), protocol.integer(req, "step", default=0)
    was = protocol.hosts(req, "was")
    if self._challenges.pop(challenge, 0.0) <= now:
      raise BadRequest("register with an unknown, used or expired challenge (a replay?)")
    members = self._members()
    self._floor = max(self._floor, last_epoch)  # pending or not, numbered above it
    why = ""
    if self.stopping is not None:
      return {"op": "refused", "challenge": challenge, "stopping": True,
              "why": f"the job is stopping ({self.stopping}): nothing to join"}
    if host is None and now < self._rebuilt_at:
      after_ms = max(1, round((self._rebuilt_at - now) * 1000))
      return {"op": "retry", "challenge": challenge, "after_ms": after_ms}
    if host is None:  # the lowest free id
      host = next((h for h in range(self.max_hosts)
                   if h not in members and h not in self._pending), None)
      why = "" if host is not None else f"all {self.max_hosts} host ids are taken (--max_hosts)"
    elif type(host) is not int or not 0 <= host < self.max_hosts:  # noqa: E721 -- no bool
      why = f"host id {str(host)[:20]} is outside 0..{self.max_hosts - 1} (--max_hosts)"
    if not why:  # a member's peers connect to it: an address they cannot use would fail them
      why = (security.address_error(address, f"host {host}'s wire address") or programs
             and security.address_error(programs, f"host {host}'s programs address") or "")
    if why:
      self._log(f"coordinator: refused {address[:80]!r}: {why}")
      return {"op": "refused", "challenge": challenge, "why": why}
    if resume:
      return self._resume(Member(host, "", address, programs), challenge, last_epoch, step,
                          was, now)
    why = f"host {host} joined"
    replaced = host in members
    if replaced:  # a new incarnation: the old one is gone
      self._forget(members, host)
      why = f"host {host} registered again"
    if host in self._pending:  # the same, for a host not yet admitted
      self._forget(self._pending, host)
    incarnation = secrets.token_hex(8)
    member = Member(host, incarnation, address, programs)
    pending = self._running and bool(members)
    if pending and replaced:  # the members run on, without its old incarnation
      self._open(members, last_epoch, why)
    if pending and not ready:
      # A probe: the host learns that the job runs (and an old incarnation of it is gone)
      # and registers again once it can take the members' state; until then it is in no
      # list, so no boundary admits a host that is not ready.
      return self._registered(challenge, host, incarnation, True, now)
    self._deadline[host], self._seq[incarnation] = now + self.lease_s, 0
    if pending:  # it waits for a round boundary, when the members admit it
      self._pending[host] = member
      self._log(f"coordinator: host {host} pending: admitted at the next round boundary "
                f"(epoch {self.epoch.number}, pending {_ids(self._pending)})")
    else:
      if self._running:  # its old incarnation was the last member: the job stopped
        members.update(self._stopped())
      members[host] = member
      self._open(members, last_epoch, why)
    return self._registered(challenge, host, incarnation, pending, now)

  def _registered(self, challenge: str, host: int, incarnation: str, pending: bool,
                  now: float) -> dict:
    return {"op": "registered", "challenge": challenge, "host": host,
            "incarnation": incarnation, "lease_ms": round(self.lease_s * 1000),
            "epoch": self.epoch.to_json(), "pending": pending,
            "rebuilding": self.rebuilding(now)}

  def rebuilding(self, now: float) -> bool:
    """Hosts of the job this coordinator took over are still coming back: no op is decided
    until they are, or until REBUILD_LEASES leases after its start."""
    # (a host that registered afresh is pending: it lost its state and cannot be waited for)
    return bool(self._awaited - set(self._pending)) and now < self._resume_until

  def _resume(self, member: Member, challenge: str, last_epoch: int, step: int,
              was: list[int], now: float) -> dict:
    """`member`, of a job whose coordinator was lost (this one started since), comes back with
    its state, having committed `step` ops among hosts `was`: a member again at once. The
    epochs it opens continue at the highest op any host committed: a host one op behind
    holds that op's result (a commit needs every member's ok) and applies it; one further
    behind, or without it, cannot go on and leaves (its incarnation is drawn here)."""
    host = member.host
    if now >= self._resume_until:
      why = (f"host {host} is not in the job any more (its lease ran out, or it came back "
             f"over {REBUILD_LEASES} leases after this coordinator started): the job went on "
             "without it; it may join again, as a host started late")
      self._log(f"coordinator: refused host {host}: {why}")
      return {"op": "refused", "challenge": challenge, "why": why}
    members = self._members()
    if host in members:
      self._forget(members, host)
    if host in self._pending:
      self._forget(self._pending, host)
    incarnation = secrets.token_hex(8)
    self._deadline[host], self._seq[incarnation] = now + self.lease_s, 0
    self._resumed[incarnation] = last_epoch
    fresh = [h for h, m in members.items() if m.incarnation not in self._resumed]
    for h in fresh:  # registered afresh while its job ran elsewhere: it joins the job
      self._pending[h] = members.pop(h)
    members[host] = dataclasses.replace(member, incarnation=incarnation)
    self._running, self._votes.next_step = True, max(self._votes.next_step, step)
    self._awaited = (self._awaited | set(was)) - set(members)
    self._open(members, last_epoch, f"host {host} came back at op {step}",
               first_step=self._votes.next_step)
    return self._registered(challenge, host, incarnation, False, now)

  def _renew(self, op: str, req: dict, now: float) -> dict:
    incarnation, seq = protocol.text(req, "incarnation"), protocol.integer(req, "seq", 1)
    echo = {"incarnation": incarnation, "seq": seq}
    if op == "commit":  # its fields checked before it counts as the host's frame
      vote = (protocol.integer(req, "epoch"), protocol.integer(req, "step"),
              protocol.flag(req, "ok"), protocol.optional_integer(req, "suspect"),
              protocol.flag(req, "boundary", False))
    if incarnation not in self._seq:  # lease ran out, registered again, or we restarted
      return {"op": "unknown", **echo, "boot": self.epoch.boot}
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
    if op == "heartbeat" and "at" in req:  # where it is: the ops it committed, in one now
      self._at[host] = (protocol.integer(req, "at"), protocol.flag(req, "busy", False))
    if op == "commit" and self.aborted is not None:
      return {"op": "abort", **echo, "why": self.aborted}
    if op == "commit" and self.rebuilding(now):
      return {"op": "wait", **echo}
    if op == "commit":
      return {**echo, **self._commit(host, incarnation, *vote, now)}
    return {"op": "epoch", **echo, "epoch": self.epoch.to_json(),
            "pending": sorted(self._pending), "stopping": self.stopping is not None,
            "rebuilding": self.rebuilding(now),
            "at": [[m.host, *self._at[m.host]] for m in self.epoch.members if m.host in self._at],
            # ms since each member last renewed (lease.interrupt: frozen, or only slow?)
            "quiet": [[h, max(0, round(1e3 * (now + self.lease_s - self._deadline.get(h, now))))]
                      for h in self.epoch.hosts]}

  def _commit(self, host: int, incarnation: str, e: int, step: int, ok: bool,
              suspect: int | None, boundary: bool, now: float) -> dict:
    """The verdict on op `step` of epoch `e`, or a wait; `host` votes `ok` (or not, naming
    `suspect`), and `boundary`: the op ends a round, where the members can admit pending
    hosts. A vote is counted once: a poll repeats it."""
    key = (e, step)
    self._running = True
    if not self._votes.decided(key):
      self._votes.check(host, key, self.epoch.number, self._joined.get(incarnation),
                        self._resumed.get(incarnation, -1))
      if e < self.epoch.number:  # rule 2, for an op nobody voted on while e was current
        self._votes.decide(key, False, self.epoch.to_json())
      else:
        votes = self._votes.cast(host, step, (ok, suspect, boundary), now)
        if all(votes.get(h, (False,))[0] for h in self.epoch.hosts):  # rule 1
          self._votes.committed(step)
          admitted = self._admit(e, step, votes)
          self._votes.decide(key, True, self.epoch.to_json(), admitted)
        elif (all(h in votes for h in self.epoch.hosts)  # every vote in, one not ok: rule 3
              or unanimous(votes, self.epoch.hosts)):  # or the one missing would leave
          self._judge(step)
    answer = self._votes.answer(key)
    if answer["op"] == "verdict":
      answer.update(pending=sorted(self._pending), stopping=self.stopping is not None)
    return answer

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
