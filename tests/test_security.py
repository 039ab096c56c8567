"""Start-up security: the coordinator address check, the join token's agreement, and the
outer-state hash comparison's verdicts. Multi-process runs are in test_multihost.py."""

import socket
import threading

import numpy as np
import pytest

from diloco_jax.runtime import cluster
from diloco_jax.runtime import security
from diloco_jax.wire import integrity

# Documentation ranges (RFC 5737, RFC 3849): public addresses that route nowhere.
PUBLIC = ["192.0.2.10", "198.51.100.7", "203.0.113.5", "[2001:db8::1]", "8.8.8.8"]
PRIVATE = ["127.0.0.1", "10.1.2.3", "172.16.5.4", "192.168.1.2", "100.101.102.103",
           "169.254.1.1", "[::1]", "[fd12:3456::1]", "[::ffff:10.0.0.1]"]


@pytest.fixture
def no_sockets(monkeypatch):
  """Any socket or DNS lookup fails the test: the address check must not open one."""
  def refuse(*args, **kwargs):
    raise AssertionError("the address check opened a socket or resolved a name")
  monkeypatch.setattr(socket, "socket", refuse)
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("ip", PUBLIC)
def test_public_coordinator_is_refused_without_the_flag(ip, no_sockets):
  with pytest.raises(security.SecurityError, match="public address") as e:
    security.check_coordinator_address(f"{ip}:61000", allow_public=False)
  assert "--allow_public_coordinator" in str(e.value) and "VPN" in str(e.value)
  security.check_coordinator_address(f"{ip}:61000", allow_public=True)


@pytest.mark.parametrize("ip", PRIVATE)
def test_private_coordinator_is_accepted(ip, no_sockets):
  security.check_coordinator_address(f"{ip}:61000", allow_public=False)


def test_a_name_is_judged_by_what_it_resolves_to():
  def resolve(name):
    return {"node0.example": ["203.0.113.9"], "node0.internal": ["10.0.0.5"]}[name]
  with pytest.raises(security.SecurityError, match=r"node0\.example:61000 is a public address"):
    security.check_coordinator_address("node0.example:61000", False, resolve=resolve)
  security.check_coordinator_address("node0.internal:61000", False, resolve=resolve)


@pytest.mark.parametrize("address", ["10.0.0.1", "10.0.0.1:", ":61000", "10.0.0.1:99999"])
def test_malformed_coordinator_address(address, no_sockets):
  with pytest.raises(security.SecurityError, match="expected host:port"):
    security.check_coordinator_address(address, False)


def test_public_coordinator_is_refused_before_jax_distributed_starts(monkeypatch):
  def started(**kwargs):
    raise AssertionError("jax.distributed.initialize ran before the address check")
  monkeypatch.setattr(cluster.jax.distributed, "initialize", started)
  with pytest.raises(cluster.StartupError, match="203.0.113.5:61000 is a public address"):
    cluster.initialize(cluster.Cluster(
        coordinator_address="203.0.113.5:61000", num_hosts=2, host_id=0))


def test_bind_address_is_the_coordinators_interface_where_this_machine_has_it():
  assert security.bind_address("127.0.0.1:61000") == "127.0.0.1:61000"
  assert security.bind_address("192.0.2.10:61000") is None  # not this machine's: JAX's default
  assert security.bind_address("localhost:61000") is None  # a name: JAX's default


SECRET = "correct-horse-battery-staple-42"


