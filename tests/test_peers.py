"""The epoch wire (wire/peers.py): sums, gathers and transfers among an epoch's members over
zmq on localhost, every frame authenticated with a key from the join token.

Members run as threads of this process (each with its own sockets, as a host would have);
the killed peer is a process. Exact invariants: the same bits on every member, equal to
numpy's sum in the epoch's host order; bytes sent equal to the planner's ring formula; one
log line per dropped frame, and the sum unchanged by it.
"""

import functools
import re
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import zmq

from bench.harness import free_ports
from diloco_jax.algo import compress
from diloco_jax.runtime.security import JoinToken
from diloco_jax.wire import collective
from diloco_jax.wire import frames
from diloco_jax.wire import sealed
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.epoch import connection_key
from diloco_jax.wire.epoch import epoch_key
from diloco_jax.wire.peers import Peers
from diloco_jax.wire.peers import Wire

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = JoinToken("a-join-token-for-the-tests", "test")
OTHER = JoinToken("another-token-entirely-here", "test")


def make_epoch(hosts, number=1) -> Epoch:
  return Epoch.of(number, tuple(hosts), tuple(f"127.0.0.1:{p}" for p in free_ports(len(hosts))))


def run_all(fns, timeout=20.0) -> list:
  """Runs each fn in its own thread; returns their results (an exception is a result)."""
  out = [None] * len(fns)

  def call(i):
    try:
      out[i] = fns[i]()
    except BaseException as e:  # noqa: BLE001 -- the test inspects it
      out[i] = e

  threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout)
  assert not any(t.is_alive() for t in threads), "a member hung"
  return out


def deltas(host: int, size: int) -> np.ndarray:
  rng = np.random.default_rng(host)  # magnitudes that differ by entry: rounding shows order
  return (rng.standard_normal(size) * np.exp(rng.uniform(-8, 8, size))).astype(np.float32)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_sum_is_the_same_bits_on_every_member_in_host_order(n):
  hosts = [7, 2, 5, 0, 3][:n]  # the epoch's order, not the ids', is the reduction order
  epoch, size = make_epoch(hosts), 2 * 3 * 5 * 7 * 1000  # whole chunks for every n
  xs = {h: deltas(h, size) for h in hosts}

  def member(h):
    with Peers(epoch, h, token=TOKEN, timeout_s=10, chunk_bytes=64 << 10) as p:
      return p.allreduce_sum(xs[h].reshape(210, -1)), p.bytes_sent

  results = run_all([functools.partial(member, h) for h in hosts])
  want = functools.reduce(np.add, [xs[h] for h in hosts]).reshape(210, -1)
  for got, sent in results:
    assert got.tobytes() == want.tobytes()
    assert sent == 2 * (n - 1) * 4 * size // n  # planning/model.py: a float32 ring
  if n >= 3:  # the order is real: another order rounds differently somewhere
    other = functools.reduce(np.add, [xs[h] for h in reversed(hosts)]).reshape(210, -1)
    assert other.tobytes() != want.tobytes()


def test_allgather_all_to_all_and_point_to_point():
  epoch = make_epoch([0, 1, 2])
  state = os.urandom(3 << 20)  # several chunks

  def member(h):
    with Peers(epoch, h, token=TOKEN, timeout_s=10) as p:
      gathered = p.allgather(np.array([h, 10 * h], np.uint32))
      exchanged = p.all_to_all(np.arange(6, dtype=np.int16).reshape(3, 2) + 100 * h)
      empty = p.allgather(np.zeros((0, 4), np.float32))
      received = None
      if h == 0:
        p.send(2, state)
      if h == 2:
        received = bytes(p.recv(0))
      return gathered, exchanged, empty, received

  results = run_all([functools.partial(member, h) for h in range(3)])
  for h, (gathered, exchanged, empty, received) in enumerate(results):
    np.testing.assert_array_equal(gathered, [[0, 0], [1, 10], [2, 20]])
    np.testing.assert_array_equal(exchanged, [[2 * h, 2 * h + 1], [100 + 2 * h, 101 + 2 * h],
                                              [200 + 2 * h, 201 + 2 * h]])
    assert empty.shape == (3, 0, 4)
    assert received == (state if h == 2 else None)


