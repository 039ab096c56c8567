"""Sums, gathers and transfers between one epoch's members, over zmq (outside XLA).

`Peers(epoch, host, token=...)` opens this epoch's connections: a PULL socket bound at this
host's address, where every peer's frames arrive, and one PUSH socket connected to each
peer's. `Wire` holds the open epoch and opens the next (closing every socket of the last:
nothing is cached across epochs). Frames are `wire/frames.py`'s: a header naming epoch,
sender, receiver and sequence number, and an HMAC under the epoch's key when a join token is
set; a frame that fails a check is dropped with one log line (its sender's address, why) and
the collective goes on as if it never came.

Collectives (every member issues the same ones in the same order, as on today's wire:
`wire/dispatch.py`):
- `allreduce_sum(x)`: reduce-scatter then all-gather. Member i owns chunk i of the flat
  array: every member sends it chunk i, and member i adds the n chunks in the epoch's host
  order (x_0 + x_1 + ... + x_{n-1}, left to right, in x's dtype), then sends the result to
  every member. Every member thus gets the same bits, equal to numpy's sum in that order;
  each host sends 2(n-1)/n of the buffer (a ring's bytes: planning/model.py).
- `allgather(x)`, `all_to_all(x)`: the shapes `collective.reduce_encoded` builds every wire
  format from, so `reduce_encoded` and `sum` here are `collective.HostCollective`'s.
- `send(dst, data)` / `recv(src)`: point to point (state transfer to a healing host).

Large buffers go zero-copy (zmq `copy=False`) in chunks of `chunk_bytes`; a collective
returns once zmq has released every buffer it was given (the caller may then reuse them).

Start of an epoch: a PUSH socket may first connect to the peer's listener of the last epoch
(same port, not yet closed), and whatever it sends there is lost with it. So before the
first collective, every member resends a HELLO to each peer (every `HELLO_EVERY_S`) until
that peer answers that it heard one: from then on the connection is the peer's listener of
this epoch, and frames on it arrive in order. Construction itself waits for nobody.

Failure: every wait for a peer's frame has a deadline, `timeout_s` of silence from that
peer; past it, `PeerError` names the peer, its address and the epoch (a membership layer
drops it and opens the next epoch). After any failure the epoch is broken: every later
collective raises at once instead of waiting for a peer that is out of step.
"""

from __future__ import annotations

import collections
import errno
import re
import time
from typing import Any
from typing import Callable

import numpy as np
import zmq

from diloco_jax.wire import frames
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.epoch import endpoint
from diloco_jax.wire.epoch import epoch_key

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CHUNK = 1 << 20
HELLO_EVERY_S = 0.05
BIND_RETRY_S = 5.0  # the last epoch's listener on the same port may still be closing


def _warn(line: str) -> None:
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.warning("%s", line)


