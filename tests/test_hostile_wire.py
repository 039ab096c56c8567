"""What a member that misbehaves can send on the wire, and what a member's lease meets: each
test is one finding of a review of the live path (lines without bound, sizes no host can
hold, errors outside the redo path, a silent peer, chunks without end) and the rule that
answers it. Fast and in-process: the wire's Links on loopback, leases without a
coordinator. The coordinator's port: tests/test_hostile.py."""

from __future__ import annotations

import threading
import time

import pytest

from diloco_jax.membership import client as client_lib
from diloco_jax.membership import collective as collective_lib
from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import protocol
from diloco_jax.wire import droplog
from diloco_jax.wire import frames
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import Member
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.epoch import epoch_key
from tests.hostile import TOKEN
from tests.hostile import connected_pair


def test_drop_lines_are_bounded_by_address_whatever_the_frames_claim():
  """2,000 frames claiming 2,000 host ids from one address: one line, the rest counted and
  said a minute later. (7bb7343: a line and a set entry per claimed sender, never pruned.)"""
  lines, now = [], [0.0]
  drops = droplog.DropLog(lines.append, "wire", clock=lambda: now[0])
  for h in range(2000):
    drops("10.0.0.9:5000", "bad MAC (another join token, or altered)", f" (claims host {h})")
  assert len(lines) == 1 and drops.dropped == 2000
  now[0] = 61.0
  drops("10.0.0.9:6000", "bad MAC (another join token, or altered)")
  assert len(lines) == 2 and "dropped 2000 more frame(s) from 10.0.0.9" in lines[1], lines
  for i in range(5000):  # as many addresses as there are: bounded lines and memory
    drops(f"10.1.{i // 256}.{i % 256}:1", "bad MAC")
  assert len(drops._seen) <= droplog.MAX_KEYS  # pylint: disable=protected-access
  assert len(lines) <= 2 + droplog.MAX_KEYS + 1, len(lines)


def test_a_size_no_host_can_hold_is_a_peer_error_not_a_memory_error():
  """A member announcing 2**62 bytes for a message: refused before any allocation, naming
  it. (7bb7343: MemoryError, outside the redo path.)"""
  with connected_pair() as (epoch, p0, p1):
    header = frames.Header(frames.POINT, 1, 1, 0, p1.links._seq_out[0], 1 << 62, 0)  # pylint: disable=protected-access
    p1.links._push[0].send_multipart(frames.seal(header, b"x", epoch_key(TOKEN, epoch)))  # pylint: disable=protected-access
    with pytest.raises(PeerError, match="announced 4611686018427387904 bytes") as e:
      p0.recv(1)
    assert e.value.host == 1


class FailingLease:
  """A lease whose coordinator redoes every op in the same epoch."""
  num_hosts, host = 2, 0

  def __init__(self):
    self.epoch = Epoch(1, (Member(0, "i", "127.0.0.1:1"), Member(1, "j", "127.0.0.1:2")))
    self.votes = []

  def commit(self, epoch, step, ok, suspect, boundary=False):
    self.votes.append((ok, suspect))
    return client_lib.Verdict(False, self.epoch)

  def interrupt(self, members, peer=None, unreachable_s=None):
    return None


def test_any_error_inside_an_op_is_a_vote_and_repeated_it_ends_in_one_line():
  """A peer's bytes that make this host raise anything (here a ValueError) are a not-ok
  vote, not a crash; the same op failing again and again ends this host's run with one
  line instead of a redo without end. (7bb7343: only PeerError and WireError were votes.)"""
  lease = FailingLease()
  collective = collective_lib.EpochCollective(lease)
  collective._open = lambda: type("NoPeers", (), {"bytes_sent": 0})()  # pylint: disable=protected-access

  def op(peers):
    raise ValueError("a count the peer sent cannot be read")

  with pytest.raises(WireError, match=r"failed 16 times in a row on this host; the last "
                                      r"time: ValueError: a count the peer sent"):
    collective.atomic("the sum", op)
  # it names itself from its third failure on (nobody else to blame); the last failure is
  # not voted on: this host leaves, and the others redo without it
  blame = collective_lib.SELF_BLAME
  assert lease.votes == ([(False, None)] * (blame - 1)
                         + [(False, 0)] * (collective_lib.MAX_TRIES - blame))


