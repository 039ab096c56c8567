"""Which peers of an epoch are gone (their connection closed and their port refuses), and
which are frozen (their zmq threads stopped answering).

Why. A peer whose process ended (killed, crashed, out of memory) was otherwise found out only
when its lease ran out at the coordinator, seconds during which every member waited for it.
Its kernel closes its sockets, so this host's connection to the peer's listener ends, and a
new connection is refused at once. That is evidence a lease cannot give as soon: a host keeps
its epoch's listener open until the coordinator's verdict has ended the epoch, so a port that
refuses means the host died or the epoch is over; either way the op in flight cannot complete
in it, and the peer can be named (`PeerError`).

Only a peer that answered this host's HELLO in this epoch counts (`answered`, the set the
reader fills as answers arrive): its listener of this epoch was up. At an epoch change each
host closes its listener and binds the next one on the same port, so a member that opens the
next epoch first may connect to a peer's old listener, see it close, and find the port
refusing until that peer binds again (a slow one: compiling, its CPU taken); that is no
evidence, and such a peer is waited for as any.

A closed connection alone is not enough (a middlebox may reset one; zmq reconnects), and
neither is a failed reconnect (a network that drops packets fails them too). What decides is a
plain TCP connect to the peer's address that is refused: its machine answered, and nothing
listens there. A machine that vanished answers nothing, and its lease decides, as before.

Frozen. A process that is stopped (SIGSTOP, a machine that hangs) keeps its port and closes
nothing, so it is not gone; its lease at the coordinator runs out, but a process that is only
busy may renew none for seconds too: a Python thread that holds the GIL (a large host copy, a
program loaded) stalls the heartbeat thread beside it. What tells them apart is zmq's own
I/O thread, which runs without the GIL: it answers ZMTP PINGs in a busy process and not in a
stopped one. So each host keeps one more connection to each peer's listener that carries
nothing but PINGs; one not answered for `liveness_s` (a quarter of the lease in a live job)
is closed by zmq, and until a new one completes its handshake the peer is `unreachable_s`.
Not the data connection: under a multi-GB send a PING waits behind the bytes queued before
it, and a data connection zmq closes loses what was in flight. A closed liveness connection
is evidence, not a verdict: the membership layer names a peer only when the coordinator
also says it renewed no lease (membership/lease.py `interrupt`).

The reader thread of `links.Links` polls the monitors (`sockets`, `read`); a short thread per
closed connection makes the connects, so that neither the reader nor a waiting caller blocks
on them; a caller asks `gone()` and `unreachable_s(peer)`.
"""

from __future__ import annotations

import socket
import threading
import time

import zmq
from zmq.utils import monitor

from diloco_jax.runtime import security
from diloco_jax.wire import sealed

REFUSED = 3  # zmq's reconnects failed at once, in a row, before this host connects itself
CONNECT_TIMEOUT_S = 1.0  # a connect not answered in this long decides nothing
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_SUCCEEDED
LIVENESS_S = 1.0  # a PING not answered in this long closes a liveness connection (default)


def liveness_socket(ctx: zmq.Context, where: str, sealing: bytes | None,
                    timeout_s: float = LIVENESS_S) -> zmq.Socket:
  """A connection to a peer's listener at `where` that carries only zmq's PINGs, four in
  `timeout_s`; closed by zmq when none is answered in `timeout_s`."""
  sock = ctx.socket(zmq.PUSH)  # (never sends: the peer's PULL takes it as one more sender)
  timeout_ms = max(4, int(timeout_s * 1000))
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.HEARTBEAT_IVL, timeout_ms // 4)
  sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
  sock.setsockopt(zmq.RECONNECT_IVL, 20)
  # a handshake with a stopped peer would wait zmq's 30 s (its kernel takes the connection)
  sock.setsockopt(zmq.HANDSHAKE_IVL, timeout_ms)
  sealed.connect(sock, sealing)
  sock.connect(where)
  return sock


