"""Connections only token holders can open: CurveZMQ with keys derived from the join token.

Why. zmq holds every part of a multipart message until its last part arrives, and counts only
whole messages against RCVHWM; MAXMSGSIZE bounds one part, not how many. So a sender that
never sends a message's last part makes the receiver hold memory without bound, and nothing
the application reads can stop it: the parts never reach it. What stops it is a handshake
that a process without the token cannot finish. zmq's CURVE mechanism gives that handshake:
the listener's key pair is derived here from a key only token holders can compute (the
coordinator's, or one epoch's wire key), a connecting socket must know the listener's public
key to build its first handshake command, and zmq reads no message from a connection before
its handshake succeeded. Each connecting socket makes its own key pair; it is not checked
(only the listener's pair is secret). Every message is then also encrypted: on loopback,
where a 2-core machine runs both ends, a keyed 40 MB sum costs each host about 1.4x the
CPU it did with the MAC alone; through links of tens of Mbit/s nothing measurable
(`bench/wire.py`, docs/performance.md).

Without a token (loopback, or `--insecure`) nothing is sealed: any process that reaches a
port can then make its owner hold an unfinished message (docs/security.md).

A failed handshake is never a message: the listener learns of it from zmq's socket monitor
(`Handshakes`), which names neither the peer nor a claimed host, only that one failed.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
from zmq.utils import monitor
from zmq.utils import z85

STRANGER = "another join token, or none where the job has one, or not a diloco_jax process"
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _listener_pair(key: bytes) -> tuple[bytes, bytes]:
  """(public, secret), z85-encoded, of the listener keyed by `key`."""
  secret = z85.encode(hmac.new(key, b"diloco_jax curve listener", hashlib.sha256).digest())
  return zmq.curve_public(secret), secret


def listen(sock: zmq.Socket, key: bytes | None) -> None:
  """Makes `sock` (before it binds) accept only connections that know `key` (None: all)."""
  if key is None:
    return
  public, secret = _listener_pair(key)
  sock.curve_server = True
  sock.curve_publickey, sock.curve_secretkey = public, secret


def connect(sock: zmq.Socket, key: bytes | None) -> None:
  """Makes `sock` (before it connects) open connections to a listener keyed by `key`."""
  if key is None:
    return
  public, secret = zmq.curve_keypair()
  sock.curve_serverkey = _listener_pair(key)[0]
  sock.curve_publickey, sock.curve_secretkey = public, secret


class Handshakes:
  """Counts the failed and the successful handshakes of `sock`'s connections (a monitor
  socket; call `close` before closing `sock`). `refused`: failed with the peer's word
  (another mechanism, a key it could not read) or, without one, failed again and again (a
  peer that died in the middle of a handshake fails one), and none succeeded."""

  def __init__(self, sock: zmq.Socket):
    self._monitor = sock.get_monitor_socket(FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    self.socket = self._monitor  # to poll: readable when an event waits
    self._sock = sock
    self.failed = self.said = self.succeeded = 0

  def read(self) -> int:
    """Takes the events waiting; returns how many handshakes failed among them."""
    failed = 0
    while self._monitor.poll(0):
      event = monitor.recv_monitor_message(self._monitor)["event"]
      if event & FAILED:
        failed += 1
        self.said += event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
      elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        self.succeeded += 1
    self.failed += failed
    return failed

  @property
  def refused(self) -> bool:
    return not self.succeeded and (self.said > 0 or self.failed >= 3)

  def close(self) -> None:
    try:
      self._sock.disable_monitor()
    except zmq.ZMQError:
      pass
    self._monitor.close(linger=0)
