"""The multi-host runtime in parts: dispatcher, start-up resolution, config agreement, and
the cross-host collective against numpy."""

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from diloco_jax.runtime import cluster
from diloco_jax.runtime import hostmem
from diloco_jax.wire import collective
from diloco_jax.wire import dispatch
from tests import multihost


def test_dispatcher_runs_jobs_in_order_on_one_thread():
  seen = []
  with dispatch.Dispatcher() as d:
    futures = [d.submit(lambda i=i: (time.sleep(0.01 * (5 - i)), seen.append(
        (i, threading.current_thread().name)))[1], round_=i) for i in range(5)]
    for f in futures:
      f.result(timeout=10)
  assert [i for i, _ in seen] == list(range(5))
  assert {name for _, name in seen} == {"diloco-dispatch"}


def test_dispatcher_error_names_round_and_fails_later_jobs():
  # Only the test's own error may end the block: a CollectiveError (a RuntimeError) raised
  # early would skip every check inside it.
  with pytest.raises(RuntimeError, match="^the trainer stops$"):
    with dispatch.Dispatcher() as d:
      def boom():
        raise ConnectionError("Connection closed by peer")
      bad = d.submit(boom, round_=7, what="cross-host sum")
      later = d.submit(lambda: 1, round_=8)
      with pytest.raises(dispatch.CollectiveError, match=r"cross-host sum failed in round 7: "
                                                         r"ConnectionError"):
        bad.result(timeout=10)
      with pytest.raises(dispatch.CollectiveError, match="round 7"):  # no new collective
        later.result(timeout=10)
      assert d.failed
      raise RuntimeError("the trainer stops")  # __exit__ must not wait for a stuck job


def test_dispatcher_close_waits_for_queued_jobs():
  d = dispatch.Dispatcher()
  f = d.submit(time.sleep, 0.2)
  assert d.close(timeout=10)
  assert f.done()
  with pytest.raises(RuntimeError, match="after close"):
    d.submit(print)


