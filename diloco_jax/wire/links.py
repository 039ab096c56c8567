"""One epoch's sockets and messages, seen from one member: the PULL socket it listens on,
a PUSH socket to each peer, the HELLO handshake, chunked zero-copy sends, the checks and
the deadlines of every receive (the design: `wire/peers.py`'s docstring). `peers.Peers`
builds the collectives on these messages.

Threads. A reader thread owns the PULL socket: it takes each frame as it arrives, checks it
(`frames.check`, the MAC included) in arrival order and files it in its sender's inbox. So a
peer's chunks are verified while this host is still sealing its own (the collectives' thread
owns the PUSH sockets): on a keyed wire the two hashes, the dominant cost, overlap instead of
taking turns. hashlib releases the GIL for large buffers, so the two run in parallel.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
from typing import Callable

import numpy as np
import zmq

from diloco_jax.runtime import hostmem
from diloco_jax.wire import departed
from diloco_jax.wire import frames
from diloco_jax.wire import sealed
from diloco_jax.wire.droplog import DropLog
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.epoch import connection_key
from diloco_jax.wire.epoch import endpoint
from diloco_jax.wire.epoch import epoch_key

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CHUNK = 1 << 20
HELLO_EVERY_S = 0.05
INTERRUPT_EVERY_S = 0.1  # how often a wait asks `interrupt` whether to give up
RECEIVE_QUEUE = 64  # whole messages zmq holds for the reader, each at most a chunk and a header
BIND_RETRY_S = 5.0  # the last epoch's listener on the same port may still be closing


def _warn(line: str) -> None:
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.warning("%s", line)


def as_bytes(a: np.ndarray) -> memoryview:
  """A C-contiguous array's bytes, without a copy."""
  return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class Links:
  """One epoch's connections, seen from member `host`.

  `interrupt(peer, unreachable_s)`, if given, is asked at least every `INTERRUPT_EVERY_S`
  while waiting for `peer` (`unreachable_s`: wire/departed.py's, after `liveness_s` of PINGs
  unanswered); a reason ends the wait with `PeerError` naming that peer (a membership layer
  that already knows a member is gone, or frozen, need not wait out `timeout_s`).

  Deadlines follow progress: a receive fails after `timeout_s` without a frame from the
  peer, not after `timeout_s` in all (a transfer of many GB takes as long as its bytes
  keep coming), and a send after `timeout_s` in which zmq took none of its chunks.
  `patience(peer)`, if given, is asked when a peer has been silent for `timeout_s`: a
  reason (a string: the peer is alive and has not reached this op yet, a slower host or
  one still compiling) waits another `timeout_s`, said in one line each time; None fails.
  """

  def __init__(self, epoch: Epoch, host: int, *, token=None,
               timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK,
               context: zmq.Context | None = None, log: Callable[[str], None] = _warn,
               interrupt: Callable[[int, float | None], str | None] | None = None,
               patience: Callable[[int], str | None] | None = None,
               liveness_s: float = departed.LIVENESS_S):
    if not 0 < chunk_bytes <= frames.MAX_CHUNK:
      raise WireError(f"chunk_bytes={chunk_bytes}: must be in 1..{frames.MAX_CHUNK}")
    if not timeout_s > 0:
      raise WireError(f"timeout_s={timeout_s}: must be > 0")
    self.epoch, self.host = epoch.check(), host
    self.host_index = epoch.rank(host)
    self.num_hosts = epoch.size
    self.timeout_s, self.chunk_bytes, self._log = float(timeout_s), chunk_bytes, log
    self._interrupt, self._asked, self._patience = interrupt, 0.0, patience
    self._key = epoch_key(token, epoch)
    self._members = set(epoch.hosts)
    self._seq_out: dict[int, int] = collections.defaultdict(int)
    self._seq_in: dict[int, int] = {}
    self._inbox: dict[int, collections.deque] = {h: collections.deque() for h in epoch.hosts}
    self._arrived = threading.Condition()  # the reader files a frame or a HELLO
    self._trackers: list[tuple[int, zmq.MessageTracker]] = []
    self.broken: WireError | None = None
    self._reader_failed: BaseException | None = None
    self.ready = epoch.size == 1
    self._heard: set[int] = set()  # peers whose HELLO arrived
    self._answered: set[int] = set()  # peers that said they heard ours
    self._drops = DropLog(log, f"wire: epoch {epoch.number}, host {host}")
    self.bytes_sent = 0  # payload bytes this host put on the wire in this epoch
    self.frame_bytes = 0  # the same with headers and MACs
    ctx = context or zmq.Context.instance()
    linger = int(self.timeout_s * 1000)  # close() returns at once; queued frames still go
    self._pull = ctx.socket(zmq.PULL)
    # Whole messages queued in zmq before the reader takes them (then zmq stops reading the
    # connections, and TCP slows the senders): at most RECEIVE_QUEUE chunks
    self._pull.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
    self._pull.setsockopt(zmq.MAXMSGSIZE, frames.MAX_CHUNK + 1024)  # a bigger frame: cut
    self._pull.setsockopt(zmq.LINGER, 0)
    # with a token, only its holders finish a handshake (an unfinished message of anyone
    # else's would otherwise be held without bound: wire/sealed.py)
    sealing = connection_key(token)
    sealed.listen(self._pull, sealing)
    self._handshakes = sealed.Handshakes(self._pull)
    self._bind(endpoint(epoch.address(host)))
    self._push: dict[int, zmq.Socket] = {}
    for peer, address in zip(epoch.hosts, epoch.addresses):
      if peer != host:
        s = self._push[peer] = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, linger)
        s.setsockopt(zmq.RECONNECT_IVL, 20)
        sealed.connect(s, sealing)
        s.connect(endpoint(address))
    # one more connection to each peer, for zmq's PINGs alone (wire/departed.py: frozen)
    self._alive = {peer: departed.liveness_socket(ctx, endpoint(address), sealing, liveness_s)
                   for peer, address in zip(epoch.hosts, epoch.addresses) if peer != host}
    self._departures = departed.Departures(self._push, dict(zip(epoch.hosts, epoch.addresses)),
                                           self._answered, self._alive, liveness_s)
    self._wake_r, self._wake_w = os.pipe()  # close() wakes the reader through it
    self._reader = threading.Thread(target=self._read, daemon=True,
                                    name=f"wire epoch {epoch.number} host {host}")
    self._reader.start()

  def _bind(self, where: str) -> None:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
      try:
        self._pull.bind(where)
        return
      except zmq.ZMQError as e:
        if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
          self._handshakes.close()
          self._pull.close(0)
          raise WireError(f"epoch {self.epoch.number}: host {self.host} cannot listen at "
                          f"{where}: {e}") from None
        time.sleep(0.02)

  def halt(self) -> None:
    """Stops reading: this epoch failed, and what arrives now is for the next one (a peer
    that moved on reaches this listener until it closes: `peers.py`'s docstring)."""
    if self._reader.is_alive():
      os.write(self._wake_w, b"x")
      self._reader.join()  # the reader's socket is closed only once it stopped using it

  def close(self) -> None:
    self.halt()
    if self._wake_w >= 0:
      os.close(self._wake_r)
      os.close(self._wake_w)
      self._wake_r = self._wake_w = -1
    for s in [self._pull, *self._push.values(), *self._alive.values()]:
      s.close()
    self.broken = self.broken or WireError(f"epoch {self.epoch.number} is closed")

  def __enter__(self) -> Links:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- sending -------------------------------------------------------------------------

  def send(self, dst: int, kind: int, buf: memoryview, chunk: int | None = None) -> None:
    total, sock, chunk = buf.nbytes, self._push[dst], chunk or self.chunk_bytes
    for offset in range(0, max(total, 1), chunk):
      piece = buf[offset:offset + chunk]
      header = frames.Header(kind, self.epoch.number, self.host, dst, self._seq_out[dst],
                             total, offset)
      self._seq_out[dst] += 1
      parts = frames.seal(header, piece, self._key)
      self._trackers.append((dst, sock.send_multipart(parts, copy=False, track=True)))
      self.bytes_sent += piece.nbytes
      self.frame_bytes += sum(memoryview(p).nbytes for p in parts)

  def _hello(self, dst: int) -> None:
    header = frames.Header(frames.HELLO, self.epoch.number, self.host, dst, 0, 1, 0)
    answer = b"\1" if dst in self._heard else b"\0"
    self._push[dst].send_multipart(frames.seal(header, answer, self._key))

  # -- the reader thread -----------------------------------------------------------------

  def _read(self) -> None:
    """Files every frame that arrives until close() (the reader thread)."""
    try:
      poller = zmq.Poller()
      for sock in [self._pull, self._wake_r, self._handshakes.socket, *self._departures.sockets]:
        poller.register(sock, zmq.POLLIN)
      while True:
        ready = dict(poller.poll())
        if self._wake_r in ready:
          return
        for monitor in self._departures.sockets:
          if monitor in ready:
            self._departures.read(monitor)
        for _ in range(self._handshakes.read()):  # nothing of it was read: no address
          self._drops(None, f"its handshake failed ({sealed.STRANGER})")
        while True:  # all that is queued, then back to the poller
          try:
            msg = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
          except zmq.Again:
            break
          self._accept(msg)
    except BaseException as e:  # noqa: BLE001 -- a waiting caller reports it
      with self._arrived:
        self._reader_failed = e
        self._arrived.notify_all()
    finally:  # nobody reads the monitors from now on (wire/departed.py: `close`)
      self._handshakes.close()
      self._departures.close()

  def _accept(self, msg: list) -> None:
    try:
      header, payload = frames.check([f.buffer for f in msg], key=self._key,
                                     epoch=self.epoch.number, me=self.host,
                                     members=self._members, expected_seq=self._seq_in)
    except frames.Dropped as d:
      if self._moved_on(d.header):
        self._drops.dropped += 1  # counted, without a line: nothing is wrong
        return
      try:
        address = msg[0].get("Peer-Address")
      except zmq.ZMQError:
        address = None
      self._drops(address, str(d), "" if d.sender is None else f" (claims host {d.sender})")
      return
    with self._arrived:
      if header.kind == frames.HELLO:
        self._heard.add(header.sender)
        if bytes(payload) == b"\1":
          self._answered.add(header.sender)
      else:
        self._inbox[header.sender].append((header, payload))
      self._arrived.notify_all()

  @property
  def dropped(self) -> int:
    """Frames refused in this epoch."""
    return self._drops.dropped

  def _moved_on(self, header: frames.Header | None) -> bool:
    """Whether a frame is a HELLO of a later epoch: a peer that opened the next epoch first
    reaches this listener until it closes. Its MAC cannot be checked (that epoch's key comes
    with its nonce, which this host has not heard yet), and need not be: it is dropped
    either way, only without a line (the drop log would say nothing is wrong)."""
    return (header is not None and header.kind == frames.HELLO
            and header.epoch > self.epoch.number)

  # -- waiting ---------------------------------------------------------------------------

  def _wait(self, until: float, host: int, what: str) -> None:
    """Waits (holding `_arrived`) for the reader's next frame, `until` at the latest, and
    asks `interrupt` on the way."""
    if self._reader_failed is not None:
      raise WireError(f"epoch {self.epoch.number}: host {self.host} stopped receiving: "
                      f"{self._reader_failed!r}")
    self._check_interrupt(host, what)
    self._arrived.wait(max(0.0, min(until - time.monotonic(), INTERRUPT_EVERY_S)))

  def _check_interrupt(self, host: int, what: str) -> None:
    if gone := self._departures.gone():  # any peer's: the op cannot complete in this epoch
      raise PeerError(f"epoch {self.epoch.number}: host {gone[0]} is gone ({gone[1]}), seen "
                      f"from host {self.host} during {what}", epoch=self.epoch.number,
                      host=gone[0])
    now = time.monotonic()
    if self._interrupt is None or now - self._asked < INTERRUPT_EVERY_S:
      return
    self._asked = now
    reason = self._interrupt(host, self._departures.unreachable_s(host))
    if reason:
      raise PeerError(f"epoch {self.epoch.number}: interrupted while waiting for host {host} "
                      f"during {what}: {reason} (seen from host {self.host})",
                      epoch=self.epoch.number, host=host)

  def handshake(self) -> None:
    """HELLOs until every peer has heard this host (module docstring)."""
    started = time.monotonic()
    deadline, resend = started + self.timeout_s, 0.0
    with self._arrived:
      while self._answered != set(self._push):
        late = [h for h in self.epoch.hosts if h in self._push and h not in self._answered]
        now = time.monotonic()
        if now >= deadline and self._wait_longer(late[0], "the epoch's start", started):
          deadline = now + self.timeout_s
        if now >= deadline:
          raise PeerError(
              f"epoch {self.epoch.number}: host {late[0]} ({self.epoch.address(late[0])}) did "
              f"not answer for {self.timeout_s:g} s at the epoch's start: it died, is not "
              f"there yet, or holds another join token (seen from host {self.host})",
              epoch=self.epoch.number, host=late[0])
        if now >= resend:
          for dst in self._push:
            self._hello(dst)
          resend = now + HELLO_EVERY_S
        self._wait(min(resend, deadline), late[0], "the epoch's start")
    for dst in self._push:  # the answer each peer may still wait for; it arrives now
      self._hello(dst)
    self.ready = True

  def _next(self, src: int, kind: int, what: str) -> tuple[frames.Header, memoryview]:
    """src's next accepted frame, waiting at most `timeout_s` of silence."""
    inbox, deadline = self._inbox[src], time.monotonic() + self.timeout_s
    started = time.monotonic()
    with self._arrived:
      while not inbox:
        if time.monotonic() >= deadline and self._wait_longer(src, what, started):
          deadline = time.monotonic() + self.timeout_s
        elif time.monotonic() >= deadline:
          raise PeerError(
              f"epoch {self.epoch.number}: host {src} ({self.epoch.address(src)}) sent "
              f"nothing for {self.timeout_s:g} s during {what}: it died, went silent or left "
              f"the epoch (seen from host {self.host})", epoch=self.epoch.number, host=src)
        self._wait(deadline, src, what)
      header, payload = inbox.popleft()
    if header.kind != kind:
      raise WireError(f"epoch {self.epoch.number}: host {src} sent a "
                      f"{frames.KINDS[header.kind]} where host {self.host} expects "
                      f"{frames.KINDS[kind]} ({what}): the members are out of step")
    return header, payload

  def _wait_longer(self, src: int, what: str, since: float) -> bool:
    """Whether a peer silent for `timeout_s` is waited for again (`patience`)."""
    reason = self._patience(src) if self._patience is not None else None
    if reason:
      self._log(f"wire: epoch {self.epoch.number}, host {self.host}: waiting for host {src} "
                f"during {what} ({time.monotonic() - since:.0f} s so far): {reason}")
    return bool(reason)

  def chunks(self, src: int, kind: int, nbytes: int | None, what: str):
    """(offset, payload) of each chunk of one message from `src`, as each arrives; its
    size must be `nbytes` (None: any). The first item is the message's total size."""
    header, payload = self._next(src, kind, what)
    if nbytes is not None and header.total != nbytes:
      raise WireError(f"epoch {self.epoch.number}: host {src} sent {header.total} bytes for "
                      f"{what}, host {self.host} expects {nbytes} (shapes differ)")
    total, got = header.total, 0
    yield total
    while True:
      if header.offset != got or header.total != total or (total and not payload.nbytes):
        # (an honest peer's chunks follow each other, each with bytes, under one total:
        # anything else would hold this host, or overrun what it allocated)
        raise PeerError(f"epoch {self.epoch.number}: host {src}'s {what} chunk of "
                        f"{payload.nbytes} bytes at offset {header.offset} of "
                        f"{header.total}, expected bytes at offset {got} of {total} (seen "
                        f"from host {self.host})", epoch=self.epoch.number, host=src)
      yield got, payload
      got += payload.nbytes
      if got >= total:
        return
      header, payload = self._next(src, kind, what)

  def recv_into(self, src: int, kind: int, out: memoryview | None, what: str) -> memoryview:
    """One message from `src` into `out` (its size must match; None: a new buffer)."""
    chunks = self.chunks(src, kind, None if out is None else out.nbytes, what)
    total = next(chunks)
    if out is None:
      room = hostmem.host_memory_available()
      if total > room:  # a size no honest peer sends: refused before any allocation
        raise PeerError(f"epoch {self.epoch.number}: host {src} announced {total} bytes for "
                        f"{what}, more than the {room} this host has free (seen from host "
                        f"{self.host})", epoch=self.epoch.number, host=src)
      out = memoryview(bytearray(total))
    for offset, payload in chunks:
      out[offset:offset + payload.nbytes] = payload
    return out

  def settle(self, what: str) -> None:
    """Waits until zmq has released every buffer handed to it (the caller's may change)."""
    deadline = started = time.monotonic() + self.timeout_s
    for dst, tracker in self._trackers:
      while not tracker.done:
        left = deadline - time.monotonic()
        if left <= 0 and self._wait_longer(dst, what, started - self.timeout_s):
          deadline, left = time.monotonic() + self.timeout_s, self.timeout_s
        if left <= 0:
          raise PeerError(f"epoch {self.epoch.number}: host {dst} "
                          f"({self.epoch.address(dst)}) took nothing for {self.timeout_s:g} s "
                          f"during {what} (seen from host {self.host})",
                          epoch=self.epoch.number, host=dst)
        self._check_interrupt(dst, what)
        try:
          tracker.wait(min(left, INTERRUPT_EVERY_S))
        except zmq.NotDone:
          pass
      deadline = time.monotonic() + self.timeout_s  # progress: zmq took this chunk
    self._trackers.clear()