def test_a_malformed_answer_is_one_error_and_the_lease_thread_says_why_it_stopped():
  """An answer whose epoch is not an object: one CoordinatorError naming it; whatever the
  heartbeat thread meets, it records why it stopped. (7bb7343: a TypeError ended the
  thread silently, and the host's lease ran out.)"""
  with pytest.raises(WireError, match="'members' is"):
    Epoch.from_json({"number": 1, "members": "not a list", "boot": ""})
  lease = lease_lib.Lease.__new__(lease_lib.Lease)
  lease.host, lease.lease_s, lease.lost = 3, 0.01, None
  lease._stop = threading.Event()  # pylint: disable=protected-access

  def broken():
    raise TypeError("'int' object is not subscriptable")

  lease._heartbeat = broken  # pylint: disable=protected-access
  lease._renew()  # pylint: disable=protected-access
  assert lease.lost == ("host 3: its lease's heartbeat failed: TypeError: 'int' object is not "
                        "subscriptable")


def test_a_silent_peer_that_is_behind_is_waited_for_and_one_in_the_op_is_not():
  """A peer silent for the wire's timeout: waited for again, in one line each time, while
  its lease says it has not reached the op (a slower host, one compiling); named once it
  says it is in the op. (7bb7343: a host 60 s behind its peers was evicted, as was the
  source of a transfer longer than 60 s.)"""
  lines, behind = [], [True]
  with connected_pair(timeout_s=0.5, log=lines.append,
                      patience=lambda peer: "it is training" if behind[0] else None) as (
                          _, p0, p1):
    late = threading.Timer(1.6, lambda: p1.send(0, b"late but alive"))
    late.start()
    assert bytes(p0.recv(1)) == b"late but alive"  # over 3 timeouts of silence
    late.join()
    waits = [line for line in lines if "waiting for host 1" in line]
    assert len(waits) >= 2 and "it is training" in waits[0], lines
    behind[0] = False  # now it says it is in the op: its silence is a failure
    with pytest.raises(PeerError, match="sent nothing for 0.5 s"):
      p0.recv(1)


def test_a_lease_is_patient_with_a_peer_behind_and_not_with_one_in_the_op():
  lease = lease_lib.Lease.__new__(lease_lib.Lease)
  lease.lost, lease.away_since = None, None
  lease.epoch = Epoch(3, (Member(0, "i", "a:1"), Member(1, "j", "b:1")))
  lease.client = type("C", (), {"positions": {1: (7, False)}})()
  assert "has not reached this op" in lease.patience(1, 7)  # between ops: training
  assert "has not reached this op" in lease.patience(1, 8)  # an op behind
  lease.client.positions = {1: (7, True)}
  assert lease.patience(1, 7) is None  # in the op, and silent: a failure
  assert lease.patience(2, 7) is None  # not a member
  lease.away_since = 1.0
  assert "coordinator is away" in lease.patience(1, 7)


def test_empty_or_inconsistent_chunks_are_a_peer_error_not_a_wait():
  """A member that sends empty chunks (or changes a message's total) mid-message: named at
  once. (7bb7343: each empty chunk reset the wait, holding an honest peer in a sum for as
  long as they came.)"""
  with connected_pair() as (epoch, p0, p1):
    key = epoch_key(TOKEN, epoch)
    for second in ((10, 4, b""), (99, 4, b"efgh")):  # an empty chunk; another total
      seq = p1.links._seq_out  # pylint: disable=protected-access
      for total, offset, payload in ((10, 0, b"abcd"), second):
        header = frames.Header(frames.POINT, 1, 1, 0, seq[0], total, offset)
        seq[0] += 1
        p1.links._push[0].send_multipart(frames.seal(header, payload, key))  # pylint: disable=protected-access
      with pytest.raises(PeerError, match=r"chunk of \d+ bytes at offset 4 of \d+, expected "
                                          r"bytes at offset 4 of 10") as e:
        p0.links.recv_into(1, frames.POINT, None, "a transfer")
      assert e.value.host == 1


