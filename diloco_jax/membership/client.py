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

import dataclasses
import json
import secrets
import threading
import time

import zmq

from diloco_jax.runtime import security
from diloco_jax.membership.coordinator import C2S, NOT_THIS_KEY, S2C, BadRequest, CoordinatorError
from diloco_jax.membership.coordinator import key_for
from diloco_jax.membership.coordinator import sign, verify
from diloco_jax.wire.epoch import Epoch
from diloco_jax.membership.ledger import JobStopping


class TokenMismatch(CoordinatorError):
  """The coordinator dropped our request: it was not signed with the job's key, so this
  host's join token differs from the coordinator's (or one of them has none)."""


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
  numbers its epochs above it."""

  def __init__(self, address: str, token: security.JoinToken | None, timeout_s: float = 5.0):
    host, port = security.split_address(address)
    self.address, self.timeout_s = address, timeout_s
    self._endpoint = f"tcp://{host}:{port}"
    self._key = key_for(token)
    self._ctx = zmq.Context()
    self._sock: zmq.Socket | None = None
    # a REQ socket takes send, receive, send...: two threads interleaving break it, and a
    # counter taken by one and sent after the other's larger one would read as a replay
    self._lock = threading.RLock()
    self._seq = 0
    self.last_epoch = 0
    self.host: int | None = None  # the id this host had: it registers again under it
    self.registration: Registration | None = None
    self.pending: tuple[int, ...] = ()  # the pending hosts, as the last answer that said
    self.stopping = False  # the job stops (every host after the same round), as last said

  def _ask(self, body: dict, what: str) -> dict:
    with self._lock:
      return self._ask_locked(body, what)

  def _ask_locked(self, body: dict, what: str) -> dict:
    if self._sock is None:
      self._sock = self._ctx.socket(zmq.REQ)
      self._sock.setsockopt(zmq.LINGER, 0)
      self._sock.connect(self._endpoint)
    self._sock.send_multipart(sign(self._key, C2S, body))
    if not self._sock.poll(int(self.timeout_s * 1000)):
      self._sock.close(linger=0)
      self._sock = None  # a REQ socket waits for its answer forever: start over next time
      raise CoordinatorLost(f"no answer from the coordinator at {self.address} within "
                            f"{self.timeout_s:g} s ({what}): it is down or unreachable")
    frames = self._sock.recv_multipart()
    try:
      return verify(self._key, S2C, frames)
    except BadRequest as e:
      try:
        said = json.loads(frames[0]).get("why", "") if len(frames) == 2 and not frames[1] else ""
      except ValueError:
        said = ""
      if said.startswith(NOT_THIS_KEY):  # an unauthenticated hint, trusted for nothing else
        raise TokenMismatch(f"the coordinator at {self.address} dropped our {what}: {said}")
      if said:
        raise CoordinatorError(f"the coordinator at {self.address} dropped our {what}: {said}")
      raise CoordinatorError(f"the coordinator at {self.address} answered our {what} with a "
                             f"frame we dropped: {e}") from None

  def _expect(self, answer: dict, op: str, **echo) -> dict:
    if answer["op"] == "refused" and op == "registered" and answer.get("stopping"):
      self.stopping = True
      raise JobStopping(f"the coordinator at {self.address} refused us: {answer['why']}")
    if answer["op"] == "refused" and op == "registered":
      raise CoordinatorError(f"the coordinator at {self.address} refused us: {answer['why']}")
    if answer["op"] != op or any(answer.get(k) != v for k, v in echo.items()):
      raise CoordinatorError(f"the coordinator at {self.address} answered {answer['op']!r} to "
                             f"another request (a replayed answer?); expected {op!r}")
    return answer

  def _seen(self, epoch: Epoch) -> Epoch:
    if epoch.number < self.last_epoch:
      raise CoordinatorError(f"the coordinator at {self.address} went back from epoch "
                             f"{self.last_epoch} to {epoch.number}")
    self.last_epoch = epoch.number
    return epoch

  def register(self, address: str, host: int | None = None,
               ready: bool = True) -> Registration:
    """Joins as `host` (None: the id it had before, else the lowest free one), reachable by
    peers at `address`. A host that registers again is a new incarnation: under an id that
    is taken, it replaces the holder (a restarted host). A coordinator that has just started
    gives out free ids only after one lease: this waits for it. `ready` False: if the job
    runs, only learn it (`pending`, and no lease): register again, ready, to be admitted."""
    host = self.host if host is None else host
    while True:
      nonce = secrets.token_hex(16)
      # (the host id a hello claims only names it in a refusal's line)
      hello = self._expect(self._ask({"op": "hello", "nonce": nonce, "host": host}, "hello"),
                           "challenge", nonce=nonce)
      challenge = hello["challenge"]
      answer = self._ask({"op": "register", "challenge": challenge, "host": host,
                          "address": address, "last_epoch": self.last_epoch,
                          "ready": ready}, "register")
      if answer["op"] != "retry":
        break
      self._expect(answer, "retry", challenge=challenge)
      time.sleep(min(float(answer["after_s"]), self.timeout_s))
    self._expect(answer, "registered", challenge=challenge)
    with self._lock:
      self.host = int(answer["host"])
      self._seq = 0
      self.registration = Registration(int(answer["host"]), answer["incarnation"],
                                       float(answer["lease_s"]),
                                       self._seen(Epoch.from_json(answer["epoch"])),
                                       bool(answer.get("pending", False)))
      return self.registration

  def _renew(self, op: str, expect: tuple[str, ...], **fields) -> dict:
    """Sends `op` with the next counter; its answer, one of the ops `expect`, or unknown."""
    with self._lock:
      registration = self.registration
      if registration is None:
        raise CoordinatorError(f"{op} before register (or after the lease was lost)")
      self._seq += 1
      echo = {"incarnation": registration.incarnation, "seq": self._seq}
      answer = self._ask({"op": op, "host": registration.host, **echo, **fields}, op)
      if answer["op"] == "unknown":
        self._expect(answer, "unknown", **echo)
        self.registration = None
        return answer
      return self._expect(answer, answer["op"] if answer["op"] in expect else expect[0], **echo)

  def heartbeat(self) -> Epoch | None:
    """Renews the lease; the current epoch, or None when the coordinator no longer knows this
    incarnation (its lease ran out, or the coordinator restarted): register again. Records
    the pending hosts in `pending`."""
    answer = self._renew("heartbeat", ("epoch",))
    if answer["op"] == "unknown":
      return None
    with self._lock:
      self.pending = tuple(int(h) for h in answer.get("pending", ()))
      self.stopping = self.stopping or bool(answer.get("stopping", False))
      return self._seen(Epoch.from_json(answer["epoch"]))

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
      answer = self._renew("commit", ("verdict", "wait"), epoch=epoch, step=step, ok=ok,
                           suspect=suspect, boundary=boundary)
      if answer["op"] == "unknown":
        raise CoordinatorError(
            f"host {self.host}: the coordinator no longer knows this host (its lease ran out "
            "or the coordinator restarted): it was dropped from the job")
      if answer["op"] == "verdict":
        if (answer["epoch"], answer["step"]) != (epoch, step):
          raise CoordinatorError(f"the coordinator at {self.address} answered op "
                                 f"{answer['step']} of epoch {answer['epoch']} to our vote on op "
                                 f"{step} of epoch {epoch}")
        after = Epoch.from_json(answer["next"])
        with self._lock:
          # a verdict keeps the epoch of its decision: a later heartbeat may have seen newer
          self.last_epoch = max(self.last_epoch, after.number)
          self.pending = tuple(int(h) for h in answer.get("pending", ()))
          self.stopping = self.stopping or bool(answer.get("stopping", False))
        return Verdict(bool(answer["commit"]), after,
                       tuple(int(h) for h in answer.get("admitted", ())))
      time.sleep(delay)
      delay = min(delay * 2, max_poll_s)

  def leave(self) -> None:
    with self._lock:
      self._renew("leave", ("left",))
      self.registration = None

  def close(self) -> None:
    self._ctx.destroy(linger=0)
