"""membership/programs.py: a joiner takes a member's compiled programs, loads them as its
own without a trace, and takes nothing from a member whose machine or join token differs,
nor a file whose bytes are not those announced."""

from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax import compile_cache
from diloco_jax.membership import programs
from diloco_jax.runtime import security
from diloco_jax.wire import epoch as epoch_lib
from tests.coordinators import ledger_of

TOKEN = security.JoinToken("correct-horse-battery-staple-42", "test")


@pytest.fixture
def caches(tmp_path, monkeypatch):
  """Two cache directories, a member's and a joiner's; JAX's set to the member's (the
  session's, from the environment, keeps no program whole: conftest.py)."""
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  session = jax.config.jax_compilation_cache_dir
  member, joiner = tmp_path / "member", tmp_path / "joiner"
  joiner.mkdir()
  jax.config.update("jax_compilation_cache_dir", str(member))
  yield str(member), str(joiner)
  jax.config.update("jax_compilation_cache_dir", session)


def program(traces: list):
  def f(x):
    traces.append(1)  # at trace time only
    return jnp.tanh(x @ x.T) * 1.3
  x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
  return (lambda: jax.jit(f).lower(x)), x


def offered(cache: str, token=None) -> tuple[programs.Offer, epoch_lib.Epoch]:
  offer = programs.Offer("127.0.0.1", token, cache)
  return offer, epoch_lib.Epoch(7, (epoch_lib.Member(0, "a", "127.0.0.1:1"),  # offers none
                                    epoch_lib.Member(2, "b", "127.0.0.1:2", offer.address)))


def test_a_joiner_loads_a_members_program_without_a_trace_and_computes_the_same_bits(caches):
  member, joiner = caches
  lowered = []  # (JAX's own trace cache would hide a second trace of one function)
  lower, x = program([])
  def counted():
    lowered.append(1)
    return lower()
  first = compile_cache.compiled("f", {"v": 1}, counted)
  offer, epoch = offered(member, TOKEN)
  try:
    taken = programs.fetch(epoch, TOKEN, joiner)
  finally:
    offer.close()
  assert taken is not None and taken["host"] == 2 and taken["files"] >= 1
  assert sorted(os.listdir(os.path.join(joiner, "executables"))) == sorted(
      os.listdir(os.path.join(member, "executables")))
  # The joiner's cache is another directory: the same program keys alike there
  jax.config.update("jax_compilation_cache_dir", joiner)
  again = compile_cache.compiled("f", {"v": 1}, counted)
  assert lowered == [1]  # loaded: neither lowered nor compiled
  assert np.asarray(again.program(x)).tobytes() == np.asarray(first.program(x)).tobytes()
  offer, epoch = offered(member, TOKEN)
  try:  # what the joiner holds is not sent again
    assert programs.fetch(epoch, TOKEN, joiner) is None
  finally:
    offer.close()


@pytest.mark.parametrize("differs", ["xla_flags", "jax_config", "token"])
def test_nothing_is_taken_from_a_member_whose_machine_or_token_differs(caches, monkeypatch,
                                                                       differs):
  member, joiner = caches
  compile_cache.compiled("f", {"v": 1}, program([])[0])
  offer, epoch = offered(member, TOKEN)
  log_compiles = jax.config.jax_log_compiles
  try:
    programs.fetch(epoch, TOKEN, os.path.join(joiner, "probe"))  # the member's digest, now
    if differs == "xla_flags":
      monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    elif differs == "jax_config":
      jax.config.update("jax_log_compiles", not log_compiles)
    token = security.JoinToken("another-horse-battery-staple-7", "test") if (
        differs == "token") else TOKEN
    assert programs.fetch(epoch, token, joiner, timeout_s=0.5) is None
  finally:
    jax.config.update("jax_log_compiles", log_compiles)
    offer.close()
  assert os.listdir(joiner) == ["probe"]


