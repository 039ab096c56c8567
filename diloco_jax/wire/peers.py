"""Sums, gathers and transfers between one epoch's members, over zmq (outside XLA).

`Peers(epoch, host, token=...)` opens this epoch's connections: a PULL socket bound at this
host's address, where every peer's frames arrive, and one PUSH socket connected to each
peer's. `Wire` holds the open epoch and opens the next (closing every socket of the last:
nothing is cached across epochs). Frames are `wire/frames.py`'s: a header naming epoch,
sender, receiver and sequence number, and a MAC under the epoch's key when a join token is
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
A sum adds each received chunk into its result as it arrives, straight from the frame.

Start of an epoch: a PUSH socket may first connect to the peer's listener of the last epoch
(same port, not yet closed), and whatever it sends there is lost with it. So before the
first collective, every member resends a HELLO to each peer (every `HELLO_EVERY_S`) until
that peer answers that it heard one: from then on the connection is the peer's listener of
this epoch, and frames on it arrive in order. Construction itself waits for nobody.

Failure: every wait for a peer's frame has a deadline, `timeout_s` of silence from that
peer; past it, `PeerError` names the peer, its address and the epoch (a membership layer
drops it and opens the next epoch). A membership layer that learns sooner that a member is
gone passes `interrupt` (`links.Links`), which every wait asks at least every 100 ms: its
reason ends the wait with `PeerError` at once, so `timeout_s` can be long. After any
failure the epoch is broken: every later collective raises at once instead of waiting for
a peer that is out of step, and this host stops reading (what arrives now is for the next
epoch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diloco_jax.wire import frames
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.links import Links
from diloco_jax.wire.links import as_bytes


class Peers:
  """One epoch's collectives, seen from member `host`: `Peers(epoch, host, token=...,
  timeout_s=..., chunk_bytes=...)` over its connections (`links`: `links.Links`)."""

  def __init__(self, epoch: Epoch, host: int, **options):
    self.links = Links(epoch, host, **options)

  # What the collectives read of the connections.
  epoch = property(lambda self: self.links.epoch)
  host = property(lambda self: self.links.host)
  host_index = property(lambda self: self.links.host_index)  # its rank in the epoch
  num_hosts = property(lambda self: self.links.num_hosts)
  chunk_bytes = property(lambda self: self.links.chunk_bytes)
  bytes_sent = property(lambda self: self.links.bytes_sent)
  frame_bytes = property(lambda self: self.links.frame_bytes)
  dropped = property(lambda self: self.links.dropped)

  def halt(self) -> None:
    self.links.halt()

  def close(self) -> None:
    self.links.close()

  def __enter__(self) -> Peers:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


  def _run(self, what: str, fn, *args):
    if self.links.broken is not None:
      raise WireError(f"{what}: epoch {self.epoch.number} is unusable after: {self.links.broken}")
    try:
      if not self.links.ready:
        self.links.handshake()
      out = fn(*args)
      self.links.settle(what)
      return out
    except WireError as e:
      self.links.broken = e
      self.links.halt()
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
    hosts, item = self.epoch.hosts, flat.dtype.itemsize
    chunk = max(item, self.chunk_bytes - self.chunk_bytes % item)  # whole entries, so
    for i in range(n):  # each chunk is added as it arrives
      if i != me:
        self.links.send(hosts[i], frames.SCATTER, as_bytes(flat[span[i]]), chunk)
    out = np.empty_like(flat)
    own, total = flat[span[me]], out[span[me]]  # this host's chunk, summed in place
    if n == 1:
      total[:] = own
    what = "a sum (reduce-scatter)"
    for i in range(n):  # host order: the same rounding on every member
      if i == me:
        if i > 0:
          np.add(total, own, out=total)
        continue
      chunks = self.links.chunks(hosts[i], frames.SCATTER, total.nbytes, what)
      next(chunks)
      for offset, payload in chunks:
        if offset % item or payload.nbytes % item:
          raise WireError(f"epoch {self.epoch.number}: host {hosts[i]} sent a chunk of "
                          f"{payload.nbytes} bytes at offset {offset} for {what}: not whole "
                          f"{flat.dtype} entries")
        part = np.frombuffer(payload, flat.dtype)
        at = slice(offset // item, offset // item + part.size)
        seg = total[at]
        if i == 0:
          seg[:] = part
        elif i == 1 and me == 0:  # x_0 + x_1 straight from the frame: x_0 is not copied
          np.add(own[at], part, out=seg)
        else:
          np.add(seg, part, out=seg)
    for i in range(n):
      if i != me:
        self.links.send(hosts[i], frames.GATHER, as_bytes(total), chunk)
    for i in range(n):
      if i != me:
        self.links.recv_into(hosts[i], frames.GATHER, as_bytes(out[span[i]]), "a sum (all-gather)")
    return out.reshape(x.shape)

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[hosts, *x.shape]: every member's `x`, in host order."""
    return self._run("an all-gather", self._allgather, np.ascontiguousarray(x))

  def _allgather(self, x: np.ndarray) -> np.ndarray:
    out = np.empty((self.num_hosts, *x.shape), x.dtype)
    out[self.host_index] = x
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self.links.send(h, frames.GATHER, as_bytes(x))
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self.links.recv_into(h, frames.GATHER, as_bytes(out[i]), "an all-gather")
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
        self.links.send(h, frames.ALL_TO_ALL, as_bytes(x[i]))
    for i, h in enumerate(self.epoch.hosts):
      if i != self.host_index:
        self.links.recv_into(h, frames.ALL_TO_ALL, as_bytes(out[i]), "an all-to-all")
    return out

  def send(self, dst: int, data) -> None:
    """Sends `data` (bytes-like) to member `dst`, which takes it with `recv(this host)`."""
    self.epoch.rank(dst)
    if dst == self.host:
      raise WireError(f"send: host {dst} is this host")
    self._run(f"a send to host {dst}", self.links.send, dst, frames.POINT,
              memoryview(data).cast("B"))

  def recv(self, src: int) -> bytearray:
    """What member `src` sent with `send(this host, ...)`."""
    self.epoch.rank(src)
    if src == self.host:
      raise WireError(f"recv: host {src} is this host")
    return self._run(f"a receive from host {src}", lambda: self.links.recv_into(
        src, frames.POINT, None, f"a transfer from host {src}").obj)

  # -- collective.HostCollective's interface ---------------------------------------------

  def connect(self, quiet: bool = True) -> None:
    """Waits until every member is there (a one-byte all-gather, not counted)."""
    del quiet
    sent, framed = self.links.bytes_sent, self.links.frame_bytes
    self.allgather(np.zeros(1, np.uint8))
    self.links.bytes_sent, self.links.frame_bytes = sent, framed

  def sum(self, tree: Any) -> Any:
    """Σ over members of each leaf (one sum per dtype); every member gets the same bytes."""
    from diloco_jax.wire import collective  # pylint: disable=import-outside-toplevel
    # pylint: disable=protected-access
    flat, layout = collective._pack(tree)
    return collective._unpack({dt: self.allreduce_sum(b) for dt, b in flat.items()}, layout)

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