def test_token_sources_and_errors(tmp_path, monkeypatch):
  monkeypatch.delenv(security.TOKEN_ENV, raising=False)
  monkeypatch.delenv(security.TOKEN_FILE_ENV, raising=False)
  assert security.JoinToken.from_environment() is None
  monkeypatch.setenv(security.TOKEN_ENV, SECRET)
  token = security.JoinToken.from_environment()
  assert token.source == "$DILOCO_JOIN_TOKEN" and SECRET not in repr(token)
  path = tmp_path / "token"
  path.write_text("another-secret-of-the-job-77\nignored\n")
  from_file = security.JoinToken.from_environment(str(path))  # the flag wins over the env
  assert from_file.proof(0, 2, ["a", "b"]) != token.proof(0, 2, ["a", "b"])
  assert from_file.proof(0, 2, ["a", "b"]) == security.JoinToken(
      "another-secret-of-the-job-77", "x").proof(0, 2, ["a", "b"])
  monkeypatch.setenv(security.TOKEN_FILE_ENV, str(path))
  assert security.JoinToken.from_environment().source == f"--join_token_file={path}"
  with pytest.raises(security.SecurityError, match="cannot read it: No such file"):
    security.JoinToken.from_environment(str(tmp_path / "missing"))
  (tmp_path / "empty").write_text("\n")
  with pytest.raises(security.SecurityError, match="the file is empty"):
    security.JoinToken.from_environment(str(tmp_path / "empty"))
  with pytest.raises(security.SecurityError, match="shorter than 16") as e:
    security.JoinToken("short-secret", "$DILOCO_JOIN_TOKEN")
  assert "short-secret" not in str(e.value)


def test_proofs_are_bound_to_host_and_nonces():
  token = security.JoinToken(SECRET, "test")
  proof = token.proof(0, 2, ["n0", "n1"])
  assert len({proof, token.proof(1, 2, ["n0", "n1"]), token.proof(0, 2, ["n0", "n2"]),
              token.proof(0, 3, ["n0", "n1"])}) == 4
  assert SECRET not in proof


class FakeStore:
  """The coordination service's key-value store and barrier, for hosts run as threads."""

  def __init__(self, num_hosts):
    self.values, self.cond, self.arrived, self.n = {}, threading.Condition(), {}, num_hosts

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.cond:
      assert allow_overwrite or key not in self.values, key
      self.values[key] = value
      self.cond.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self.cond:
      assert self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000), key
      return self.values[key]

  def key_value_delete(self, key):
    with self.cond:
      del self.values[key]

  def wait_at_barrier(self, name, timeout_ms):
    with self.cond:
      self.arrived[name] = self.arrived.get(name, 0) + 1
      self.cond.notify_all()
      assert self.cond.wait_for(lambda: self.arrived[name] == self.n, timeout_ms / 1000)


def agree(secrets_by_host):
  """Runs `agree_on_token` on one thread per host; each host's error message or None.
  Any other exception in a host's thread (a crash, not a refusal) is raised here: in a
  thread it would only be a warning, and the hosts would seem to agree."""
  store, n = FakeStore(len(secrets_by_host)), len(secrets_by_host)
  errors, crashes = [None] * n, []

  def host(h):
    token = secrets_by_host[h] and security.JoinToken(secrets_by_host[h], "test")
    try:
      security.agree_on_token(store, h, n, token, timeout_s=20)
    except security.SecurityError as e:
      errors[h] = str(e)
    except BaseException as e:  # noqa: BLE001 -- handed to the test's thread below
      crashes.append((h, e))

  threads = [threading.Thread(target=host, args=(h,)) for h in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)  # agree_on_token's own timeout is 20 s
    assert not t.is_alive(), "agree_on_token did not return within its timeout"
  if crashes:
    h, e = crashes[0]
    raise AssertionError(f"host {h}'s agree_on_token crashed: {type(e).__name__}: {e}") from e
  return errors, store


def test_equal_tokens_agree_and_nothing_secret_is_stored():
  errors, store = agree([SECRET] * 3)
  assert errors == [None] * 3
  assert not any(SECRET in value for value in store.values.values())
  assert agree([None, None])[0] == [None, None]


def test_a_host_with_another_token_is_refused_by_every_host():
  other = "a-different-secret-of-30-chars"
  errors, store = agree([SECRET, other, SECRET])
  assert "host 1's join token differs from this host's" in errors[0]
  assert "host 1's join token differs" in errors[2]
  assert ("host 0's join token differs" in errors[1]
          and "host 2's join token differs" in errors[1])
  for e in errors:
    assert e.startswith(f"host {errors.index(e)}: join token mismatch")
    assert SECRET not in e and other not in e
  assert not any(SECRET in v or other in v for v in store.values.values())


