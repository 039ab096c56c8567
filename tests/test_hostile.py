"""What anyone who reaches a port, or a member that misbehaves, can send: each test is one
finding of a review of the live path (bytes that ended the coordinator, frames that repeat
across runs, sizes that exhaust memory, lines without bound) and the rule that answers it.
Fast and in-process: a coordinator in a thread, the wire's Links, the Ledger at fake times."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import signal
import subprocess
import sys
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from bench.harness import free_port
from diloco_jax.checkpoints import store
from diloco_jax.membership import client as client_lib
from diloco_jax.membership import collective as collective_lib
from diloco_jax.membership import coordinator as co
from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import ledger as ledger_lib
from diloco_jax.runtime import security
from diloco_jax.wire import droplog
from diloco_jax.wire import frames
from diloco_jax.wire.epoch import Epoch
from diloco_jax.wire.epoch import Member
from diloco_jax.wire.epoch import PeerError
from diloco_jax.wire.epoch import WireError
from diloco_jax.wire.epoch import epoch_key
from diloco_jax.wire.peers import Peers
from tests.hostile import unfinished_message

LEASE_S = 2.0
TOKEN = security.JoinToken("a-join-token-for-the-tests", "the test")


@contextlib.contextmanager
def coordinator(token=None):
  """A coordinator in a thread, with a registered host; yields (port, its client, log)."""
  port, log, stop = free_port(), [], threading.Event()
  thread = threading.Thread(target=co.serve, args=(port, 4, LEASE_S, co.key_for(token)),
                            kwargs={"stop": stop, "log": log.append}, daemon=True)
  thread.start()
  client = client_lib.Client(f"127.0.0.1:{port}", token, timeout_s=2.0)
  try:
    client.register("127.0.0.1:1")
    yield port, client, log, thread
  finally:
    client.close()
    stop.set()
    thread.join(5)


def raw_request(port: int, frames_: list[bytes], key: bytes | None = None) -> dict | None:
  """Sends one request as a REQ would; the answer's body (None: no answer in 1 s)."""
  ctx = zmq.Context()
  sock = ctx.socket(zmq.REQ)
  sock.setsockopt(zmq.LINGER, 0)
  sock.connect(f"tcp://127.0.0.1:{port}")
  try:
    sock.send_multipart(frames_)
    if not sock.poll(1000):
      return None
    answer = sock.recv_multipart()
    return json.loads(answer[0]) if key is None else co.verify(key, co.S2C, answer)
  finally:
    ctx.destroy(linger=0)


def still_serving(client: client_lib.Client, thread: threading.Thread) -> None:
  assert thread.is_alive()
  assert client.heartbeat() is not None  # answered, and knows the host


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


def test_random_bytes_on_the_coordinator_port_end_nothing():
  """64 KiB of random bytes on a raw TCP connection (no protocol known): zmq may read them
  as an old ZMTP peer's messages, which carry no address; the coordinator goes on.
  (7bb7343: `Peer-Address` raised ZMQError out of `serve`, and every host stopped.)"""
  with coordinator() as (port, client, log, thread):
    for seed in range(4):
      with socket.create_connection(("127.0.0.1", port)) as s:
        with contextlib.suppress(OSError):
          s.sendall(np.random.default_rng(seed).integers(0, 256, 64 << 10, np.uint8).tobytes())
          time.sleep(0.1)
    still_serving(client, thread)


