"""A host's side of the membership coordinator (membership/coordinator.py): register for a lease,
heartbeat within it to learn the current epoch, vote on each cross-host op (commit), leave.
A host that registers while the job runs is pending: its heartbeats show the epoch without it
until the members admit it at a round boundary (a commit voted `boundary`), then with it.

One blocking request at a time over a zmq REQ socket; a request with no answer within
`timeout_s` raises `CoordinatorLost` (one line naming the coordinator) and the next request
opens a fresh socket, so a host can carry on and register again once the coordinator is back.
A lock makes each request whole (its counter, send and answer), so a heartbeat thread and
the thread that commits ops may share one Client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import socket
import threading
import time

import zmq

from diloco_jax.runtime import security
from diloco_jax.membership.ledger import CoordinatorError
from diloco_jax.membership import protocol
from diloco_jax.membership.protocol import C2S, NOT_THIS_KEY, S2C, BadRequest
from diloco_jax.membership.protocol import key_for
from diloco_jax.membership.protocol import sign, verify
from diloco_jax.wire import sealed
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import WireError
from diloco_jax.membership.ledger import JobStopping


HANDSHAKE_POLL_MS = 100  # how often a request waiting for its answer reads the handshakes


@contextlib.contextmanager
def _reading(address: str, what: str):
  """Turns an answer's missing or mistyped field into one CoordinatorError naming it."""
  try:
    yield
  except (protocol.Malformed, WireError, KeyError, TypeError) as e:
    raise CoordinatorError(f"the coordinator at {address} answered a malformed {what}: "
                           f"{e}") from None


def wire_address(coordinator: str, given: str | None = None) -> str:
  """host:port where this host's peers reach its wire: `given`, else the address of the
  interface that routes to the coordinator and a port free on it now."""
  if given:
    security.split_address(given, "--wire_address")
    return given
  host, port = security.split_address(coordinator)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host, port))  # no packet is sent: this only picks the route
    ip = s.getsockname()[0]
  with socket.socket() as s:
    s.bind((ip, 0))
    return f"{ip}:{s.getsockname()[1]}"


def _quiet(pairs) -> dict[int, float]:
  """An epoch answer's `quiet`: [[host, ms since its last renewal], ...] -> {host: s}."""
  if not isinstance(pairs, list) or len(pairs) > protocol.MAX_HOSTS:
    raise protocol.Malformed(f"quiet={str(pairs)[:40]}: expected [host, ms] pairs")
  if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
    raise protocol.Malformed(f"quiet={str(pairs)[:40]}: expected [host, ms] pairs")
  return {protocol.integer({"h": h}, "h"): protocol.integer({"ms": ms}, "ms") / 1e3
          for h, ms in pairs}


def _triple(value) -> tuple:
  if not isinstance(value, list) or len(value) != 3:
    raise protocol.Malformed(f"{str(value)[:40]}: expected [host, ops, busy]")
  return tuple(value)


class TokenMismatch(CoordinatorError):
  """The coordinator dropped our request: it was not signed with the job's key, so this
  host's join token differs from the coordinator's (or one of them has none)."""


class Unknown(CoordinatorError):
  """The coordinator does not know this host's incarnation: its lease ran out (`boot` the
  coordinator's it registered with), or the coordinator restarted (another `boot`)."""

  def __init__(self, message: str, boot: str):
    super().__init__(message)
    self.boot = boot


class Unregistered(CoordinatorError):
  """A request that needs a registration, made while this host has none (another thread
  found it unknown a moment ago, and registers again)."""


class CoordinatorLost(CoordinatorError):
  """No answer from the coordinator within the timeout."""
  prefix = "Coordinator lost"