def test_reduce_encoded_over_the_wire_is_the_protocols_result():
  """collective.reduce_encoded with this wire's all_to_all and allgather: int8 (reduced
  chunk by chunk on the way) and chunk_topk (all-gathered), restated in numpy; with one
  member, LocalCollective's result."""
  n, size = 3, 1000
  epoch = make_epoch(range(n))
  xs = [np.random.default_rng(10 + h).normal(size=size).astype(np.float32) for h in range(n)]
  topk = dict(topk_fraction=0.05, topk_chunk=256, value_bits=2)

  def member(h):
    with Peers(epoch, h, token=TOKEN, timeout_s=10) as p:
      return p.reduce_encoded(xs[h][None], "int8"), p.reduce_encoded(xs[h][None],
                                                                     "chunk_topk", **topk)

  results = run_all([functools.partial(member, h) for h in range(n)])
  chunk = 512  # ceil(1000 / 3) = 334, rounded up to whole 256-entry blocks
  padded = [np.pad(x, (0, n * chunk - size)).reshape(n, chunk) for x in xs]
  rt = lambda v: compress.decode(compress.encode(v, "int8"))
  int8 = np.concatenate([rt(collective.sum_rows(np.stack([rt(p[i]) for p in padded])))
                         for i in range(n)])[:size]
  rt_topk = lambda v: compress.decode(compress.encode(v, "chunk_topk", **topk), **topk)
  sparse = collective.sum_rows(np.stack([rt_topk(x) for x in xs]))
  for h, ((got8, carried8), (got_topk, carried_topk)) in enumerate(results):
    np.testing.assert_array_equal(got8, int8)
    np.testing.assert_array_equal(carried8[0], rt(padded[h].ravel())[:size])
    np.testing.assert_array_equal(got_topk, sparse)
    np.testing.assert_array_equal(carried_topk[0], rt_topk(xs[h]))
  with Peers(make_epoch([4]), 4, token=TOKEN) as alone:
    for fmt, options in (("int8", {}), ("chunk_topk", topk)):
      want = collective.LocalCollective().reduce_encoded(xs[0][None], fmt, **options)
      got = alone.reduce_encoded(xs[0][None], fmt, **options)
      for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_next_epoch_closes_the_last_and_only_grows():
  first = make_epoch([0, 1, 2])
  second = first.without(2)  # the same addresses: each survivor listens again on its port
  assert (second.number, second.hosts) == (2, (0, 1))

  def member(h):
    wire = Wire(h, token=TOKEN, timeout_s=10)
    a = wire.open(first).allreduce_sum(np.full(4, h + 1, np.float32))
    if h == 2:
      wire.close()
      return a, None
    old = wire.peers
    b = wire.open(second).allreduce_sum(np.full(4, h + 1, np.float32))
    with pytest.raises(WireError, match="epoch 1 is unusable"):
      old.allgather(np.zeros(1))
    with pytest.raises(WireError, match="epoch numbers only grow"):
      wire.open(first)
    wire.close()
    return a, b

  results = run_all([functools.partial(member, h) for h in range(3)])
  for h, (a, b) in enumerate(results):
    np.testing.assert_array_equal(a, np.full(4, 6, np.float32))
    if h < 2:
      np.testing.assert_array_equal(b, np.full(4, 3, np.float32))


