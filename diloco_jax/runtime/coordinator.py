"""Membership kept by a process that is not a training host: leases, and epochs that only grow.

Run it beside the hosts, e.g. on a small always-on machine beside a fleet of spot hosts:

  python -m diloco_jax.runtime.coordinator --port=61100 --max_hosts=8 --bind=0.0.0.0

Each host registers (`coordinator_client.Client`) and gets a lease; it heartbeats within the
lease and each answer carries the current epoch: a number, and the members in host order with
their incarnation and address. Any change of members opens a new epoch: a host registering
(a host that registers again is a new incarnation: its old one leaves), leaving, or letting its
lease run out. The number only grows, across a restart of the coordinator too: it keeps nothing
on disk, a host it does not know is told so and registers again with the highest number it has
seen, and the next epoch is numbered above every number reported.

Why our own and not JAX's coordination service, torchft's Lighthouse or etcd (each run and
measured for issue 45): JAX's service takes an exact host count at start and its loss aborts
every host; the Lighthouse restarts its number at 1 and authenticates nothing; etcd needs a
system binary and a data dir, and the epoch logic would still be ours.

Frames: [body, mac]; body is canonical JSON, mac = HMAC-SHA256(key, direction | body), the key
derived from the join token (without a token: a fixed, public key, which checks integrity only).
A register answers a fresh single-use challenge; a heartbeat, commit or leave carries a counter
that must grow; every answer echoes what it answers. So a frame without the key, a replayed frame
and a replayed answer are dropped, each named in one line.

Commit: the hosts run each cross-host op (a sum of pseudo-gradients, an all-gather) over the
members of an epoch, and one may die mid-op; if one survivor then applied the result that
included the dead host and another redid the op without it, they would be an op apart for
good. So an op is two-phase, with the coordinator the single decider: each member votes on op
k of epoch e (ok: it holds the result; not ok: a peer went silent, which it may name) and polls
until the ledger decides (e, k) once: commit when every member of e voted ok while e was
current, else redo, in the epoch the verdict names. The verdict is kept, so every member,
however late, gets the same one. It costs one round trip per op plus waiting for the slowest
member; a member that accuses a live peer waits `accuse_s` (a lease, unless set) before the
ledger drops that peer.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hmac
import json
import secrets
import signal
import sys
import threading
import time
from typing import Callable

import zmq

from diloco_jax import errors
from diloco_jax.runtime import security

CHALLENGE_S = 30.0  # how long a register's challenge may be answered
VERDICTS_KEPT = 256  # a member further behind than this many ops is told nothing
C2S, S2C = b"diloco_jax coordinator request|", b"diloco_jax coordinator answer|"
_NO_TOKEN_KEY = b"diloco_jax coordinator: no join token"


class CoordinatorError(errors.DilocoError, RuntimeError):
  """The coordinator refused a host, answered badly, or could not be reached."""
  prefix = "Coordinator"


class Dropped(errors.DilocoError):
  """A frame that is not authenticated, a replay, or malformed: dropped and named."""
  prefix = "Dropped"


def key_for(token: security.JoinToken | None) -> bytes:
  return _NO_TOKEN_KEY if token is None else token.derive_key("coordinator")


def seal(key: bytes, direction: bytes, body: dict) -> list[bytes]:
  data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
  return [data, hmac.new(key, direction + data, "sha256").digest()]


def unseal(key: bytes, direction: bytes, frames: list[bytes]) -> dict:
  if len(frames) != 2:
    raise Dropped(f"{len(frames)} parts, expected 2 (body, mac)")
  data, mac = frames
  if not hmac.compare_digest(mac, hmac.new(key, direction + data, "sha256").digest()):
    raise Dropped("not authenticated with this job's key (another join token, or none?)")
  try:
    body = json.loads(data)
  except ValueError:
    raise Dropped("authenticated but not JSON") from None
  if not isinstance(body, dict) or not isinstance(body.get("op"), str):
    raise Dropped("authenticated but has no 'op'")
  return body


@dataclasses.dataclass(frozen=True)
class Member:
  host: int
  incarnation: str  # random, new at each registration
  address: str  # where the host's peers reach it (the wire's address)


@dataclasses.dataclass(frozen=True)
class Epoch:
  """Who trains together: `members` in host order. `number` only grows, as each host sees
  it; `boot` (random at each start of the coordinator) tells apart two epochs that got one
  number from coordinators before and after a restart, so a key derived from (boot, number)
  belongs to one epoch only."""
  number: int
  members: tuple[Member, ...]
  boot: str = ""

  @property
  def hosts(self) -> tuple[int, ...]:
    return tuple(m.host for m in self.members)

  def to_json(self) -> dict:
    return {"number": self.number, "boot": self.boot,
            "members": [dataclasses.asdict(m) for m in self.members]}

  @classmethod
  def from_json(cls, body: dict) -> Epoch:
    return cls(int(body["number"]), tuple(Member(int(m["host"]), str(m["incarnation"]),
                                                 str(m["address"])) for m in body["members"]),
               str(body["boot"]))


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
    self._challenges: dict[str, float] = {}  # outstanding challenge -> when it expires
    # For one lease after a start, every host that was a member before has heard `unknown`
    # and registered again under its own id; until then no free id is given out, so that a
    # newcomer cannot take the id of a host that is still coming back.
    self._rebuilt_at = now + lease_s
    self._joined: dict[str, int] = {}  # incarnation -> the first epoch it is a member of
    # The current epoch's undecided ops: step -> host -> (ok, suspect), in the order voted;
    # and step -> when its first not-ok vote came. A vote for an ended epoch is never pending.
    self._votes: dict[int, dict[int, tuple[bool, int | None]]] = {}
    self._accused: dict[int, float] = {}
    # (epoch, step) -> (commit, the epoch current when decided), in the order decided
    self._verdicts: collections.OrderedDict[tuple[int, int], tuple[bool, dict]] = (
        collections.OrderedDict())
    self._forgotten = (-1, -1)  # the highest (epoch, step) whose verdict was let go

  def _open(self, members: dict[int, Member], at_least: int, why: str) -> None:
    ended = self.epoch.number
    number = max(self.epoch.number, at_least) + 1
    self.epoch = Epoch(number, tuple(members[h] for h in sorted(members)), self.epoch.boot)
    hosts = ",".join(map(str, self.epoch.hosts)) or "none"
    self._log(f"coordinator: epoch {number}: hosts {hosts} ({why})")
    for step in self._votes:  # rule 2: an op of an ended epoch is redone in this one
      self._decide((ended, step), False)
    self._votes, self._accused = {}, {}

  def _decide(self, key: tuple[int, int], commit: bool) -> None:
    self._verdicts[key] = (commit, self.epoch.to_json())
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
    self._challenges = {c: t for c, t in self._challenges.items() if t > now}
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
    votes = [(h, s) for h, (ok, s) in self._votes[step].items() if not ok]
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
    """The answer to `req`; raises Dropped for a replay or a malformed request."""
    try:
      op = req["op"]
      if op == "hello":
        challenge = secrets.token_hex(16)
        self._challenges[challenge] = now + CHALLENGE_S
        return {"op": "challenge", "nonce": str(req["nonce"]), "challenge": challenge}
      if op == "register":
        return self._register(req, now)
      if op in ("heartbeat", "leave", "commit"):
        return self._renew(op, req, now)
    except (KeyError, TypeError, ValueError) as e:
      raise Dropped(f"malformed {req.get('op')!r} request: {e!r}") from None
    raise Dropped(f"unknown op {op!r}")

  def _register(self, req: dict, now: float) -> dict:
    challenge = str(req["challenge"])
    if self._challenges.pop(challenge, 0.0) <= now:
      raise Dropped("register with an unknown, used or expired challenge (a replay?)")
    members = self._members()
    host, last_epoch = req["host"], int(req["last_epoch"])
    why = ""
    if host is None and now < self._rebuilt_at:
      return {"op": "retry", "challenge": challenge, "after_s": self._rebuilt_at - now}
    if host is None:  # the lowest free id
      host = next((h for h in range(self.max_hosts) if h not in members), None)
      why = "" if host is not None else f"all {self.max_hosts} host ids are taken (--max_hosts)"
    elif not isinstance(host, int) or not 0 <= host < self.max_hosts:
      why = f"host id {host!r} is outside 0..{self.max_hosts - 1} (--max_hosts)"
    if why:
      self._log(f"coordinator: refused {req['address']!r}: {why}")
      return {"op": "refused", "challenge": challenge, "why": why}
    why = f"host {host} joined"
    if host in members:  # a new incarnation: the old one is gone
      self._forget(members, host)
      why = f"host {host} registered again"
    incarnation = secrets.token_hex(8)
    members[host] = Member(host, incarnation, str(req["address"]))
    self._deadline[host], self._seq[incarnation] = now + self.lease_s, 0
    self._open(members, last_epoch, why)
    self._joined[incarnation] = self.epoch.number
    return {"op": "registered", "challenge": challenge, "host": host, "incarnation": incarnation,
            "lease_s": self.lease_s, "epoch": self.epoch.to_json()}

  def _renew(self, op: str, req: dict, now: float) -> dict:
    incarnation, seq = str(req["incarnation"]), int(req["seq"])
    echo = {"incarnation": incarnation, "seq": seq}
    if op == "commit":  # its fields checked before it counts as the host's frame
      vote = req["epoch"], req["step"], req["ok"], req["suspect"]
      if [type(v) for v in vote] not in ([int, int, bool, int], [int, int, bool, type(None)]):
        raise TypeError(f"epoch, step, ok, suspect = {vote!r}: expected int, int, bool, int|None")
    if incarnation not in self._seq:  # lease ran out, registered again, or we restarted
      return {"op": "unknown", **echo}
    if seq <= self._seq[incarnation]:
      raise Dropped(f"{op} #{seq} of host {req.get('host')} after #{self._seq[incarnation]} "
                    "(a replay?)")
    self._seq[incarnation] = seq
    host = next(m.host for m in self.epoch.members if m.incarnation == incarnation)
    if op == "leave":
      members = self._members()
      self._forget(members, host)
      self._open(members, 0, f"host {host} left")
      return {"op": "left", **echo}
    self._deadline[host] = now + self.lease_s
    if op == "commit":
      return {**echo, **self._commit(host, incarnation, *vote, now)}
    return {"op": "epoch", **echo, "epoch": self.epoch.to_json()}

  def _commit(self, host: int, incarnation: str, e: int, step: int, ok: bool,
              suspect: int | None, now: float) -> dict:
    """The verdict on op `step` of epoch `e`, or a wait; `host` votes `ok` (or not, naming
    `suspect`). A vote is counted once: a poll repeats it."""
    key = (e, step)
    if key not in self._verdicts:
      if e > self.epoch.number:
        raise Dropped(f"commit vote of host {host} for epoch {e}, above the current "
                      f"{self.epoch.number}")
      if not self._joined[incarnation] <= e:
        raise Dropped(f"commit vote of host {host} for op {step} of epoch {e}, which it is not "
                      "a member of, and which has no verdict")
      if key <= self._forgotten:  # decided once maybe; deciding again could contradict it
        raise Dropped(f"commit vote of host {host} for op {step} of epoch {e}: more than "
                      f"{VERDICTS_KEPT} ops ago, its verdict is no longer kept")
      if e < self.epoch.number:  # rule 2, for an op nobody voted on while e was current
        self._decide(key, False)
      else:
        votes = self._votes.setdefault(step, {})
        ok, _ = votes.setdefault(host, (ok, suspect))
        if not ok:
          self._accused.setdefault(step, now)
        elif all(votes.get(h, (False,))[0] for h in self.epoch.hosts):  # rule 1
          del self._votes[step]
          self._accused.pop(step, None)
          self._decide(key, True)
    if key not in self._verdicts:
      return {"op": "wait"}
    commit, after = self._verdicts[key]
    return {"op": "verdict", "epoch": e, "step": step, "commit": commit, "next": after}


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def serve(port: int, max_hosts: int, lease_s: float, key: bytes, bind: str = "127.0.0.1",
          stop: threading.Event | None = None, log: Callable[[str], None] = _log,
          accuse_s: float | None = None) -> None:
  """Answers hosts on tcp://bind:port until `stop` is set."""
  stop = stop or threading.Event()
  ledger = Ledger(max_hosts, lease_s, log, time.monotonic(), accuse_s)
  ctx = zmq.Context()
  sock = ctx.socket(zmq.ROUTER)
  sock.setsockopt(zmq.LINGER, 0)
  try:
    sock.bind(f"tcp://{bind}:{port}")
  except zmq.ZMQError as e:
    ctx.destroy(linger=0)
    raise CoordinatorError(f"cannot listen on tcp://{bind}:{port}: {e}") from None
  log(f"coordinator: listening on tcp://{bind}:{port} for up to {max_hosts} hosts, "
      f"lease {lease_s:g} s")
  # leases and accusations end at most a quarter of theirs late
  tick_ms = max(10, int(min(lease_s, ledger.accuse_s) * 250))
  try:
    while not stop.is_set():
      if sock.poll(tick_ms):
        frames = sock.recv_multipart(copy=False)
        peer = frames[-1].get("Peer-Address") if frames else "?"
        route, frames = [f.bytes for f in frames[:2]], [f.bytes for f in frames[2:]]
        try:
          answer = seal(key, S2C, ledger.handle(unseal(key, C2S, frames), time.monotonic()))
        except Dropped as e:
          log(f"coordinator: dropped a frame from {peer}: {e}")
          answer = [json.dumps({"op": "dropped", "why": str(e)}).encode(), b""]
        sock.send_multipart(route + answer)
      ledger.expire(time.monotonic())
  finally:
    ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m diloco_jax.runtime.coordinator",
      description="Keeps which hosts train together: leases, and epochs that only grow.")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--max_hosts", type=int, required=True)
  parser.add_argument("--bind", default="127.0.0.1",
                      help="the address to listen on (0.0.0.0: every interface)")
  parser.add_argument("--lease_s", type=float, default=10.0,
                      help="a host that has not heartbeaten for this long is dropped")
  parser.add_argument("--accuse_s", type=float, default=None,
                      help="a host another accuses of failing an op is dropped after this "
                           "long, if the op is still undecided (default: --lease_s)")
  parser.add_argument("--join_token_file", default=None,
                      help="the job's join token (else $DILOCO_JOIN_TOKEN_FILE, "
                           "$DILOCO_JOIN_TOKEN); frames are authenticated with a key from it")
  args = parser.parse_args(argv)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  try:
    token = security.JoinToken.from_environment(args.join_token_file)
    if token is None:
      _log("coordinator: no join token: any process that reaches the port can register")
    serve(args.port, args.max_hosts, args.lease_s, key_for(token), args.bind, stop,
          accuse_s=args.accuse_s)
  except errors.DilocoError as e:
    print(errors.describe(e), file=sys.stderr)
    return e.exit_code
  _log("coordinator: stopped")
  return 0


if __name__ == "__main__":
  sys.exit(main())