@dataclasses.dataclass(frozen=True)
class Registration:
  host: int
  incarnation: str
  lease_s: float  # heartbeat well within it (a third, say)
  epoch: Epoch
  pending: bool = False  # the job runs: not a member of `epoch` until a round boundary


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The coordinator's decision on one op: `commit` (every member holds the result: apply
  it) or not (redo the op), and `epoch`, the one current when it decided: redo in it.
  `admitted`: the pending hosts this commit made members of `epoch` (the op ended a round)."""
  commit: bool
  epoch: Epoch
  admitted: tuple[int, ...] = ()


class Client:
  """Talks to the coordinator at `address` ('host:port'). `last_epoch`: the highest epoch
  number this host has seen; it is reported when registering, so that a restarted coordinator
  numbers its epochs above it. `programs`: where this host serves its compiled programs,
  said in each registration (membership/programs.py)."""

  def __init__(self, address: str, token: security.JoinToken | None, timeout_s: float = 5.0,
               last_epoch: int = 0, programs: str = ""):
    host, port = security.split_address(address)
    self.address, self.timeout_s = address, timeout_s
    self._endpoint = f"tcp://{host}:{port}"
    self._key = key_for(token)
    # the process's shared context: a context of its own, left to the garbage collector
    # (a Client never closed, in a reference cycle) would block in zmq's term there
    self._ctx = zmq.Context.instance()
    self._sock: zmq.Socket | None = None
    self._handshakes: sealed.Handshakes | None = None
    # a REQ socket takes send, receive, send...: two threads interleaving break it, and a
    # counter taken by one and sent after the other's larger one would read as a replay
    self._lock = threading.RLock()
    self._seq = 0
    # from this host's newest checkpoint, so that a coordinator started anew, with every
    # host restarted too, still numbers its epochs above this run's
    self.last_epoch = last_epoch
    self.host: int | None = None  # the id this host had: it registers again under it
    self.registration: Registration | None = None
    self.pending: tuple[int, ...] = ()  # the pending hosts, as the last answer that said
    self.stopping = False  # the job stops (every host after the same round), as last said
    self.rebuilding = False  # a restarted coordinator waits for hosts to come back
    self.boot = ""  # the coordinator's, as its last `unknown` said
    self.positions: dict[int, tuple[int, bool]] = {}  # host -> (ops committed, in one now)
    self.quiet: dict[int, float] = {}  # member -> s since its last renewal, as last heard
    self.heard_at = 0.0  # when (time.monotonic) the coordinator's epoch answer said so
    self.programs = programs  # where this host serves its compiled programs (programs.py)

  def _ask(self, body: dict, what: str) -> dict:
    with self._lock:
      return self._ask_locked(body, what)

  def _ask_locked(self, body: dict, what: str) -> dict:
    if self._sock is None:
      self._sock = self._ctx.socket(zmq.REQ)
      self._sock.setsockopt(zmq.LINGER, 0)
      # CURVE with the key from the token, as the coordinator listens (wire/sealed.py)
      sealed.connect(self._sock, self._key if protocol.keyed(self._key) else None)
      self._handshakes = sealed.Handshakes(self._sock)
      self._sock.connect(self._endpoint)
    # its events, taken at each request too: zmq's I/O thread (this process's other sockets
    # with it) would block on a monitor whose queue filled between requests
    self._handshakes.read()
    self._sock.send_multipart(sign(self._key, C2S, body))
    deadline = time.monotonic() + self.timeout_s
    while not self._sock.poll(HANDSHAKE_POLL_MS):
      # the coordinator is up but keyed otherwise: waiting longer cannot help
      self._handshakes.read()
      refused = self._handshakes.refused
      if refused or time.monotonic() > deadline:
        self._drop_socket()  # a REQ socket waits for its answer forever: start over
        if refused:
          raise TokenMismatch(f"the coordinator at {self.address} ended our handshake: "
                              f"{sealed.STRANGER}")
        raise CoordinatorLost(f"no answer from the coordinator at {self.address} within "
                              f"{self.timeout_s:g} s ({what}): it is down or unreachable")
    frames = self._sock.recv_multipart()
    try:
      return verify(self._key, S2C, frames)
    except BadRequest as e:
      try:  # an unauthenticated answer: read as strictly as the coordinator reads requests
        said = (protocol.text(protocol.loads(frames[0]), "why")
                if len(frames) == 2 and not frames[1] and len(frames[0]) <= 1024 else "")
      except BadRequest:
        said = ""
      if said.startswith(NOT_THIS_KEY):  # an unauthenticated hint, trusted for nothing else
        raise TokenMismatch(f"the coordinator at {self.address} dropped our {what}: {said}")
      if said:
        raise CoordinatorError(f"the coordinator at {self.address} dropped our {what}: {said}")
      raise CoordinatorError(f"the coordinator at {self.address} answered our {what} with a "
                             f"frame we dropped: {e}") from None

  def _expect(self, answer: dict, op: str, **echo) -> dict:
    refused = f"the coordinator at {self.address} refused us: {str(answer.get('why'))[:300]}"
    if answer["op"] == "refused" and op == "registered" and answer.get("stopping"):
      self.stopping = True
      raise JobStopping(refused)
    if answer["op"] == "refused" and op == "registered":
      raise CoordinatorError(refused)
    if answer["op"] != op or any(answer.get(k) != v for k, v in echo.items()):
      raise CoordinatorError(f"the coordinator at {self.address} answered {answer['op']!r} to "
                             f"another request (a replayed answer?); expected {op!r}")
    return answer

  def _seen(self, epoch: Epoch, fresh: bool = False) -> Epoch:
    if epoch.number < self.last_epoch and not fresh:
      raise CoordinatorError(f"the coordinator at {self.address} went back from epoch "
                             f"{self.last_epoch} to {epoch.number}")
    self._note(epoch.number)
    return epoch

  def _note(self, number: int) -> None:
    self.last_epoch = max(self.last_epoch, number)

  def register(self, address: str, host: int | None = None,
               ready: bool = True, resume: tuple[int, tuple[int, ...]] | None = None
               ) -> Registration:
    """Joins as `host` (None: the id it had before, else the lowest free one), reachable by
    peers at `address`. A host that registers again is a new incarnation: under an id that
    is taken, it replaces the holder (a restarted host). A coordinator that has just started
    gives out free ids only after a few leases: this waits for it. `ready` False: if the
    job runs, only learn it (`pending`, and no lease): register again, ready, to be
    admitted. `resume` (ops committed, hosts of the last epoch): this host was a member of
    the job under a coordinator that was lost, and comes back to its successor."""
    host = self.host if host is None else host
    while True:
      nonce = secrets.token_hex(16)
      # (the host id a hello claims only names it in a refusal's line)
      hello = self._expect(self._ask({"op": "hello", "nonce": nonce, "host": host}, "hello"),
                           "challenge", nonce=nonce)
      challenge = hello["challenge"]
      resuming = {} if resume is None else {"resume": True, "step": resume[0],
                                            "was": list(resume[1])}
      answer = self._ask({"op": "register", "challenge": challenge, "host": host,
                          "address": address, "last_epoch": self.last_epoch,
                          "ready": ready, **resuming,
                          **({"programs": self.programs} if self.programs else {})},
                         "register")
      if answer["op"] != "retry":
        break
      self._expect(answer, "retry", challenge=challenge)
      with _reading(self.address, "retry"):
        time.sleep(min(protocol.integer(answer, "after_ms") / 1000, self.timeout_s))
    self._expect(answer, "registered", challenge=challenge)
    with self._lock, _reading(self.address, "registration"):
      registration = Registration(
          protocol.integer(answer, "host"), protocol.text(answer, "incarnation"),
          protocol.integer(answer, "lease_ms", 1) / 1000,
          # (an answer to this challenge: fresh; a pending host's epoch may be a restarted
          # coordinator's, below the number this host had seen)
          self._seen(Epoch.from_json(answer["epoch"]), fresh=True),
          protocol.flag(answer, "pending", False))
      self.host, self._seq, self.registration = registration.host, 0, registration
      self.rebuilding = protocol.flag(answer, "rebuilding", False)
      return registration

  def _renew(self, op: str, expect: tuple[str, ...], **fields) -> dict:
    """Sends `op` with the next counter; its answer, one of the ops `expect`, or unknown."""
    with self._lock:
      registration = self.registration
      if registration is None:
        raise Unregistered(f"{op} before register (or after the lease was lost)")
      self._seq += 1
      echo = {"incarnation": registration.incarnation, "seq": self._seq}
      answer = self._ask({"op": op, "host": registration.host, **echo, **fields}, op)
      if answer["op"] == "unknown":
        self._expect(answer, "unknown", **echo)
        self.registration = None
        self.boot = str(answer.get("boot", ""))[:64]  # (the coordinator that answered)
        return answer
      return self._expect(answer, answer["op"] if answer["op"] in expect else expect[0], **echo)

  def heartbeat(self, at: int | None = None, busy: bool = False) -> Epoch | None:
    """Renews the lease, saying where this host is (`at`: the ops it committed; `busy`: in
    one now); the current epoch, or None when the coordinator no longer knows this
    incarnation (its lease ran out, or the coordinator restarted): register again. Records
    the pending hosts in `pending` and where the members are in `positions`."""
    where = {} if at is None else {"at": at, "busy": busy}
    # One hold of the lock from the request to the answer read: another thread's commit
    # answered in between would note a newer epoch first, and this one's look like a step
    # back: a "went back from epoch" error that ended a host (tests/test_live_formats.py,
    # about one run in ten once a catch-up round was added).
    with self._lock:
      answer = self._renew("heartbeat", ("epoch",), **where)
      if answer["op"] == "unknown":
        return None
      with _reading(self.address, "heartbeat"):
        epoch = Epoch.from_json(answer["epoch"])
        self._news(answer)
        self.rebuilding = protocol.flag(answer, "rebuilding", False)
        at = answer.get("at", [])
        if not isinstance(at, list) or len(at) > protocol.MAX_HOSTS:
          raise protocol.Malformed(f"at={str(at)[:40]}: expected [host, ops, busy] triples")
        self.positions = {protocol.integer({"h": h}, "h"): (protocol.integer({"a": a}, "a"),
                                                            protocol.flag({"b": b}, "b"))
                          for h, a, b in (_triple(t) for t in at)}
        self.quiet, self.heard_at = _quiet(answer.get("quiet", [])), time.monotonic()
        return self._seen(epoch)

  def unheard_s(self, host: int, fresh_s: float) -> float | None:
    """Seconds since `host` last renewed its lease at the coordinator: what its last epoch
    answer said plus the time since. None when that answer is older than `fresh_s` (this
    host's own word is stale: the coordinator slow or away) or did not name `host`."""
    since = time.monotonic() - self.heard_at
    quiet = self.quiet.get(host)
    return None if quiet is None or since > fresh_s else quiet + since

  def _news(self, answer: dict) -> None:
    """The pending hosts and whether the job stops, as an answer says."""
    self.pending = tuple(protocol.hosts(answer, "pending"))
    self.stopping = self.stopping or protocol.flag(answer, "stopping", False)

  def commit(self, epoch: int, step: int, ok: bool, suspect: int | None = None,
             poll_s: float = 0.002, max_poll_s: float = 0.05, *,
             boundary: bool = False) -> Verdict:
    """Votes on op `step` of `epoch` (`ok`: this host holds its result; else it failed, and
    `suspect` is the peer that went silent, if known) and waits for the verdict, polling from
    every `poll_s` to every `max_poll_s`. `boundary`: the op ends a round, so its commit may
    admit the pending hosts (when every member says so). Every member gets the same verdict.
    Raises CoordinatorLost when a poll gets no answer in `timeout_s`, and CoordinatorError
    when the coordinator no longer knows this host: it was dropped and must register again."""
    delay = poll_s
    while True:
      answer = self._renew("commit", ("verdict", "wait", "abort"), epoch=epoch, step=step,
                           ok=ok, suspect=suspect, boundary=boundary)
      if answer["op"] == "abort":
        raise CoordinatorError(f"the coordinator at {self.address} gave the job up: "
                               f"{str(answer.get('why'))[:300]}")
      if answer["op"] == "unknown":
        raise Unknown(
            f"host {self.host}: the coordinator no longer knows this host (its lease ran out "
            "or the coordinator restarted): it was dropped from the job", self.boot)
      if answer["op"] == "verdict":
        with self._lock, _reading(self.address, "verdict"):
          if answer.get("epoch") != epoch or answer.get("step") != step:
            raise CoordinatorError(f"the coordinator at {self.address} answered op "
                                   f"{str(answer.get('step'))[:20]} of epoch "
                                   f"{str(answer.get('epoch'))[:20]} to our vote on op {step} "
                                   f"of epoch {epoch}")
          after = Epoch.from_json(answer["next"])
          verdict = Verdict(protocol.flag(answer, "commit"), after,
                            tuple(protocol.hosts(answer, "admitted")))
          self._news(answer)
          # a verdict keeps the epoch of its decision: a later heartbeat may have seen newer
          self._note(after.number)
        return verdict
      time.sleep(delay)
      delay = min(delay * 2, max_poll_s)

  def leave(self) -> None:
    with self._lock:
      self._renew("leave", ("left",))
      self.registration = None

  def _drop_socket(self) -> None:
    self._handshakes.close()
    self._sock.close(linger=0)
    self._sock = self._handshakes = None

  def close(self) -> None:
    with self._lock:
      if self._sock is not None:
        self._drop_socket()