def test_a_host_with_another_token_cannot_join_a_sum():
  """Host 2 of three holds another token: its connections to hosts 0 and 1 fail their
  handshakes (the wire's CURVE key is the token's; one line each, however often it tries),
  they name it within the timeout; without it, they sum right."""
  epoch, timeout = make_epoch([0, 1, 2]), 1.5
  lines = {0: [], 1: []}

  def member(h):
    wire = Wire(h, token=OTHER if h == 2 else TOKEN, timeout_s=timeout,
                log=lines[h].append if h < 2 else lambda _: None)
    try:
      try:
        wire.open(epoch).allreduce_sum(np.full(4, 1e6 if h == 2 else h + 1, np.float32))
      except PeerError as e:
        refused = e
      if h == 2:
        return refused, None
      return refused, wire.open(epoch.without(2)).allreduce_sum(np.full(4, h + 1, np.float32))
    finally:
      wire.close()

  results = run_all([functools.partial(member, h) for h in range(3)])
  for h in (0, 1):
    refused, got = results[h]
    assert (refused.host, refused.epoch) == (2, 1) and "did not answer for 1.5 s" in str(refused)
    np.testing.assert_array_equal(got, np.full(4, 3, np.float32))
    assert 1 <= len(lines[h]) <= 2, lines[h]  # one for each epoch's wire
    for line in lines[h]:
      assert re.match(rf"wire: epoch [12], host {h}: dropped a frame from an unknown address: "
                      r"its handshake failed \(another join token", line), line
  assert isinstance(results[2][0], PeerError)  # the impostor hears nobody either


def raw_push(address: str) -> zmq.Socket:
  """A token holder's socket to the wire at `address` (past its handshake, what it sends
  is checked frame by frame)."""
  s = zmq.Context.instance().socket(zmq.PUSH)
  s.setsockopt(zmq.LINGER, 1000)
  sealed.connect(s, connection_key(TOKEN))
  s.connect(f"tcp://{address}")
  return s


def test_forged_and_replayed_frames_are_dropped_with_one_line_each(monkeypatch):
  """A raw client sends a well-formed frame without the key, and one with a MAC under no
  key of ours; then a frame recorded from a sum of epoch 1 is replayed into epoch 2. Each
  is dropped with one line naming the sender's address and why; the sums are exact."""
  lines, sealed = [], []
  first = make_epoch([0, 1])

  def recording(header, payload, key):  # what host 1 put on the wire in epoch 1
    parts = seal(header, payload, key)
    sealed.append([bytes(p) for p in parts])
    return parts

  seal = frames.seal
  monkeypatch.setattr(frames, "seal", recording)
  with Peers(first, 0, token=TOKEN, timeout_s=10) as p0, \
       Peers(first, 1, token=TOKEN, timeout_s=10) as p1:
    run_all([lambda: p0.allreduce_sum(np.ones(8, np.float32)),
             lambda: p1.allreduce_sum(np.ones(8, np.float32))])
  monkeypatch.setattr(frames, "seal", seal)
  recorded = next(m for m in sealed if frames.HEADER.unpack(m[0])[2:6] == (
      frames.SCATTER, 1, 1, 0))
  second = Epoch.of(2, first.hosts, first.addresses)
  header = frames.Header(frames.SCATTER, 2, 1, 0, 0, 16, 0).pack()
  forged = [[header, b"\0" * 16], [header, b"\0" * 16, b"\1" * frames.MAC_BYTES], recorded]
  p0 = Peers(second, 0, token=TOKEN, timeout_s=10, log=lines.append)
  attacker = raw_push(second.addresses[0])
  try:
    for message in forged:
      attacker.send_multipart(message)
    time.sleep(0.3)
    with Peers(second, 1, token=TOKEN, timeout_s=10) as p1:
      got = run_all([lambda: p0.allreduce_sum(np.ones(8, np.float32)),
                     lambda: p1.allreduce_sum(np.full(8, 2, np.float32))])
  finally:
    attacker.close()
    p0.close()
  for g in got:
    np.testing.assert_array_equal(g, np.full(8, 3, np.float32))
  assert len(lines) == 3 and p0.dropped == 3, lines
  assert all("dropped a frame from 127.0.0.1 (claims host 1)" in line for line in lines), lines
  reasons = sorted(line.split("(claims host 1): ", 1)[1] for line in lines)
  assert reasons == sorted(["2 frames where a message has 3 (no MAC: the sender has no join "
                            "token?)", "bad MAC (another join token, or altered)",
                            "it belongs to epoch 1, not 2"]), lines


