"""Cross-host sums over the hosts of the current membership epoch, each op committed.

`EpochCollective` has the interface of `collective.HostCollective` (sum, mean, allgather,
all_to_all, reduce_encoded, connect, bytes_sent) for a live job: its ops run over the epoch
wire (`peers.Peers`) among the members of the epoch the coordinator announced
(`membership/lease.py`), and a host that dies mid-op is dropped without stopping the others.

Every op is a unit that the coordinator commits. A member that finishes op k in epoch e votes
ok, one whose op failed (a peer went silent or was dropped) votes not ok, and each waits for
the coordinator's verdict on (e, k), which is the same for every member:
- commit: every member of e finished the op; each keeps its result (the same bits on every
  member) and goes on;
- redo: e ended before that (a member's lease ran out, or it was found silent); each member
  of the next epoch drops what it got and runs the op again among the new members, whose
  sum then counts only their replicas (a rider of the sum counts them: `membership/manager.py`).
So no survivor ever applies a result that another survivor replaced: the hosts cannot end
up an op (a round) apart. The price is one round trip to the coordinator per op, which also
waits for the slowest member (as the op itself does).

Like `live.LiveCollective`, `num_hosts` stays the job's host count (replicas keep their
places in [K] vectors) and `live` lists the hosts of the current epoch; `allgather` returns
a row per live host, in host order.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import numpy as np

from diloco_jax.membership import lease as lease_lib
from diloco_jax.wire import collective as collective_lib
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.peers import Peers


class EpochCollective:
  """Sums and gathers among the live hosts of a job with a membership coordinator."""

  def __init__(self, lease: lease_lib.Lease, *, token=None, timeout_s: float = 600.0,
               log: Callable[[str], None] | None = None):
    self.lease, self.token, self.timeout_s = lease, token, timeout_s
    self.num_hosts, self.host_index = lease.num_hosts, lease.host
    self.bytes_sent = 0
    self.device = None  # (collective.Collective's: the sums are numpy, on no device)
    self.step = 0  # ops committed: every member numbers its ops alike
    self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    self._epoch = lease.epoch
    self._peers: Peers | None = None
    self.live = list(self._epoch.hosts)
    self.left: list[int] = []  # hosts that left, in the order they did
    self.joined: list[int] = []  # hosts admitted since the start, in the order they were

  def rejoin(self) -> None:
    """After `lease_lib.Dropped`, once no op runs: the last epoch's connections closed
    (`admitted` then takes the epoch that admits this host again)."""
    if self._peers is not None:
      self._peers.close()
      self._peers = None

  def admitted(self) -> None:
    """A host that joined: the epoch that admitted it (`lease.join`), whose ops it numbers
    from the epoch's first, like its members."""
    self._epoch = self.lease.epoch
    self.step = self.lease.epoch.first_step
    self.live = list(self._epoch.hosts)

  def _open(self) -> Peers:
    if self._peers is None:
      # A wait for a peer the coordinator has dropped ends at once, not after timeout_s.
      # A silent peer that is alive and behind (its lease says so) is waited for.
      self._peers = Peers(self._epoch, self.host_index, token=self.token,
                          timeout_s=self.timeout_s,
                          interrupt=functools.partial(self.lease.interrupt, self._epoch.hosts),
                          patience=lambda peer: self.lease.patience(peer, self.step),
                          # a frozen peer's zmq is silent after a quarter lease: it is then
                          # named once its lease has been silent for half of one
                          liveness_s=self.lease.lease_s / 4)
    return self._peers

  def _move_to(self, announced, what: str) -> None:
    """The verdict's epoch: connections of the last one closed, the next one's opened on
    the next op."""
    if announced.number == self._epoch.number:
      return
    old = self._epoch
    self._epoch = announced
    if self._peers is not None:
      self._peers.close()
      self._peers = None
    lost = sorted(set(old.hosts) - set(self._epoch.hosts))
    self.left.extend(lost)
    self.joined.extend(sorted(set(self._epoch.hosts) - set(old.hosts)))
    self.live = list(self._epoch.hosts)
    if lost and self.host_index == min(self.live):
      self._log(f"WARNING: host(s) {lost} left (epoch {self._epoch.number}); continuing "
                f"with hosts {self.live}; {what} is done again without them")

  def _unit(self, what: str, op: Callable[[Peers], Any], boundary: bool = False) -> Any:
    """`op` among the current epoch's members until the coordinator commits it (`boundary`:
    the op ends a round, and its commit admits the hosts waiting to join). Whatever fails
    inside the op is a not-ok vote, naming the peer where the failure names one; failing
    `SELF_BLAME` times in a row with no peer to name, this host names itself (the
    coordinator then drops it: the evidence is against it); failing the same op
    `MAX_TRIES` times in a row ends its run with one line."""
    failures: list[str] = []
    unnamed = 0  # failures in a row that named no peer
    while True:
      ok, suspect, result = True, None, None
      peers = None
      sent = 0
      try:
        peers = self._open()
        sent = peers.bytes_sent
        self.lease.busy = True
        result = op(peers)
      except PeerError as e:
        ok, suspect, unnamed = False, e.host, 0
        failures.append(str(e))
      except lease_lib.MembershipError:
        raise  # out of the job (or the job ended): nothing to vote on
      except Exception as e:  # noqa: BLE001 -- a peer's bytes, a full memory: a redo
        ok, unnamed = False, unnamed + 1  # the epoch is broken (closed, a protocol error)
        failures.append(f"{type(e).__name__}: {e}"[:300])
        if unnamed >= SELF_BLAME:  # the coordinator drops it: say why, once
          suspect = self.host_index
          self._log(f"host {self.host_index}: {what} (op {self.step}) failed {unnamed} times "
                    f"in a row naming no peer; it names itself. The last: {failures[-1]}")
      finally:
        self.lease.busy = False
        if peers is not None:
          self.bytes_sent += peers.bytes_sent - sent
      if len(failures) >= MAX_TRIES:
        raise WireError(f"host {self.host_index}: {what} (op {self.step}) failed {MAX_TRIES} "
                        f"times in a row on this host; the last time: {failures[-1]}")
      verdict = self.lease.commit(self._epoch.number, self.step, ok, suspect, boundary)
      if verdict.commit:
        if not ok:  # cannot happen: a commit needs every member's ok vote
          raise WireError(f"{what}: the coordinator committed op {self.step} that this "
                          "host failed")
        self.step += 1
        self._move_to(verdict.epoch, what)
        return verdict.admitted if boundary else result
      self._move_to(verdict.epoch, what)

  # -- collective.Collective ---------------------------------------------------------------

  def atomic(self, what: str, op: Callable[[Peers], Any]) -> Any:
    """`op(peers)` as one op the coordinator commits: redone whole among the members left
    if one is lost in it (`peers` has the collective interface over the epoch)."""
    return self._unit(what, op)

  def connect(self, quiet: bool = True) -> None:
    del quiet
    sent = self.bytes_sent
    self.allgather(np.zeros(1, np.uint8))
    self.bytes_sent = sent

  def sum(self, tree: Any) -> Any:
    """Σ over the live hosts of each leaf; every host gets the same bytes."""
    return self._unit("the sum", lambda peers: peers.sum(tree))

  def mean(self, tree: Any) -> Any:
    return self._unit("the mean", lambda peers: peers.mean(tree))

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[live hosts, *x.shape], in host order."""
    return self._unit("the all-gather", lambda peers: peers.allgather(x))

  def reduce_encoded(self, x_R: np.ndarray, fmt: str, reduce=collective_lib.sum_rows,
                     **options) -> tuple[np.ndarray, np.ndarray]:
    return self._unit("the encoded sum",
                      lambda peers: peers.reduce_encoded(x_R, fmt, reduce, **options))

  # -- joining -----------------------------------------------------------------------------

  def boundary(self) -> tuple[int, ...]:
    """The end of a round, where hosts waiting to join are admitted: a one-byte all-gather
    committed as a boundary. Returns the hosts its commit admitted (members of the epoch
    from the next op on)."""
    return self._unit("the round's boundary", lambda peers: peers.connect(), boundary=True)

  def transfer(self, to: tuple[int, ...], message: Callable[[], list[bytes]] | None,
               fingerprint: Callable[[], str] | None = None
               ) -> tuple[int, list[bytearray] | None, list[str]]:
    """Point to point: a host of `to` (those admitted, as this host knows them; a joiner
    names itself) receives; every other member holds the state. The members say which
    they are in an all-gather, each holder with `fingerprint()`, the sha256 (hex) of the
    shared state it holds; and the lowest holder (the source) sends `message()` (its parts)
    to each receiver: a joiner need not know who else was admitted with it. Returns the
    source, on a receiver the parts it got (else None), and every holder's fingerprint, so
    that a receiver trusts the members rather than its one sender. An op like any: if the
    source or a receiver is lost mid-way, the members left redo it, with the lowest holder
    left as the source."""
    mine = {}

    def op(peers: Peers):
      holds = self.host_index not in to
      if holds and "digest" not in mine:  # once, however many times the op is redone
        mine["digest"] = bytes.fromhex(fingerprint()) if fingerprint else bytes(32)
      row = np.frombuffer(bytes([holds]) + mine.get("digest", bytes(32)), np.uint8)
      rows = peers.allgather(row)
      holders = [h for h, f in zip(peers.epoch.hosts, rows[:, 0]) if f]
      receivers = [h for h, f in zip(peers.epoch.hosts, rows[:, 0]) if not f]
      digests = [bytes(r[1:]).hex() for r in rows if r[0]]
      if not holders:
        raise lease_lib.JobEnded(f"host {self.host_index}: every member that held the run's "
                                 "state left before sending it; nothing to join. To go on "
                                 "training, start the whole job again: it resumes from the "
                                 "hosts' checkpoints")
      source = holders[0]
      if self.host_index == source:
        _send_parts(peers, receivers, message())
        return source, None, digests
      if self.host_index in receivers:
        return source, _recv_parts(peers, source), digests
      return source, None, digests
    return self._unit("the state transfer", op)

  def broadcast(self, parts: list[bytes] | None, source: int) -> list[bytes]:
    """`parts` of member `source` (None on every other member), on every member: sent
    point to point from `source` to each other member, as one op (a heal at a start)."""
    def op(peers: Peers):
      if self.host_index == source:
        _send_parts(peers, [h for h in peers.epoch.hosts if h != source], parts)
        return parts
      return [bytes(p) for p in _recv_parts(peers, source)]
    return self._unit("sending a checkpoint", op)

  def close(self, leave: bool = True,
            drained: Callable[[float], bool] = lambda timeout_s: True) -> None:
    """Leaves (`leave`: tells the coordinator), then closes the wire's sockets once
    `drained(seconds)` says the thread that runs ops stopped within them. An op may still
    be running there (an async mode's sum in flight at a leave): leaving first ends it at
    its next check, and its sockets are never closed under it (zmq sockets are not thread
    safe: closing one another thread uses can abort the process); if it does not stop in
    time, they are left to the process's exit."""
    self.lease.close(leave)
    if self._peers is not None and drained(DRAIN_S):
      self._peers.close()
    self._peers = None


class Rehearsal(EpochCollective):
  """`of`'s host alone, on an epoch wire of its own (one member: nothing is sent) and
  without the coordinator: the ops run at once, every wire format through the same code.
  A joiner runs a round's end on it before it is admitted (`loop/join.py`), so that what it
  compiles on first use is compiled before the members would wait for it."""

  def __init__(self, of: EpochCollective, address: str):
    super().__init__(of.lease, token=of.token, timeout_s=of.timeout_s)
    self._epoch = Epoch.of(0, (of.host_index,), (address,))
    self.live = [of.host_index]

  def _open(self) -> Peers:
    if self._peers is None:
      self._peers = Peers(self._epoch, self.host_index, token=self.token,
                          timeout_s=self.timeout_s)
    return self._peers

  def _unit(self, what: str, op: Callable[[Peers], Any], boundary: bool = False) -> Any:
    del what, boundary
    return op(self._open())

  def close(self, leave: bool = False, drained=None) -> None:
    del leave, drained
    if self._peers is not None:
      self._peers.close()
      self._peers = None


DRAIN_S = 10.0  # how long a leaver waits for an op in flight to end before it exits
SELF_BLAME = 3  # failures in a row naming no peer before a host names itself
MAX_TRIES = 16  # a host's failed tries of one op before it gives up (the others go on)
MAX_PARTS = 64  # a message's parts at most (meta.json and a file per item)


def _send_parts(peers: Peers, receivers, parts: list[bytes]) -> None:
  """Each part to each receiver, after their count."""
  count = np.array([len(parts)], np.uint64).tobytes()
  for dst in receivers:
    peers.send(dst, count)
    for part in parts:
      peers.send(dst, part)


def _recv_parts(peers: Peers, source: int) -> list[bytearray]:
  raw = peers.recv(source)
  count = int(np.frombuffer(bytes(raw), np.uint64)[0]) if len(raw) == 8 else -1
  if not 0 <= count <= MAX_PARTS:
    raise WireError(f"host {source} sent a message of {count} parts (8 bytes of count "
                    f"expected, at most {MAX_PARTS} parts)")
  return [peers.recv(source) for _ in range(count)]