def test_a_file_is_written_only_with_the_bytes_announced_and_never_outside_the_cache(tmp_path):
  cache = str(tmp_path / "cache")
  os.makedirs(os.path.join(cache, "executables"))
  with open(os.path.join(cache, "jit_kept-cache"), "wb") as f:
    f.write(b"mine")

  def entry(name, data, sha=None):
    return [name, len(data), sha or hashlib.sha256(data).hexdigest()]
  blobs = [b"good", b"tampered", b"theirs", b"escape", b"hidden", b"kept"]
  files = [entry("executables/a.executable", blobs[0]),
           entry("jit_b-cache", blobs[1], hashlib.sha256(b"other").hexdigest()),
           entry("jit_kept-cache", blobs[2]), entry("../escape", blobs[3]),
           entry(".tmp-x", blobs[4]), entry("jit_c-cache", blobs[5])]
  assert programs._write(cache, files, blobs) == 2  # pylint: disable=protected-access
  assert sorted(os.listdir(cache)) == ["executables", "jit_c-cache", "jit_kept-cache"]
  assert os.listdir(os.path.join(cache, "executables")) == ["a.executable"]
  with open(os.path.join(cache, "jit_kept-cache"), "rb") as f:
    assert f.read() == b"mine"  # a file the host has is not replaced
  # bytes short of what the list announces: nothing past them is placed
  assert programs._write(cache, [entry("jit_d-cache", b"12345")], [b"123"]) == 0  # pylint: disable=protected-access
  assert not os.path.exists(tmp_path / "escape")


def test_the_members_programs_address_is_in_the_epoch_and_a_bad_one_is_refused():
  ledger, hosts, _, _ = ledger_of(1)
  hello = ledger.handle({"op": "hello", "nonce": "n"}, 0.5)
  answer = ledger.handle({"op": "register", "challenge": hello["challenge"], "host": 1,
                          "address": "h1:1", "programs": "h1:2", "last_epoch": 0}, 0.5)
  assert answer["op"] == "registered", answer
  assert epoch_lib.Epoch.from_json(answer["epoch"]).members[1].programs == "h1:2"
  assert ledger.epoch.members[0].programs == ""  # a host that serves none
  hello = ledger.handle({"op": "hello", "nonce": "m"}, 0.6)
  refused = ledger.handle({"op": "register", "challenge": hello["challenge"], "host": 2,
                           "address": "h2:1", "programs": "no port", "last_epoch": 0}, 0.6)
  assert refused["op"] == "refused" and "programs address" in refused["why"], refused


def test_junk_an_oversized_part_or_a_stranger_never_stop_the_server(caches):
  """What a server on the internet gets: a stranger's handshake (no token), a token
  holder's junk and a body that fails the MAC, a part over the size limit, a message left
  unfinished. Each is dropped, and a joiner is still served."""
  import zmq  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire import sealed  # pylint: disable=import-outside-toplevel
  member, joiner = caches
  compile_cache.compiled("f", {"v": 1}, program([])[0])
  offer, epoch = offered(member, TOKEN)
  ctx = zmq.Context.instance()
  socks = []

  def sent(sock, frames, last=True) -> None:
    # Without waiting: once the server has cut a peer off (a stranger's handshake, a part
    # over the limit), its socket has nothing to queue on until it connects again, which
    # a stranger never does, and a send that waits would wait for good.
    try:
      sock.send_multipart(frames, zmq.NOBLOCK | (0 if last else zmq.SNDMORE))
    except zmq.Again:
      pass

  def connected(keyed: bool):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keyed:
      sealed.connect(sock, programs._key(TOKEN))  # pylint: disable=protected-access
    sock.connect(f"tcp://{offer.address}")
    socks.append(sock)
    return sock

  try:
    for keyed in (False, True):
      sock = connected(keyed)  # (queued on the connection until the server cuts it)
      sent(sock, [b"", b"junk", b"not a mac"])
      sent(sock, [b"", b'{"op": "programs"}', b"\0" * 32])
      sent(sock, [b"", b"x" * (1 << 20), b""])  # over MAXMSGSIZE: cut
    sent(connected(keyed=True), [b""], last=False)  # and a message never finished
    assert not any(s.poll(300) for s in socks)  # nothing answered
    taken = programs.fetch(epoch, TOKEN, joiner, timeout_s=5)
    assert taken is not None and taken["files"] >= 1
  finally:
    for s in socks:
      s.close(linger=0)
    offer.close()