def key_of(token, number: int, nonce: str = ""):
  """The key of epoch `number`'s frames (Epoch.of's epochs have no nonce)."""
  return epoch_key(token, Epoch(number, (), nonce=nonce))


def test_a_replay_within_the_epoch_is_refused_by_its_sequence_number():
  key = key_of(TOKEN, 3)
  message = frames.seal(frames.Header(frames.GATHER, 3, 1, 0, 0, 4, 0), b"abcd", key)
  seen: dict[int, int] = {}
  check = functools.partial(frames.check, key=key, epoch=3, me=0, members={0, 1},
                            expected_seq=seen)
  header, payload = check(message)
  assert (header.seq, bytes(payload), seen) == (0, b"abcd", {1: 1})
  with pytest.raises(frames.Dropped, match="a replay: sequence number 0 was already used"):
    check(message)
  assert key_of(TOKEN, 3) != key_of(TOKEN, 4) != key_of(OTHER, 4)
  assert key_of(None, 3) is None
  # another run's epoch 3 (the coordinator's nonce differs): another key
  assert key_of(TOKEN, 3, "one run") != key_of(TOKEN, 3, "another run")


MEMBER = textwrap.dedent("""
    import ctypes, sys, time
    import numpy as np
    from diloco_jax.runtime.security import JoinToken
    from diloco_jax.wire.epoch import Epoch
    from diloco_jax.wire.peers import Peers
    epoch = Epoch.of(1, (0, 1, 2), tuple(sys.argv[1].split(",")))
    p = Peers(epoch, 2, token=JoinToken("a-join-token-for-the-tests", "test"), timeout_s=30)
    p.allreduce_sum(np.full(4, 3, np.float32))
    print("summed", flush=True)
    if sys.argv[2] == "busy":  # libc's sleep called holding the GIL: no Python thread runs
      ctypes.PyDLL(None).sleep(3)
      p.allreduce_sum(np.full(4, 3, np.float32))
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["kill", "stop", "busy"])
def test_a_dead_peer_is_named_at_once_a_frozen_one_within_seconds_a_busy_one_never(how):
  """Host 2 (a process of its own) sums once, then is killed (its kernel closes its
  listener: connections to it are refused, and the others name it at once), stopped (its
  sockets stay open, but its zmq answers no PING: the others' `interrupt` hears it
  unreachable about a second later, wire/departed.py, and names it), or holds the GIL for
  3 s (as a joiner's heartbeat thread was held while it took the state: its zmq answers all
  along, so it is never unreachable, and the sum waits for it and completes)."""
  from diloco_jax.wire import departed  # pylint: disable=import-outside-toplevel
  epoch = make_epoch([0, 1, 2])
  proc = subprocess.Popen([sys.executable, "-c", MEMBER, ",".join(epoch.addresses), how],
                          cwd=REPO, stdout=subprocess.PIPE, text=True)
  heard = []  # host 2's unreachable_s, each time a wait on it asked

  def interrupt(peer, unreachable_s):
    if peer == 2:
      heard.append(unreachable_s)
    # (after a while, as the lease's rule does: a killed peer's closed connection says it at
    # once, and its refusing port names it first)
    late = unreachable_s is not None and unreachable_s >= 0.5
    return f"unreachable for {unreachable_s:.1f} s" if late else None

  wires = [Wire(h, token=TOKEN, timeout_s=30, interrupt=interrupt) for h in (0, 1)]
  try:
    first = run_all([lambda w=w: w.open(epoch).allreduce_sum(np.full(4, w.host + 1, np.float32))
                     for w in wires])
    assert proc.stdout.readline() == "summed\n"
    if how != "busy":
      proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    if how == "kill":
      proc.wait()
    start = time.monotonic()
    second = run_all([lambda w=w: w.peers.allreduce_sum(np.ones(4, np.float32))
                      for w in wires])
    waited = time.monotonic() - start
    survivors = [] if how == "busy" else run_all([lambda w=w: w.open(epoch.without(2))
                                                  .allreduce_sum(np.full(4, w.host + 1, np.float32))
                                                  for w in wires])
  finally:
    proc.kill()
    for w in wires:
      w.close()
  for got in first:
    np.testing.assert_array_equal(got, np.full(4, 6, np.float32))
  if how == "busy":  # waited for the 3 s, never taken for frozen
    assert 2.0 < waited < 10.0 and heard and set(heard) == {None}, (waited, heard)
    for got in second:
      np.testing.assert_array_equal(got, np.full(4, 5, np.float32))
    return
  for e in second:
    assert isinstance(e, PeerError) and (e.host, e.epoch) == (2, 1), e
    if how == "kill":
      assert (f"host 2 is gone (its connection closed and {epoch.addresses[2]} refuses "
              "connections: its process ended, or it left the epoch)") in str(e), e
    else:
      assert re.search(r"interrupted while waiting for host 2 during .*: unreachable for "
                       r"\d\.\d s", str(e)), e
  assert waited < (2.0 if how == "kill" else departed.LIVENESS_S + 3), waited
  for got in survivors:
    np.testing.assert_array_equal(got, np.full(4, 3, np.float32))


@pytest.mark.parametrize("stage", ["start", "sum"])
def test_an_interrupt_ends_a_wait_for_a_silent_peer_at_once(stage):
  """Host 1 never answers (start: it is not there; sum: it shook hands, then sends
  nothing). From 0.3 s on, the interrupt hook gives a reason: host 0's wait ends with a
  PeerError naming host 1 and that reason within about a second, not the 30 s timeout, and
  the epoch is broken afterwards."""
  epoch = make_epoch([0, 1])
  silent = Peers(epoch, 1, token=TOKEN, timeout_s=30) if stage == "sum" else None
  start = [float("inf")]  # set when host 0 starts the op that host 1 ignores

  def interrupt(peer, unreachable_s):
    assert peer == 1  # the peer host 0 waits on
    assert unreachable_s is None  # silent, not frozen: its zmq answers (wire/departed.py)
    late = time.monotonic() - start[0] > 0.3
    return "the coordinator dropped host(s) [1] (epoch 2)" if late else None

  p0 = Peers(epoch, 0, token=TOKEN, timeout_s=30, interrupt=interrupt)
  try:
    if silent is not None:
      run_all([p0.connect, silent.connect])
    start[0] = time.monotonic()
    with pytest.raises(PeerError) as e:
      p0.allreduce_sum(np.ones(8, np.float32))
    waited = time.monotonic() - start[0]
    with pytest.raises(WireError, match="epoch 1 is unusable"):
      p0.allgather(np.zeros(1))
  finally:
    p0.close()
    if silent is not None:
      silent.close()
  during = "the epoch's start" if stage == "start" else "a sum (reduce-scatter)"
  assert (e.value.host, e.value.epoch) == (1, 1)
  assert str(e.value) == (f"epoch 1: interrupted while waiting for host 1 during {during}: "
                          "the coordinator dropped host(s) [1] (epoch 2) (seen from host 0)")
  assert 0.3 <= waited < 1.0, waited


def reference_nh(key_words: list[int], data: bytes) -> bytes:
  """NH* as frames' docstring states it, one word at a time."""
  out = b""
  for start in range(0, len(data), frames.NH_BLOCK):
    m = struct.unpack("<256I", data[start:start + frames.NH_BLOCK].ljust(frames.NH_BLOCK, b"\0"))
    for i in range(2):
      k = key_words[frames.NH_SHIFT * i:]
      total = sum(((m[2 * j] + k[2 * j]) % 2**32) * ((m[2 * j + 1] + k[2 * j + 1]) % 2**32)
                  for j in range(128))
      out += struct.pack("<Q", total % 2**64)
  return out


def test_the_mac_is_nh_then_hmac_and_any_flipped_bit_fails_it():
  """frames.nh (numpy, NH_ROWS blocks at a time) against NH* word by word, on lengths that
  end mid-word, mid-block and past one pass of rows; the MAC covers header, length and
  payload: one flipped bit anywhere, or a zero byte more, fails it."""
  key = key_of(TOKEN, 7)
  passes, _ = frames._subkeys(key)  # pylint: disable=protected-access
  words = [int(w) for w in passes[0, 0]] + [int(w) for w in passes[1, 0, -frames.NH_SHIFT:]]
  rng = np.random.default_rng(0)
  for n in (0, 3, 1024, 2500, frames.NH_ROWS * frames.NH_BLOCK + 1030):
    data = rng.integers(0, 256, n, np.uint8).tobytes()
    got = frames.nh(passes, data)
    assert len(got) == 16 * -(-n // frames.NH_BLOCK)
    tail = n - n % frames.NH_BLOCK if n % frames.NH_BLOCK else max(n - frames.NH_BLOCK, 0)
    assert got[:48] == reference_nh(words, data[:3 * frames.NH_BLOCK])
    assert got[16 * (tail // frames.NH_BLOCK):] == reference_nh(words, data[tail:])
  header = frames.Header(frames.GATHER, 7, 1, 0, 0, 2500, 0).pack()
  data = bytearray(rng.integers(0, 256, 2500, np.uint8).tobytes())
  tag = frames.mac(key, header, data)
  for bit in (0, 8 * 1023 + 5, 8 * 2499 + 7):
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert frames.mac(key, header, flipped) != tag
  assert frames.mac(key, header, data + b"\0") != tag
  assert frames.mac(key, header[:-1] + b"\1", data) != tag
  assert frames.mac(key_of(TOKEN, 8), header, data) != tag


def test_a_hello_of_a_later_epoch_is_dropped_without_a_line_or_a_key():
  """A peer that opened epoch 2 first reaches this host's epoch-1 listener (same port): its
  HELLOs are dropped quietly. Epoch 2's key needs its nonce, which this host has not heard:
  a HELLO naming epoch 2 is dropped unchecked, genuine or not, and builds no key."""
  epoch, lines = make_epoch([0, 1]), []
  p0 = Peers(epoch, 0, token=TOKEN, timeout_s=10, log=lines.append)
  attacker = raw_push(epoch.addresses[0])
  try:
    hello = frames.Header(frames.HELLO, 2, 1, 0, 0, 1, 0)
    attacker.send_multipart(frames.seal(hello, b"\0", key_of(TOKEN, 2)))
    attacker.send_multipart(frames.seal(hello, b"\0", key_of(OTHER, 2)))
    deadline = time.monotonic() + 5
    keys_before = frames._subkeys.cache_info().currsize  # pylint: disable=protected-access
    while p0.dropped < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    attacker.close()
    p0.close()
  assert p0.dropped == 2 and lines == [], lines
  assert frames._subkeys.cache_info().currsize == keys_before  # pylint: disable=protected-access


def test_a_peer_slow_to_bind_the_next_epoch_on_its_port_is_waited_for_not_named_gone():
  """At an epoch change each host closes its listener and binds the next epoch's on the same
  port. Members that open the next epoch first connect to a slow host's old listener, see it
  close, and find its port refusing until the host binds again: no evidence that it died
  (wire/departed.py: it has not answered in this epoch), so they wait for it. Before, they
  named it gone within a second (a joiner's admission while host 0 compiled its eval)."""
  first = make_epoch([0, 1, 2])
  second = Epoch.of(2, first.hosts, first.addresses)
  old = Peers(first, 2, token=TOKEN, timeout_s=10)  # host 2's listener of epoch 1

  def slow():
    time.sleep(1.0)  # the others connect to its old listener meanwhile
    old.close()
    time.sleep(2.0)  # its port refuses them: zmq's reconnects, then a connect of their own
    with Peers(second, 2, token=TOKEN, timeout_s=10) as p:
      return p.allreduce_sum(np.full(4, 3, np.float32))

  def member(h):
    with Peers(second, h, token=TOKEN, timeout_s=10) as p:
      return p.allreduce_sum(np.full(4, h + 1, np.float32))

  for got in run_all([functools.partial(member, 0), functools.partial(member, 1), slow]):
    np.testing.assert_array_equal(got, np.full(4, 6, np.float32))