def test_single_host_needs_no_flags(monkeypatch):
  for var in ("DILOCO_COORDINATOR_ADDRESS", "DILOCO_NUM_HOSTS", "DILOCO_HOST_ID",
              "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
    monkeypatch.delenv(var, raising=False)
  assert cluster.initialize(cluster.Cluster()) is False
  assert cluster.initialize(cluster.Cluster(num_hosts=1)) is False


def test_the_start_picks_each_jobs_path(monkeypatch):
  """One host: a world of its own, nothing started. Several: ddp on jax.distributed (it
  needs --coordinator_address, and says it leaves --membership unused), every DiLoCo mode
  under live membership (it needs a coordinator's address). Each refusal is one line."""
  from diloco_jax import config as config_lib
  from diloco_jax.membership import start as start_lib
  for var in ("DILOCO_COORDINATOR_ADDRESS", "DILOCO_NUM_HOSTS", "DILOCO_HOST_ID",
              "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
    monkeypatch.delenv(var, raising=False)
  config = config_lib.get_default_config()
  world = start_lib.start(config, cluster.Cluster())
  assert (world.host, world.num_hosts, world.live) == (0, 1, False)
  for mode in ("sync", "delayed", "eager", "streaming"):
    config.mode = mode
    with pytest.raises(cluster.StartupError, match="several hosts need --coordinator_address"):
      start_lib.start(config, cluster.Cluster(num_hosts=2, host_id=1))
  config.mode = "ddp"
  with pytest.raises(cluster.StartupError, match="over jax.distributed: give "
                                                 "--coordinator_address"):
    start_lib.start(config, cluster.Cluster(num_hosts=2, host_id=1),
                    start_lib.Options(membership="127.0.0.1:1"))


def test_a_host_waits_for_the_coordinators_port_not_for_grpcs_backoff():
  """A host other than 0 connects once host 0's service listens (polled every 10 ms), so
  that gRPC's first refused connect, retried only after a 1 s backoff, never happens; a
  port that never opens is left to JAX's own error after the timeout."""
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  listener = socket.socket()
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  opened = threading.Event()

  def open_later():
    time.sleep(0.3)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    opened.set()

  threading.Thread(target=open_later, daemon=True).start()
  try:
    cluster._wait_for_coordinator(f"127.0.0.1:{port}", 30)  # pylint: disable=protected-access
    assert opened.is_set()
  finally:
    listener.close()
  t = time.monotonic()
  cluster._wait_for_coordinator(f"127.0.0.1:{port}", 0.2)  # pylint: disable=protected-access
  assert time.monotonic() - t >= 0.2  # gave up: nothing listens


def test_huge_pages_environment_for_a_host_launched_with_it():
  """A launcher passes the tunable that the trainer would otherwise start itself again
  for; a user's own setting (the opt-out `hugetlb=0` included) is kept."""
  env = hostmem.with_huge_pages({"A": "1"})
  wanted = (sys.platform.startswith("linux") and hostmem._malloc_trim() is not None  # pylint: disable=protected-access
            and hostmem._thp_mode() == "madvise")  # pylint: disable=protected-access
  assert env == ({"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} if wanted else {"A": "1"})
  assert hostmem.with_huge_pages(env) == env
  own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
  assert hostmem.with_huge_pages(own) == own
  other = hostmem.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  assert other["GLIBC_TUNABLES"] == ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
                                     if wanted else "glibc.malloc.arena_max=2")


def test_cluster_from_environment(monkeypatch):
  monkeypatch.setenv("DILOCO_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("DILOCO_NUM_HOSTS", "4")
  monkeypatch.setenv("DILOCO_HOST_ID", "3")
  c = cluster.Cluster(host_id=2).resolved()  # a flag wins over the environment
  assert (c.coordinator_address, c.num_hosts, c.host_id) == ("10.0.0.1:1234", 4, 2)
  monkeypatch.setenv("DILOCO_NUM_HOSTS", "four")
  with pytest.raises(cluster.StartupError, match="DILOCO_NUM_HOSTS='four'"):
    cluster.Cluster().resolved()


@pytest.mark.parametrize("spec, message", [
    (cluster.Cluster("127.0.0.1:1", num_hosts=2, host_id=2), "--host_id=2"),
    (cluster.Cluster("127.0.0.1:1", num_hosts=0, host_id=0), "--num_hosts=0"),
    (cluster.Cluster("127.0.0.1:1", 2, 0, initialization_timeout=0),
     "--initialization_timeout=0"),
])
def test_bad_cluster_flags(spec, message):
  with pytest.raises(cluster.StartupError, match=message):
    cluster.initialize(spec)


def test_differing_fields():
  a = {"config.outer.lr": 0.7, "config.seed": 0, "diloco_jax": "0.1.0"}
  b = {"config.outer.lr": 0.5, "config.seed": 0, "diloco_jax": "0.2.0"}
  assert cluster.differing_fields([a, a]) == {}
  assert cluster.differing_fields([a, b, a]) == {
      "config.outer.lr": [0.7, 0.5, 0.7], "diloco_jax": ["0.1.0", "0.2.0", "0.1.0"]}


def test_pack_unpack_round_trip():
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.float32(2.5)],
          "c": np.arange(4, dtype=np.int32)}
  flat, layout = collective._pack(tree)
  assert sorted(str(dt) for dt in flat) == ["float32", "int32"]  # one buffer per dtype
  back = collective._unpack(flat, layout)
  np.testing.assert_array_equal(back["a"], tree["a"])
  np.testing.assert_array_equal(back["b"][0], tree["b"][0])
  np.testing.assert_array_equal(back["c"], tree["c"])


COLLECTIVE_HOST = textwrap.dedent("""
    import sys
    import numpy as np
    from diloco_jax.runtime import cluster
    host, port = int(sys.argv[1]), sys.argv[2]
    cluster.initialize(cluster.Cluster(f"127.0.0.1:{port}", 3, host,
                                               initialization_timeout=60))
    from diloco_jax.wire import collective
    c = collective.make_collective()
    assert isinstance(c, collective.HostCollective) and c.num_hosts == 3
    rng = np.random.default_rng(host)
    tree = {"w": rng.normal(size=(5, 7)).astype(np.float32), "n": np.int32(host + 1)}
    total = c.sum(tree)
    # Independent reference: every host's tree, regenerated from the seeds.
    ref = [np.random.default_rng(h).normal(size=(5, 7)).astype(np.float32) for h in range(3)]
    np.testing.assert_allclose(total["w"], ref[0] + ref[1] + ref[2], rtol=1e-6)
    assert int(total["n"]) == 1 + 2 + 3
    np.testing.assert_allclose(c.mean(tree)["w"], (ref[0] + ref[1] + ref[2]) / 3, rtol=1e-6)
    gathered = c.allgather(np.array([host, 10 * host], np.uint32))
    np.testing.assert_array_equal(gathered, [[0, 0], [1, 10], [2, 20]])
    # Ring all-reduce of 35 floats + 1 int32 (two buffers), twice, then an all-gather.
    expected = 2 * (2 * 2 * 35 * 4 // 3 + 2 * 2 * 4 // 3) + 2 * 8
    assert c.bytes_sent == expected, (c.bytes_sent, expected)
    np.save(sys.argv[3] + f"/sum{host}.npy", total["w"])
    # Encoded sums: the protocol restated on all three hosts' vectors (regenerated).
    from diloco_jax.algo import compress
    xs = [np.random.default_rng(10 + h).normal(size=1000).astype(np.float32) for h in range(3)]
    chunk = 512  # ceil(1000 / 3) = 334, rounded up to whole 256-entry blocks
    for fmt, ratio in (("int8", 0.27), ("4bit", 0.15)):
      before = c.bytes_sent
      got, carried = c.reduce_encoded(xs[host][None], fmt)
      padded = [np.pad(x, (0, 3 * chunk - 1000)).reshape(3, chunk) for x in xs]
      rt = lambda v: compress.decode(compress.encode(v, fmt))
      reduced = [rt(v) for v in [sum(rt(p[i]) for p in padded) for i in range(3)]]
      np.testing.assert_array_equal(got, np.concatenate(reduced)[:1000])
      np.testing.assert_array_equal(carried[0], rt(padded[host].ravel())[:1000])
      exact = xs[0] + xs[1] + xs[2]
      assert np.abs(got - exact).max() < 4 * np.abs(exact).max() / (2 * {"int8": 127, "4bit": 7}[fmt])
      sent = c.bytes_sent - before
      assert sent <= ratio * (2 * 2 * 4 * 3 * chunk // 3), (fmt, sent)  # vs a float32 ring
      np.save(sys.argv[3] + f"/{fmt}{host}.npy", got)
    # Robust aggregation in the same layout: 2 replicas per host, host 2's second replica
    # sends Δ x 1e6; each host trims its chunk's 6 values per coordinate.
    import jax.numpy as jnp
    from diloco_jax.algo import aggregate
    honest = lambda h, m: 1.0 + 0.01 * np.random.default_rng(20 + 2 * h + m).normal(
        size=1000).astype(np.float32)
    mine = np.stack([honest(host, m) * (1e6 if (host, m) == (2, 1) else 1) for m in (0, 1)])
    trimmed = lambda rows: np.asarray(aggregate.aggregate(jnp.asarray(rows), "trimmed_mean",
                                                          trim=0.2))
    got, _ = c.reduce_encoded(mine, "int8", trimmed)
    # The protocol restated on every host's rows (regenerated): chunk i of each row
    # round-trips through int8, chunk i's 6 rows (host-major) are trimmed, the result
    # round-trips again. Exact: a lost or misplaced row moves the result by a few thousandths.
    rt8 = lambda v: compress.decode(compress.encode(v, "int8"))
    rows = [[np.pad(honest(h, m) * (1e6 if (h, m) == (2, 1) else 1), (0, 3 * chunk - 1000))
             .reshape(3, chunk) for m in (0, 1)] for h in range(3)]
    want = np.concatenate([rt8(trimmed(np.stack([rt8(rows[h][m][i]) for h in range(3)
                                                 for m in (0, 1)]))) for i in range(3)])
    np.testing.assert_array_equal(got, want[:1000])
    np.save(sys.argv[3] + f"/trimmed{host}.npy", got)
    print("ok")
""")


@pytest.mark.multihost
def test_host_collective_three_hosts(tmp_path):
  port = multihost.free_port()
  procs = [multihost.start([sys.executable, "-c", COLLECTIVE_HOST, str(h), str(port),
                            str(tmp_path)]) for h in range(3)]
  for code, text in multihost.finish(procs, timeout=120):
    assert code == 0 and "ok" in text, text[-3000:]
  for name in ("sum", "int8", "4bit", "trimmed"):
    sums = [np.load(tmp_path / f"{name}{h}.npy") for h in range(3)]
    for s in sums[1:]:  # every host received the same bytes
      assert s.tobytes() == sums[0].tobytes()


TRIM_CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from diloco_jax.runtime import hostmem

    def rss_mb():
      with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    chunks, keepers = [], []
    for _ in range(3000):  # 64 KiB: below malloc's mmap threshold, so from the heap
      chunks.append(bytearray(64 << 10))
      keepers.append(bytearray(600))
    del chunks
    freed = rss_mb()
    hostmem.trim()
    print(f"trimmed {freed - rss_mb():.0f} MB")
""")


RELEASE_CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    from diloco_jax.runtime import hostmem

    def file_mb():
      with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile")) / 1024

    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
    x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) / 4096
    before = np.asarray(step(x))
    mapped = file_mb()
    released = hostmem.release_file_pages() / 1024
    after_release = file_mb()
    again = np.asarray(step(x))  # the same program, its code read back from the file
    fresh = np.asarray(jax.jit(lambda x: jnp.sin(x).sum(axis=0))(x))  # the compiler's too
    print(f"{mapped:.0f} {released:.0f} {after_release:.0f} "
          f"{int(again.tobytes() == before.tobytes())} {int(np.allclose(fresh, np.sin(np.asarray(x)).sum(0), atol=1e-5))}")
""")


def test_release_file_pages_drops_the_compilers_code_and_the_process_runs_on():
  """After compiling, most of jaxlib's mapped code is the compiler's: released, the RSS of
  mapped files falls by most of what it was, and the process runs its compiled program
  (same bytes) and compiles another, its code read back from the file."""
  if hostmem._madvise() is None:  # pylint: disable=protected-access
    pytest.skip("no madvise in the C library")
  out = subprocess.run([sys.executable, "-c", RELEASE_CHECK, multihost.REPO],
                       capture_output=True, text=True, timeout=120, check=True).stdout
  mapped, released, after, same, ok = (int(v) for v in out.split())
  assert mapped > 80 and released > 0.7 * mapped and after < 0.3 * mapped, out
  assert same == 1 and ok == 1, out


def test_trim_releases_file_pages_only_after_a_compile():
  """A trim releases the libraries' pages only if jax compiled something since the last
  one: steady rounds, which compile nothing, keep the code they run."""
  import jax  # pylint: disable=import-outside-toplevel
  hostmem.trim()
  assert not hostmem._compiled  # pylint: disable=protected-access
  np.asarray(jax.jit(lambda x: x * 3 + 1)(np.arange(5.0)))  # a program compiled anew
  assert hostmem._compiled  # pylint: disable=protected-access
  hostmem.trim()
  assert not hostmem._compiled  # pylint: disable=protected-access


def test_release_file_pages_keeps_what_cannot_be_read_back(tmp_path):
  """Only clean pages of private read-only file mappings are released: writable, shared,
  copied-on-write (relocated constants), anonymous, device and deleted-file mappings stay."""
  smaps = tmp_path / "smaps"
  entries = [
      ("7f0000000000-7f0000100000 r-xp 00000000 08:01 11 /usr/lib/libcode.so", 0, 0, True),
      ("7f0000100000-7f0000200000 r--p 00100000 08:01 11 /usr/lib/libcode.so", 0, 0, True),
      ("7f0000200000-7f0000210000 r--p 00200000 08:01 11 /usr/lib/libcode.so", 64, 64, False),
      ("7f0000210000-7f0000220000 rw-p 00210000 08:01 11 /usr/lib/libcode.so", 0, 0, False),
      ("7f0000300000-7f0000400000 r--s 00000000 08:01 12 /data/shard.bin", 0, 0, False),
      ("7f0000400000-7f0000500000 r--p 00000000 00:00 0 ", 0, 0, False),
      ("7f0000500000-7f0000600000 r--p 00000000 00:05 13 /dev/nvidia0", 0, 0, False),
      ("7f0000600000-7f0000700000 r-xp 00000000 08:01 14 /tmp/gone.so (deleted)", 0, 0, False),
  ]
  with open(smaps, "w") as f:
    for head, dirty, anon, _ in entries:
      f.write(f"{head}\nSize:               1024 kB\nRss:                 512 kB\n"
              f"Private_Dirty:  {dirty:8d} kB\nAnonymous:      {anon:8d} kB\n"
              f"Swap:                  0 kB\nVmFlags: rd ex mr mw me\n")
  mappings = list(hostmem._mappings(str(smaps)))  # pylint: disable=protected-access
  assert [m["start"] for m in mappings] == [int(e[0].split("-")[0], 16) for e in entries]
  assert mappings[0]["Rss"] == 512 and mappings[2]["Private_Dirty"] == 64
  got = [hostmem._releasable(m) for m in mappings]  # pylint: disable=protected-access
  assert got == [e[3] for e in entries]


def test_trim_returns_freed_memory_to_the_os():
  """`hostmem.trim` hands back what malloc keeps after a free: 190 MB freed between
  allocations that stay alive (so the heap cannot simply shrink) leave the RSS until the
  trim. In a fresh interpreter: in pytest's own, after hundreds of tests, the chunks land
  in whatever free space earlier tests left, and what the trim returns varies (CI once
  saw 30 MB)."""
  if hostmem._malloc_trim() is None:  # pylint: disable=protected-access
    pytest.skip("not glibc: nothing to trim")
  out = subprocess.run([sys.executable, "-c", TRIM_CHECK, multihost.REPO], capture_output=True,
                       text=True, timeout=60, check=True).stdout
  assert int(out.split()[1]) > 100, out

def test_a_settled_start_frees_its_garbage_and_keeps_the_rest_out_of_every_walk():
  code = textwrap.dedent("""
      import gc, weakref
      from diloco_jax.runtime import collector
      class Node: pass
      kept, lost = Node(), Node()
      kept.me, lost.me = kept, lost  # two cycles: one still referenced, one garbage
      gone = weakref.ref(lost)
      del lost
      collector.settled()
      assert gone() is None, "garbage frozen with what is kept"
      assert gc.get_freeze_count() > 0
      assert not any(o is kept for o in gc.get_objects()), "a kept object is walked"
      collector.released()
      assert gc.get_freeze_count() == 0 and any(o is kept for o in gc.get_objects())
      print("ok")""")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "ok", out.stderr