def _bytes(a: np.ndarray) -> memoryview:
  """A C-contiguous array's bytes, without a copy."""
  return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class Peers:
  """One epoch's connections and collectives, seen from member `host`."""

  def __init__(self, epoch: Epoch, host: int, *, token=None,
               timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK,
               context: zmq.Context | None = None, log: Callable[[str], None] = _warn):
    if not 0 < chunk_bytes <= frames.MAX_CHUNK:
      raise WireError(f"chunk_bytes={chunk_bytes}: must be in 1..{frames.MAX_CHUNK}")
    if not timeout_s > 0:
      raise WireError(f"timeout_s={timeout_s}: must be > 0")
    self.epoch, self.host = epoch, host
    self.host_index = epoch.rank(host)
    self.num_hosts = epoch.size
    self.timeout_s, self.chunk_bytes, self._log = float(timeout_s), chunk_bytes, log
    self._key = epoch_key(token, epoch.number)
    self._members = set(epoch.hosts)
    self._seq_out: dict[int, int] = collections.defaultdict(int)
    self._seq_in: dict[int, int] = {}
    self._inbox: dict[int, collections.deque] = {h: collections.deque() for h in epoch.hosts}
    self._trackers: list[tuple[int, zmq.MessageTracker]] = []
    self._broken: WireError | None = None
    self._ready = epoch.size == 1
    self._heard: set[int] = set()  # peers whose HELLO arrived
    self._answered: set[int] = set()  # peers that said they heard ours
    self._logged: set[tuple] = set()
    self.bytes_sent = 0  # payload bytes this host put on the wire in this epoch
    self.frame_bytes = 0  # the same with headers and MACs
    self.dropped = 0  # frames refused
    ctx = context or zmq.Context.instance()
    linger = int(self.timeout_s * 1000)  # close() returns at once; queued frames still go
    self._pull = ctx.socket(zmq.PULL)
    self._pull.setsockopt(zmq.RCVHWM, 0)
    self._pull.setsockopt(zmq.MAXMSGSIZE, frames.MAX_CHUNK + 1024)  # a bigger frame: cut
    self._pull.setsockopt(zmq.LINGER, 0)
    self._bind(endpoint(epoch.address(host)))
    self._push: dict[int, zmq.Socket] = {}
    for peer, address in zip(epoch.hosts, epoch.addresses):
      if peer != host:
        s = self._push[peer] = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, linger)
        s.setsockopt(zmq.RECONNECT_IVL, 20)
        s.connect(endpoint(address))

  def _bind(self, where: str) -> None:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
      try:
        self._pull.bind(where)
        return
      except zmq.ZMQError as e:
        if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
          self._pull.close(0)
          raise WireError(f"epoch {self.epoch.number}: host {self.host} cannot listen at "
                          f"{where}: {e}") from None
        time.sleep(0.02)

  def close(self) -> None:
    for s in [self._pull, *self._push.values()]:
      s.close()
    self._broken = self._broken or WireError(f"epoch {self.epoch.number} is closed")

  def __enter__(self) -> Peers:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- messages ------------------------------------------------------------------------

  def _send(self, dst: int, kind: int, buf: memoryview) -> None:
    total, sock = buf.nbytes, self._push[dst]
    for offset in range(0, max(total, 1), self.chunk_bytes):
      piece = buf[offset:offset + self.chunk_bytes]
      header = frames.Header(kind, self.epoch.number, self.host, dst, self._seq_out[dst],
                             total, offset)
      self._seq_out[dst] += 1
      parts = frames.seal(header, piece, self._key)
      self._trackers.append((dst, sock.send_multipart(parts, copy=False, track=True)))
      self.bytes_sent += piece.nbytes
      self.frame_bytes += sum(memoryview(p).nbytes for p in parts)

  def _accept(self, msg: list) -> None:
    try:
      header, payload = frames.check([f.buffer for f in msg], key=self._key,
                                     epoch=self.epoch.number, me=self.host,
                                     members=self._members, expected_seq=self._seq_in)
    except frames.Dropped as d:
      self.dropped += 1
      try:
        address = msg[0].get("Peer-Address")
      except zmq.ZMQError:
        address = "an unknown address"
      what = (address, d.sender, re.sub(r"\d+", "#", str(d)))
      if what not in self._logged:  # one line per sender and reason, however many frames
        self._logged.add(what)
        who = "" if d.sender is None else f" (claims host {d.sender})"
        self._log(f"wire: epoch {self.epoch.number}, host {self.host}: dropped a frame "
                  f"from {address}{who}: {d}")
      return
    if header.kind == frames.HELLO:
      self._heard.add(header.sender)
      if bytes(payload) == b"\1":
        self._answered.add(header.sender)
      return
    self._inbox[header.sender].append((header, payload))

  def _hello(self, dst: int) -> None:
    header = frames.Header(frames.HELLO, self.epoch.number, self.host, dst, 0, 1, 0)
    answer = b"\1" if dst in self._heard else b"\0"
    self._push[dst].send_multipart(frames.seal(header, answer, self._key))

  def _handshake(self) -> None:
    """HELLOs until every peer has heard this host (module docstring)."""
    deadline, resend = time.monotonic() + self.timeout_s, 0.0
    while self._answered != set(self._push):
      now = time.monotonic()
      if now >= deadline:
        late = [h for h in self.epoch.hosts if h in self._push and h not in self._answered]
        raise PeerError(
            f"epoch {self.epoch.number}: host {late[0]} ({self.epoch.address(late[0])}) did "
            f"not answer for {self.timeout_s:g} s at the epoch's start: it died, is not "
            f"there yet, or holds another join token (seen from host {self.host})",
            epoch=self.epoch.number, host=late[0])
      if now >= resend:
        for dst in self._push:
          self._hello(dst)
        resend = now + HELLO_EVERY_S
      if self._pull.poll(max(1, int(1000 * (min(resend, deadline) - now)))):
        self._accept(self._pull.recv_multipart(copy=False))
    for dst in self._push:  # the answer each peer may still wait for; it arrives now
      self._hello(dst)
    self._ready = True

  def _next(self, src: int, kind: int, what: str) -> tuple[frames.Header, memoryview]:
    """src's next accepted frame, waiting at most `timeout_s` of silence."""
    inbox, deadline = self._inbox[src], time.monotonic() + self.timeout_s
    while not inbox:
      left = deadline - time.monotonic()
      if left <= 0:
        raise PeerError(
            f"epoch {self.epoch.number}: host {src} ({self.epoch.address(src)}) sent nothing "
            f"for {self.timeout_s:g} s during {what}: it died, went silent or left the "
            f"epoch (seen from host {self.host})", epoch=self.epoch.number, host=src)
      if self._pull.poll(max(1, int(left * 1000))):
        self._accept(self._pull.recv_multipart(copy=False))
    header, payload = inbox.popleft()
    if header.kind != kind:
      raise WireError(f"epoch {self.epoch.number}: host {src} sent a "
                      f"{frames.KINDS[header.kind]} where host {self.host} expects "
                      f"{frames.KINDS[kind]} ({what}): the members are out of step")
    return header, payload

  def _recv_into(self, src: int, kind: int, out: memoryview | None, what: str) -> memoryview:
    """One message from `src` into `out` (its size must match; None: a new buffer)."""
    header, payload = self._next(src, kind, what)
    if out is None:
      out = memoryview(bytearray(header.total))
    if header.total != out.nbytes:
      raise WireError(f"epoch {self.epoch.number}: host {src} sent {header.total} bytes for "
                      f"{what}, host {self.host} expects {out.nbytes} (shapes differ)")
    got = 0
    while True:
      if header.offset != got:
        raise WireError(f"epoch {self.epoch.number}: host {src}'s {what} chunk at offset "
                        f"{header.offset}, expected {got}")
      out[got:got + payload.nbytes] = payload
      got += payload.nbytes
      if got >= header.total:
        return out
      header, payload = self._next(src, kind, what)

  def _settle(self, what: str) -> None:
    """Waits until zmq has released every buffer handed to it (the caller's may change)."""
    deadline = time.monotonic() + self.timeout_s
    for dst, tracker in self._trackers:
      try:
        tracker.wait(max(0.0, deadline - time.monotonic()))
      except zmq.NotDone:
        raise PeerError(f"epoch {self.epoch.number}: host {dst} ({self.epoch.address(dst)}) "
                        f"took nothing for {self.timeout_s:g} s during {what} (seen from host "
                        f"{self.host})", epoch=self.epoch.number, host=dst) from None
    self._trackers.clear()

  def _run(self, what: str, fn, *args):
    if self._broken is not None:
      raise WireError(f"{what}: epoch {self.epoch.number} is unusable after: {self._broken}")
    try:
      if not self._ready:
        self._handshake()
      out = fn(*args)
      self._settle(what)
      return out
    except WireError as e:
      self._broken = e
      raise

  # -- collectives -----------------------------------------------------------------------

  def allreduce_sum(self, x: np.ndarray) -> np.ndarray:
    """Σ over members of x (same shape and dtype on every member), added in host order;
    every member gets the same bits."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiu":
      raise WireError(f"allreduce_sum: dtype {x.dtype} is not a number type")
    return self._run("a sum", self._sum, x)

  def _sum(self, x: np.ndarray) -> np.ndarray:
    flat, n, me = np.ascontiguousarray(x).reshape(-1), self.num_hosts, self.host_index
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.empty(flat.size, bool), n)])
    span = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(n)]
    hosts = self.epoch.hosts
    for i in range(n):
      if i != me:
        self._send(hosts[i], frames.SCATTER, _bytes(flat[span[i]]))
    total = None
    for i in range(n):  # host order: the same rounding on every member
      if i == me:
        part = flat[span[me]]
      else:
        part = np.empty(span[me].stop - span[me].start, flat.dtype)
        self._recv_into(hosts[i], frames.SCATTER, _bytes(part), "a sum (reduce-scatter)")
      total = part.copy() if total is None else np.add(total, part, out=total)
    for i in range(n):
      if i != me:
        self._send(hosts[i], frames.GATHER, _bytes(total))
    out = np.empty_like(flat)
    out[span[me]] = total
    for i in range(n):
      if i != me:
        self._recv_into(hosts[i], frames.GATHER, _bytes(out[span[i]]), "a sum (all-gather)")
    return out.reshape(x.shape)

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[hosts, *x.shape]: every member's `x`, in host order."""
    return self._run("an all-gather", self._allgather, np.ascontiguousarray(x))

  def _allgather(self, x: np.ndarray) -> np.ndarray:
    out = np.empty((self.num_hosts, *x.shape), x.dtype)
    out[self.host_index] = x
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self._send(h, frames.GATHER, _bytes(x))
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self._recv_into(h, frames.GATHER, _bytes(out[i]), "an all-gather")
    return out

  def all_to_all(self, x: np.ndarray) -> np.ndarray:
    """x: [hosts, ...], row i for member i. Returns [hosts, ...]: row j from member j."""
    x = np.ascontiguousarray(x)
    if x.ndim == 0 or x.shape[0] != self.num_hosts:
      raise WireError(f"all_to_all: shape {x.shape}: the first axis must be the "
                      f"{self.num_hosts} members")
    return self._run("an all-to-all", self._all_to_all, x)

  def _all_to_all(self, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    out[self.host_index] = x[self.host_index]
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self._send(h, frames.ALL_TO_ALL, _bytes(x[i]))
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self._recv_into(h, frames.ALL_TO_ALL, _bytes(out[i]), "an all-to-all")
    return out

  def send(self, dst: int, data) -> None:
    """Sends `data` (bytes-like) to member `dst`, which takes it with `recv(this host)`."""
    self.epoch.rank(dst)
    if dst == self.host:
      raise WireError(f"send: host {dst} is this host")
    self._run(f"a send to host {dst}", self._send, dst, frames.POINT,
              memoryview(data).cast("B"))

  def recv(self, src: int) -> bytearray:
    """What member `src` sent with `send(this host, ...)`."""
    self.epoch.rank(src)
    if src == self.host:
      raise WireError(f"recv: host {src} is this host")
    return self._run(f"a receive from host {src}", lambda: self._recv_into(
        src, frames.POINT, None, f"a transfer from host {src}").obj)

  # -- collective.HostCollective's interface ---------------------------------------------

  def connect(self, quiet: bool = True) -> None:
    """Waits until every member is there (a one-byte all-gather, not counted)."""
    del quiet
    sent, framed = self.bytes_sent, self.frame_bytes
    self.allgather(np.zeros(1, np.uint8))
    self.bytes_sent, self.frame_bytes = sent, framed

  def sum(self, tree: Any) -> Any:
    """Σ over members of each leaf (one sum per dtype); every member gets the same bytes."""
    from diloco_jax.wire import collective  # pylint: disable=import-outside-toplevel
    flat, layout = collective._pack(tree)  # pylint: disable=protected-access
    return collective._unpack({dt: self.allreduce_sum(buf) for dt, buf in flat.items()},  # pylint: disable=protected-access
                              layout)

  def mean(self, tree: Any) -> Any:
    import jax  # pylint: disable=import-outside-toplevel
    return jax.tree.map(lambda s: s / np.asarray(self.num_hosts, s.dtype), self.sum(tree))

  def reduce_encoded(self, x_R: np.ndarray, fmt: str, reduce=None,
                     **options) -> tuple[np.ndarray, np.ndarray]:
    """`collective.reduce_encoded` over this epoch's members (default reduce: the sum in
    host order). Returns the result and this host's rows as carried."""
    from diloco_jax.wire import collective  # pylint: disable=import-outside-toplevel
    out, _, carried = collective.reduce_encoded(
        x_R, fmt, reduce or collective.sum_rows, num_hosts=self.num_hosts,
        all_to_all=self.all_to_all, allgather=self.allgather, **options)
    return out, carried  # bytes_sent counted the frames themselves


class Wire:
  """This host's end of the wire across epochs: `open(epoch)` closes the last epoch's
  connections and opens the next's; epoch numbers only grow."""

  def __init__(self, host: int, **options):
    self.host, self._options = host, options
    self.peers: Peers | None = None

  def open(self, epoch: Epoch) -> Peers:
    if self.peers is not None:
      if epoch.number <= self.peers.epoch.number:
        raise WireError(f"epoch {epoch.number} after epoch {self.peers.epoch.number}: "
                        "epoch numbers only grow")
      self.peers.close()
    self.peers = None
    self.peers = Peers(epoch, self.host, **self._options)
    return self.peers

  def close(self) -> None:
    if self.peers is not None:
      self.peers.close()
