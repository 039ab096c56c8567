"""One epoch's sockets and messages, seen from one member: the PULL socket it listens on,
a PUSH socket to each peer, the HELLO handshake, chunked zero-copy sends, the checks and
the deadlines of every receive (the design: `wire/peers.py`'s docstring). `peers.Peers`
builds the collectives on these messages.
"""

from __future__ import annotations

import collections
import errno
import re
import time
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


def as_bytes(a: np.ndarray) -> memoryview:
  """A C-contiguous array's bytes, without a copy."""
  return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class Links:
  """One epoch's connections, seen from member `host`."""

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

  def __enter__(self) -> Links:
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