def test_a_leaver_closes_the_wire_only_once_the_op_in_flight_has_ended():
  """A host that leaves with a sum in flight on its dispatch thread (an async mode's SIGTERM):
  it tells the coordinator first, its lease then interrupts the op at the op's next check,
  and the wire's sockets are closed only once the dispatch thread stopped, else left to the
  process's exit. (7bb7343: the sockets were closed first, under the thread still using
  them; zmq sockets are not thread safe.)"""
  order = []

  class Client:
    timeout_s = 1.0

    def leave(self):
      order.append("left")

    def close(self):
      order.append("client closed")

  class FakePeers:
    def close(self):
      order.append("wire closed")

  lease = lease_lib.Lease.__new__(lease_lib.Lease)
  lease.client, lease.host, lease.lost, lease._thread = Client(), 1, None, None
  lease._stop = threading.Event()
  lease.epoch = Epoch.of(3, (0, 1), ("127.0.0.1:1", "127.0.0.1:2"))
  assert lease.interrupt((0, 1)) is None
  wire = collective_lib.EpochCollective.__new__(collective_lib.EpochCollective)
  wire.lease, wire._peers = lease, FakePeers()

  def busy(timeout_s):  # the dispatch thread did not stop within the time given
    order.append(f"drained {timeout_s:g} s?")
    assert lease.interrupt((0, 1)) == "host 1 left the job"  # its op ends at its next check
    return False

  wire.close(True, busy)
  assert order == ["left", "client closed", f"drained {collective_lib.DRAIN_S:g} s?"], order
  order.clear()
  wire._peers = FakePeers()
  wire.close(True, lambda timeout_s: True)
  assert order == ["client closed", "wire closed"], order  # (left once: it is out already)


def test_a_frozen_peer_is_one_whose_zmq_and_lease_are_both_silent():
  """A member waiting on a peer gives up on it when both say it is frozen: its zmq stopped
  answering (`unreachable_s`, wire/departed.py) and the coordinator's last word says it
  renewed nothing for half a lease (every member names it, and it leaves at once instead of
  at its lease's end). Not a peer whose zmq answers (busy: its heartbeat thread stalled
  behind the GIL, as a joiner's was while it took the state), nor one heard lately, nor
  while the member's own word is older than half a lease (the coordinator away: no
  evidence); and an answer's `quiet` that is not [host, ms] pairs is refused."""
  client = client_lib.Client.__new__(client_lib.Client)
  lease = lease_lib.Lease.__new__(lease_lib.Lease)
  lease.client, lease.host, lease.lost, lease.lease_s = client, 0, None, 4.0
  lease.epoch = Epoch.of(3, (0, 1, 2), ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
  client.quiet, client.heard_at = client_lib._quiet([[1, 2500], [2, 300]]), time.monotonic()
  assert lease.interrupt((0, 1, 2), 1, 1.5) == (
      "host 1 is frozen or cut off: it has renewed no lease for 2.5 s and its wire has not "
      "answered for 1.5 s")
  assert lease.interrupt((0, 1, 2), 1, None) is None  # busy: its zmq answers
  assert lease.interrupt((0, 1, 2), 2, 1.5) is None and lease.interrupt((0, 1, 2)) is None
  client.heard_at -= 2.5  # this host's own word is stale
  assert lease.interrupt((0, 1, 2), 1, 1.5) is None
  for bad in ([[1, -5]], [[1]], {"1": 5}, [[1, 2.5]], [[True, 5]]):
    with pytest.raises(protocol.Malformed):
      client_lib._quiet(bad)


def test_once_its_reader_stops_a_wire_leaves_no_monitor_to_fill():
  """zmq's I/O thread blocks on a socket monitor whose queue is full, and with it every
  socket of the context; disabling that monitor then never returns (a dead peer's
  reconnects fill one in seconds, and a failed epoch's wire may wait out the coordinator's
  grace for its verdict). So the reader, which alone reads them, closes them as it stops."""
  with connected_pair() as (_, p0, p1):
    p1.close()  # a dead peer: host 0's connections to it refuse, 50 times a second
    links = p0.links
    monitors = [links._handshakes.socket, *links._departures.sockets]
    assert len(monitors) == 3 and not any(m.closed for m in monitors)
    links.halt()
    assert all(m.closed for m in monitors)