@pytest.mark.parametrize("body, why", [
    (b'{"op":"heartbeat","incarnation":"x","seq":1e400}', "not an integer"),
    (b'{"op":"heartbeat","incarnation":"x","seq":NaN}', "not an integer"),
    (b'{"op":' + b"[" * 5000 + b"]" * 5000 + b"}", "not JSON"),  # the parser's own limit
    (b'{"op":"register","challenge":"c","host":0,"address":"a:1","last_epoch":'
     + str(2**64 - 1).encode() + b"}", "expected an integer"),
    (b'{"op":"heartbeat","incarnation":"x","seq":true}', "expected an integer"),
    (b'{"op":"commit","incarnation":"x","seq":5,"epoch":1,"step":[],"ok":true,'
     b'"suspect":null}', "expected an integer"),
    (b'"just a string"', "not an object"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_request_that_fails_a_check_is_dropped_and_the_coordinator_goes_on(body, why):
  """Signed with the key every process knows without a token: each reaches the parser.
  (7bb7343: OverflowError and RecursionError escaped `Ledger.handle`; a last_epoch of
  2**64 - 1 was accepted and overflowed the wire's header.)"""
  with coordinator() as (port, client, log, thread):
    key = co.key_for(None)
    answer = raw_request(port, [body, hmac.new(key, co.C2S + body, "sha256").digest()])
    assert answer is not None and answer["op"] == "dropped" and why in answer["why"], answer
    still_serving(client, thread)


def test_a_part_over_the_size_cuts_its_connection_and_answers_nothing():
  """A 1 MiB part (a request has at most 16 KiB): zmq cuts the connection before the part
  is buffered whole. (7bb7343: no size limit; a 256 MiB part was held, then copied.)"""
  with coordinator() as (port, client, log, thread):
    assert raw_request(port, [b"x" * (1 << 20), b"\0" * 32]) is None
    still_serving(client, thread)


def test_with_a_token_a_stranger_gets_no_further_than_the_handshake():
  """With a join token, the coordinator's and the wire's listeners speak CURVE with keys from
  it (wire/sealed.py): a connection without the key ends at the greeting, before zmq reads
  a part. (7bb7343: zmq held the parts of a message whose last part never came: a keyed host
  grew from 34 to 290 MiB, nothing logged.)"""
  with coordinator(TOKEN) as (port, client, log, thread):
    assert unfinished_message(port) < 16 << 20
    still_serving(client, thread)
    time.sleep(0.3)  # the next tick reads the monitor
    assert any("its handshake failed" in line for line in log), log
  with connected_pair() as (epoch, p0, p1):
    assert unfinished_message(security.split_address(epoch.address(0))[1]) < 16 << 20
    x = np.arange(1000, dtype=np.float32)
    sums = [None, None]
    threads = [threading.Thread(target=lambda i=i, p=p: sums.__setitem__(i, p.allreduce_sum(x)))
               for i, p in enumerate((p0, p1))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(10)
    assert np.array_equal(sums[0], 2 * x) and np.array_equal(sums[1], 2 * x)


def test_a_host_with_another_token_is_told_so_by_the_handshake():
  """The coordinator's CURVE key comes from the token: a host with another token (or none)
  fails the handshake, and its client says so in a few tenths of a second, not as a lost
  coordinator after its timeout."""
  with coordinator(TOKEN) as (port, client, log, thread):
    for token in (security.JoinToken("another-join-token-for-the-tests", "t"), None):
      other = client_lib.Client(f"127.0.0.1:{port}", token, timeout_s=10.0)
      t0 = time.monotonic()
      with pytest.raises(client_lib.TokenMismatch, match="ended our handshake"):
        other.register("127.0.0.1:2")
      assert time.monotonic() - t0 < 5
      other.close()
    still_serving(client, thread)


def test_a_wire_address_no_peer_could_use_is_refused_at_registration():
  """(7bb7343: admitted, it raised at the next boundary on every member, outside the redo
  path.)"""
  with coordinator() as (port, client, log, thread):
    other = client_lib.Client(f"127.0.0.1:{port}", None, timeout_s=2.0)
    try:
      for address in ("tcp://x:1", "no-port", "[::1]:99999", "a b:1"):
        with pytest.raises(ledger_lib.CoordinatorError, match="refused us"):
          other.register(address)
    finally:
      other.close()
    still_serving(client, thread)


def test_hellos_without_end_keep_a_bounded_number_of_challenges():
  """(7bb7343: every hello's challenge was kept 30 s, and every frame rebuilt the whole
  table: a flood made each request cost O(outstanding challenges).)"""
  ledger = ledger_lib.Ledger(max_hosts=4, lease_s=10.0, log=lambda line: None)
  for i in range(10_000):
    ledger.handle({"op": "hello", "nonce": str(i)}, 0.0)
    ledger.expire(0.0)
  assert len(ledger._challenges) <= ledger_lib.CHALLENGES_PER_HOST * 4 + 16  # pylint: disable=protected-access
  challenge = ledger.handle({"op": "hello", "nonce": "n"}, 1.0)["challenge"]
  answer = ledger.handle({"op": "register", "challenge": challenge, "host": 0,
                          "address": "h:1", "last_epoch": 0}, 1.0)
  assert answer["op"] == "registered"


def test_a_pending_hosts_last_epoch_numbers_the_epoch_that_admits_it():
  """A host that registers while the job runs reports the highest epoch it has seen; the
  epoch that admits it is numbered above it. (7bb7343: a pending registration ignored it.)"""
  ledger = ledger_lib.Ledger(max_hosts=4, lease_s=10.0, log=lambda line: None)

  def register(host, last_epoch):
    challenge = ledger.handle({"op": "hello", "nonce": "n"}, 0.0)["challenge"]
    return ledger.handle({"op": "register", "challenge": challenge, "host": host,
                          "address": f"h{host}:1", "last_epoch": last_epoch}, 0.0)

  first = register(0, 0)
  vote = {"op": "commit", "host": 0, "incarnation": first["incarnation"], "seq": 1,
          "epoch": first["epoch"]["number"], "step": 0, "ok": True, "suspect": None}
  assert ledger.handle(vote, 0.0)["op"] == "verdict"  # the job runs
  assert register(1, 100)["pending"]
  admitted = ledger.handle({**vote, "seq": 2, "step": 1, "boundary": True}, 0.0)
  assert admitted["admitted"] == [1] and admitted["next"]["number"] > 100


def test_every_epoch_has_its_own_nonce_and_a_frame_of_another_run_fails_its_mac():
  """Two runs with one token both count epochs from 1: their frames' keys differ by the
  coordinator's nonce. (7bb7343: keys from the token and the number alone; a frame recorded
  in one run was summed in the next, on every host alike.)"""
  numbers, nonces = [], []
  for _ in range(2):  # two runs
    ledger = ledger_lib.Ledger(max_hosts=2, lease_s=10.0, log=lambda line: None)
    challenge = ledger.handle({"op": "hello", "nonce": "n"}, 0.0)["challenge"]
    epoch = Epoch.from_json(ledger.handle({"op": "register", "challenge": challenge,
                                           "host": 0, "address": "h:1", "last_epoch": 0},
                                          0.0)["epoch"])
    numbers.append(epoch.number)
    nonces.append(epoch.nonce)
  assert numbers == [1, 1] and nonces[0] != nonces[1] and all(len(n) == 32 for n in nonces)
  header = frames.Header(frames.GATHER, 1, 1, 0, 0, 4, 0)
  recorded = frames.seal(header, b"abcd", epoch_key(TOKEN, Epoch(1, (), nonce=nonces[0])))
  with pytest.raises(frames.Dropped, match="bad MAC"):
    frames.check(recorded, key=epoch_key(TOKEN, Epoch(1, (), nonce=nonces[1])), epoch=1,
                 me=0, members={0, 1}, expected_seq={})


def test_a_hosts_highest_epoch_is_kept_in_its_checkpoints_for_a_new_coordinator(tmp_path):
  """A host restarted with a coordinator started anew numbers its epochs above the last run's
  (the number only grows, across every restart): its newest checkpoint says the highest it
  saw, whether its workdir is its own or WORKDIR/host<i> of a shared one."""
  for workdir in (tmp_path / "own", tmp_path / "shared" / "host1"):
    for n, epoch in ((2, 5), (3, 9)):
      (workdir / "checkpoints" / str(n)).mkdir(parents=True)
      (workdir / "checkpoints" / str(n) / "meta.json").write_text(json.dumps({"epoch": epoch}))
  assert store.last_epoch(str(tmp_path / "own"), 1) == 9
  assert store.last_epoch(str(tmp_path / "shared"), 1) == 9
  assert store.last_epoch(str(tmp_path / "none"), 1) == 0
  assert store.last_epoch(None, 1) == 0
  with coordinator() as (port, _, log, thread):  # its own epochs start at 1
    client = client_lib.Client(f"127.0.0.1:{port}", None, timeout_s=2.0, last_epoch=9)
    try:
      assert client.register("127.0.0.1:2", host=1).epoch.number > 9
    finally:
      client.close()


def test_no_token_beyond_loopback_is_refused_unless_insecure_and_then_said():
  """(7bb7343: a coordinator bound to 0.0.0.0 without a token printed one line and served;
  live hosts printed nothing.)"""
  with pytest.raises(security.SecurityError, match="no join token.*--insecure"):
    security.require_token(None, {"the coordinator": "0.0.0.0:1"}, allow=False)
  with pytest.raises(security.SecurityError, match="host 1's wire at 10.0.0.2:7"):
    security.require_token(None, {"host 1's wire": "10.0.0.2:7"}, allow=False)
  assert security.require_token(None, {"w": "127.0.0.1:1", "c": "localhost:2"}, False) is None
  assert security.require_token(TOKEN, {"the coordinator": "0.0.0.0:1"}, False) is None
  warning = security.require_token(None, {"the coordinator": "0.0.0.0:1"}, allow=True)
  assert warning.startswith("WARNING: --insecure")
  assert co.main([f"--port={free_port()}", "--max_hosts=1", "--bind=0.0.0.0"]) != 0


def test_a_guessable_token_is_refused():
  for weak in ("aaaaaaaaaaaaaaaaaaaa", "1234567812345678", "abababababababababab"):
    with pytest.raises(security.SecurityError, match="too easy to guess"):
      security.JoinToken(weak, "the test")
  security.JoinToken("correct-horse-battery-staple", "the test")


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

  def interrupt(self, members):
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


def test_anything_raised_while_a_request_is_handled_drops_that_request_alone(monkeypatch):
  """Whatever handling a request raises (here a bug's RuntimeError), that request is
  answered `dropped` and the coordinator serves on: one try around each request."""
  handle = ledger_lib.Ledger.handle

  def buggy(self, req, now):
    if req.get("op") == "heartbeat" and req.get("seq") == 7:
      raise RuntimeError("a bug")
    return handle(self, req, now)

  monkeypatch.setattr(ledger_lib.Ledger, "handle", buggy)
  with coordinator() as (port, client, log, thread):
    key = co.key_for(None)
    body = json.dumps({"op": "heartbeat", "incarnation": "x", "seq": 7}).encode()
    answer = raw_request(port, [body, hmac.new(key, co.C2S + body, "sha256").digest()])
    assert answer == {"op": "dropped", "why": "RuntimeError while handling it"}, answer
    still_serving(client, thread)


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


def test_a_coordinator_paused_longer_than_a_lease_drops_nobody(tmp_path):
  """The coordinator SIGSTOPped for 3 leases while its hosts heartbeat: when it goes on, it
  reads every heartbeat that waited and counts the pause against nobody. (7bb7343: it
  handled one frame, then ran out every other lease: every host but one was dropped.)"""
  port = free_port()
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.Popen([sys.executable, "-m", "diloco_jax.membership.coordinator",
                           f"--port={port}", "--max_hosts=3", "--lease_s=1"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  clients = [client_lib.Client(f"127.0.0.1:{port}", None, timeout_s=10.0) for _ in range(3)]
  try:
    for h, c in enumerate(clients):
      c.register(f"127.0.0.1:{h + 1}", host=h)
    epoch = clients[0].heartbeat()
    assert epoch.hosts == (0, 1, 2)
    stop, seen = threading.Event(), []

    def beat(c):
      while not stop.is_set():
        seen.append(c.heartbeat())
        time.sleep(0.2)

    threads = [threading.Thread(target=beat, args=(c,)) for c in clients]
    for t in threads:
      t.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(3.0)
    proc.send_signal(signal.SIGCONT)
    time.sleep(1.5)
    stop.set()
    for t in threads:
      t.join(15)
    assert seen[-1] is not None and seen[-1].hosts == (0, 1, 2) and seen[-1].number == epoch.number
  finally:
    for c in clients:
      c.close()
    proc.terminate()
    proc.wait(10)


def test_a_pause_of_the_coordinator_is_counted_against_no_lease_or_accusation():
  """`Ledger.pardon`: the leases and the accusations pending move back by the pause."""
  ledger = ledger_lib.Ledger(max_hosts=2, lease_s=1.0, log=lambda line: None, accuse_s=1.0)
  incarnations = []
  for h in range(2):
    challenge = ledger.handle({"op": "hello", "nonce": "n"}, 0.0)["challenge"]
    incarnations.append(ledger.handle({"op": "register", "challenge": challenge, "host": h,
                                       "address": f"h{h}:1", "last_epoch": 0}, 0.0))
  e = ledger.epoch.number
  ledger.handle({"op": "commit", "host": 0, "incarnation": incarnations[0]["incarnation"],
                 "seq": 1, "epoch": e, "step": 0, "ok": False, "suspect": 1}, 0.5)
  ledger.pardon(10.0)
  ledger.expire(10.9)  # without the pardon: both leases and the accusation ran out
  assert ledger.epoch.number == e and ledger.epoch.hosts == (0, 1)
  ledger.expire(11.6)
  assert ledger.epoch.number > e


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
