"""Which peers of an epoch are gone: their connection closed and their port refuses.

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

The reader thread of `links.Links` polls the monitors (`sockets`, `read`); a short thread per
closed connection makes the connects, so that neither the reader nor a waiting caller blocks
on them; a caller asks `gone()`.
"""

from __future__ import annotations

import socket
import threading

import zmq
from zmq.utils import monitor

from diloco_jax.runtime import security

REFUSED = 3  # zmq's reconnects failed at once, in a row, before this host connects itself
CONNECT_TIMEOUT_S = 1.0  # a connect not answered in this long decides nothing
EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class Departures:
  """The peers (`push`: peer -> this host's PUSH socket to it; `addresses`: peer ->
  "host:port") whose listener is found gone. Call `close` before closing the sockets."""

  def __init__(self, push: dict[int, zmq.Socket], addresses: dict[int, str],
               answered: set[int]):
    self._addresses = addresses
    self._answered = answered  # peers whose listener of this epoch heard this host
    self._socks = dict(push)
    self._monitors = {sock.get_monitor_socket(EVENTS): peer for peer, sock in push.items()}
    self.sockets = list(self._monitors)  # to poll: readable when an event waits
    # peer -> zmq's failed reconnects since its connection closed (absent: connected, or
    # never was: a peer not listening yet at the epoch's start is not gone)
    self._refused: dict[int, int] = {}
    self._gone: dict[int, str] = {}
    self._closed = threading.Event()

  def read(self, sock: zmq.Socket) -> None:
    """Takes the events waiting on one monitor (the reader thread)."""
    peer = self._monitors[sock]
    while sock.poll(0):
      event = monitor.recv_monitor_message(sock)["event"]
      if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
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

  def close(self) -> None:
    self._closed.set()
    for sock in self._socks.values():
      try:
        sock.disable_monitor()
      except zmq.ZMQError:
        pass
    for mon in self._monitors:
      mon.close(linger=0)