def test_a_host_without_a_token_is_refused():
  errors, _ = agree([SECRET, None])
  assert "host 1 was given no join token and this host was" in errors[0]
  assert "host 0 was given a join token and this host was not" in errors[1]


@pytest.mark.parametrize("hashes,odd", [
    (["a", "a", "b"], [2]), (["b", "a", "a", "a"], [0]), (["a", "b"], [0, 1]),
    (["a", "b", "c"], [0, 1, 2]), (["a", "a", "b", "b"], [0, 1, 2, 3])])
def test_odd_hosts_are_those_outside_a_strict_majority(hashes, odd):
  assert integrity.odd_hosts(dict(enumerate(hashes))) == odd
  assert integrity.odd_hosts({h + 3: x for h, x in enumerate(hashes)}) == [h + 3 for h in odd]


def test_collective_exchange_keeps_host_ids():
  """Elastic mode: rows come from the live hosts only (here hosts 0 and 2)."""
  digest, other = "ab" * 32, "cd" * 32

  def allgather(row):
    theirs = np.concatenate([[2], np.frombuffer(bytes.fromhex(other), np.uint32)])
    return np.stack([row, theirs.astype(np.uint32)])

  exchange = integrity.CollectiveExchange(allgather, 0)
  exchange.publish(digest, 5)
  assert not exchange.deferred and exchange.collect(5) == {0: digest, 2: other}


def test_store_exchange_reads_every_host_and_keeps_three_rounds_of_keys():
  store = FakeStore(2)
  exchanges = [integrity.StoreExchange(store, h, 2) for h in (0, 1)]
  for r in (10, 20, 30, 40):
    for h in (0, 1):
      exchanges[h].publish(f"hash{h}-{r}", r)
    assert [e.collect(r) for e in exchanges] == [{0: f"hash0-{r}", 1: f"hash1-{r}"}] * 2
  assert sorted(store.values) == [f"diloco_jax/anchor/{r}/{h}" for r in (20, 30, 40)
                                  for h in (0, 1)]


def test_anchor_check_compares_a_round_late_and_the_last_at_once():
  class Recorder:
    deferred = True

    def __init__(self):
      self.calls = []

    def publish(self, digest, r):
      self.calls.append(("publish", r))

    def collect(self, r):
      self.calls.append(("collect", r))
      return {0: "x", 1: "x"}

  exchange = Recorder()
  check = integrity.AnchorCheck(exchange, every=2, last_round=5, always=False)
  records = [check({"a": np.ones(3)}, r) for r in range(1, 6)]
  assert exchange.calls == [("publish", 2), ("collect", 2), ("publish", 4), ("collect", 4),
                            ("publish", 5), ("collect", 5)]
  assert [sorted(f) for f in records] == [
      [], ["anchor_check_time", "anchor_hash", "anchor_hash_time"], ["anchor_check_time"],
      ["anchor_check_time", "anchor_hash", "anchor_hash_time"],
      ["anchor_check_time", "anchor_hash", "anchor_hash_time"]]


def test_fingerprint_sees_every_bit_shape_and_order(monkeypatch):
  """Chunked and threaded (chunks of 64 bytes here): still one hash of every byte, in order."""
  from diloco_jax.algo import state
  monkeypatch.setattr(state, "_CHUNK", 64)
  rng = np.random.default_rng(0)
  tree = {"a": rng.standard_normal((33, 7)).astype(np.float32), "b": np.arange(5),
          "c": np.zeros((0, 3), np.float32)}
  base = state.fingerprint(tree)
  assert base == state.fingerprint({k: v.copy() for k, v in tree.items()})
  for i in (0, 100, 230):  # a flipped bit in the first, a middle and the last chunk
    flipped = tree["a"].copy()
    flipped.reshape(-1).view(np.uint32)[i] ^= 1 << (i % 32)
    assert state.fingerprint({**tree, "a": flipped}) != base
  assert state.fingerprint({**tree, "c": np.zeros((3, 0), np.float32)}) != base
  assert state.fingerprint({"a": tree["b"], "b": tree["a"], "c": tree["c"]}) != base