class Departures:
  """The peers (`push`: peer -> this host's PUSH socket to it; `addresses`: peer ->
  "host:port") whose listener is found gone, and (`alive`: peer -> its liveness socket)
  those whose zmq stopped answering. Call `close` before closing the sockets."""

  def __init__(self, push: dict[int, zmq.Socket], addresses: dict[int, str],
               answered: set[int], alive: dict[int, zmq.Socket] | None = None,
               liveness_s: float = LIVENESS_S):
    self._liveness_s = liveness_s  # the liveness sockets' `timeout_s`
    self._addresses = addresses
    self._answered = answered  # peers whose listener of this epoch heard this host
    self._socks = {**{("push", p): s for p, s in push.items()},
                   **{("alive", p): s for p, s in (alive or {}).items()}}
    self._monitors = {sock.get_monitor_socket(EVENTS): key for key, sock in self._socks.items()}
    self.sockets = list(self._monitors)  # to poll: readable when an event waits
    self._live: set[int] = set()  # peers whose liveness connection is open (handshake done)
    # peer -> from when it counts as unreachable: when its liveness connection closed, or
    # (never open) when first asked about plus the `liveness_s` a handshake may take
    self._unreachable: dict[int, float] = {}
    # peer -> zmq's failed reconnects since its connection closed (absent: connected, or
    # never was: a peer not listening yet at the epoch's start is not gone)
    self._refused: dict[int, int] = {}
    self._gone: dict[int, str] = {}
    self._closed = threading.Event()

  def read(self, sock: zmq.Socket) -> None:
    """Takes the events waiting on one monitor (the reader thread)."""
    kind, peer = self._monitors[sock]
    while sock.poll(0):
      event = monitor.recv_monitor_message(sock)["event"]
      if kind == "alive":
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
          self._live.add(peer)
          self._unreachable.pop(peer, None)
        elif event == zmq.EVENT_DISCONNECTED and peer in self._live:
          self._live.discard(peer)
          if peer in self._answered:  # (else maybe the peer's last epoch's listener closed)
            self._unreachable[peer] = time.monotonic()
      elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        self._refused.pop(peer, None)
      elif event == zmq.EVENT_DISCONNECTED and peer in self._answered:
        self._refused[peer] = 0
      elif event == zmq.EVENT_CLOSED and peer in self._refused:
        # (a reconnect that failed at once: refused, or no route; never a slow network)
        self._refused[peer] += 1
        if self._refused[peer] == REFUSED and peer not in self._gone:
          threading.Thread(target=self._probe, args=(peer,), daemon=True,
                           name=f"wire probe of host {peer}").start()

  def _probe(self, peer: int) -> None:
    """One connect to `peer`'s address: refused, the peer is gone."""
    host, port = security.split_address(self._addresses[peer], "a peer's address")
    try:
      with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
        return  # something listens there (its next epoch's listener, just bound)
    except ConnectionRefusedError:
      pass
    except OSError:
      return  # no answer, or no route: its lease decides
    if not self._closed.is_set() and peer in self._refused:
      self._gone[peer] = (f"its connection closed and {self._addresses[peer]} refuses "
                          "connections: its process ended, or it left the epoch")

  def gone(self) -> tuple[int, str] | None:
    """(peer, why) of the lowest peer found gone; None while none is."""
    if not self._gone:
      return None
    peer = min(self._gone)
    return peer, self._gone[peer]

  def unreachable_s(self, peer: int) -> float | None:
    """Seconds since `peer`'s liveness connection closed with no new one since (its zmq
    stopped answering PINGs: a stopped process, or a network that carries nothing), or
    since a peer that answered in this epoch was first asked about without one (it froze
    before its liveness handshake, less the `liveness_s` a handshake may take);
    None while it is connected, or before it answered in this epoch."""
    if peer in self._live or peer not in self._answered:
      return None
    now = time.monotonic()
    since = self._unreachable.setdefault(peer, now + self._liveness_s)
    return None if now < since else now - since

  def close(self) -> None:
    """Closes the monitors: call it once nobody reads them (the reader stopped). zmq's I/O
    thread blocks on a monitor whose queue is full (a dead peer's reconnects fill one in
    seconds), every socket of the context with it, and disabling it then never returns."""
    self._closed.set()
    for sock in self._socks.values():
      try:
        sock.disable_monitor()
      except zmq.ZMQError:
        pass
    for mon in self._monitors:
      mon.close(linger=0)
