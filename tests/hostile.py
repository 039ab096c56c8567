"""What a stranger who reaches a job's ports sends, for the tests: random bytes, a frame far
over any size limit, and a message whose last part never comes; where a process listens
and how much memory it holds, read from /proc; and two hosts of one epoch on loopback, the
stranger's target in tests/test_hostile.py and tests/test_hostile_wire.py."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import numpy as np

from bench.harness import free_port  # noqa: F401 -- the tests import it from here
from diloco_jax.runtime import security
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.peers import Peers

GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def ready(socket_type: bytes) -> bytes:
  """ZMTP 3's READY command of the NULL mechanism, from a socket of `socket_type`."""
  body = b"\x05READY\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
  return b"\x04" + bytes([len(body)]) + body


def _long_frame(size: int, more: bool) -> bytes:
  return bytes([0x03 if more else 0x02]) + size.to_bytes(8, "big")  # (MORE |) LONG


def unfinished_message(port: int, limit: int = 64 << 20, part: int = 8 << 10,
                       socket_type: bytes = b"PUSH", keep: list | None = None) -> int:
  """Speaks ZMTP 3 without a key (the NULL mechanism, as any zmq socket does) to a listener
  on `port`, as a `socket_type` socket, then sends parts of `part` bytes (under every
  listener's part limit) of one message and never its last; returns the bytes sent before
  the listener ended the connection (`limit`: it never did). zmq drops an unfinished
  message when its connection closes: the connection is left open in `keep`, if given."""
  block = (_long_frame(part, more=True) + bytes(part)) * max(1, (4 << 20) // part)
  sent = 0
  s = socket.create_connection(("127.0.0.1", port), timeout=5)
  try:
    s.sendall(GREETING + ready(socket_type))
    time.sleep(0.05)  # the listener answers the greeting (or ends the connection)
    while sent < limit:
      s.sendall(block)
      sent += len(block)
  except OSError:  # reset, a broken pipe or a timeout: the listener ended or stalled it
    pass
  if keep is None or sent < limit:
    s.close()
  else:
    keep.append(s)
  return sent


def junk(port: int, seed: int, size: int = 64 << 10) -> None:
  """`size` random bytes on a raw TCP connection."""
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    with contextlib.suppress(OSError):
      s.sendall(np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes())


def oversized(port: int) -> None:
  """A greeting, then the header of a 1 GiB single-part message and its first MiB."""
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    with contextlib.suppress(OSError):
      s.sendall(GREETING + ready(b"PUSH") + _long_frame(1 << 30, more=False) + bytes(1 << 20))


def listening_ports(pid: int) -> list[int]:
  """The TCP ports process `pid` listens on (its sockets' inodes in /proc/net/tcp)."""
  inodes = set()
  with contextlib.suppress(OSError):
    for fd in os.listdir(f"/proc/{pid}/fd"):
      with contextlib.suppress(OSError):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if link.startswith("socket:["):
          inodes.add(link[8:-1])
  ports = []
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with contextlib.suppress(OSError), open(table) as f:
      for row in f.read().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
          ports.append(int(fields[1].rsplit(":", 1)[1], 16))
  return sorted(set(ports))


def rss_mib(pid: int) -> float | None:
  with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return None


class Stranger(threading.Thread):
  """Until `stop()`: every `every_s`, to each port `targets()` names (pid -> its ports), junk,
  an oversized frame and an unfinished message (at most `unfinished` bytes each); meanwhile
  the RSS of every pid it has seen, sampled each pass: `peak[pid]`, `first[pid]`."""

  def __init__(self, targets, every_s: float = 0.5, unfinished: int = 128 << 20):
    super().__init__(daemon=True)
    self._targets, self._every_s, self._unfinished = targets, every_s, unfinished
    self._done = threading.Event()
    self._open: list[socket.socket] = []  # connections whose messages never end
    self.sent = {"junk": 0, "oversized": 0, "unfinished": 0}
    self.peak: dict[int, float] = {}
    self.ports: dict[int, set[int]] = {}  # every port it sent to, by pid
    self.first: dict[int, float] = {}

  def run(self) -> None:
    seed = 0
    while not self._done.is_set():
      for pid, ports in self._targets().items():
        rss = rss_mib(pid)
        if rss is not None:
          self.first.setdefault(pid, rss)
          self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
        self.ports.setdefault(pid, set()).update(ports)
        for port in ports:
          for kind, send in (
              ("junk", lambda p: junk(p, seed)), ("oversized", oversized),
              # as the peer of a wire's PULL and of a coordinator's ROUTER (the other type
              # is refused at the greeting), each connection left open, its parts held
              ("unfinished", lambda p: [unfinished_message(p, self._unfinished, socket_type=t,
                                                           keep=self._open)
                                        for t in (b"PUSH", b"DEALER")])):
            try:
              send(port)
              self.sent[kind] += 1
            except OSError:  # a listener between epochs, or a coordinator being restarted
              pass
        seed += 1
      self._done.wait(self._every_s)

  def stop(self) -> None:
    self._done.set()
    self.join(30)
    for s in self._open:
      s.close()


TOKEN = security.JoinToken("a-join-token-for-the-tests", "the test")


@contextlib.contextmanager
def connected_pair(**host0_options):
  """Hosts 0 and 1 of one epoch on loopback, their connections open (host 0's Peers takes
  `host0_options`); yields (epoch, host 0's Peers, host 1's)."""
  epoch = Epoch.of(1, (0, 1), tuple(f"127.0.0.1:{free_port()}" for _ in range(2)))
  p0 = Peers(epoch, 0, token=TOKEN, **{"timeout_s": 5, **host0_options})
  p1 = Peers(epoch, 1, token=TOKEN, timeout_s=5)
  try:
    threads = [threading.Thread(target=p.connect) for p in (p0, p1)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(10)
    yield epoch, p0, p1
  finally:
    p0.close()
    p1.close()
