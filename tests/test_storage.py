"""Hosts that share no disk: per-host checkpoints, the resume plan, heals, other host counts.

Checked here in one process (threads stand in for hosts where they must meet): the plan
every host computes from the table of what each holds, the bytes a heal sends, the data
rule after a host-count change, how hosts find out whether they share a workdir, and a
save that hangs. End to end, with processes: tests/test_checkpoint_hosts.py (a SIGKILLed job
resumes bit for bit, a divergence is refused, a wiped host heals) and bench/chaos.py's
smoke in tests/test_bench_faults.py (4 hosts resumed on 3, one wiped, then on 5).
"""

import hashlib
import inspect
import json
import shutil
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

from diloco_jax.algo import state as state_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.checkpoints import store
from diloco_jax.checkpoints import recovery
from diloco_jax.checkpoints import resize
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import per_host
from diloco_jax.checkpoints import shared_dir
from diloco_jax.runtime import workdir as workdir_lib
from tests import multihost

RUN, OTHER = "ab" * 16, "cd" * 16


def held(host, *rounds, sha=None, run=RUN):
  return [recovery.Held(r, host, sha or f"{r:064x}", run) for r in rounds]


def test_the_table_round_trips_through_int32_words():
  rows = held(1, 7, 6, sha="f" * 64) + held(1, 5, run="0" * 31 + "1")
  table = recovery.encode(rows, [9, 8])
  assert table.dtype == np.int32
  assert recovery.decode(table) == (rows, [9, 8])


def test_the_plan_resumes_from_the_newest_round_every_holder_holds():
  # host 1 was killed while writing checkpoint 6; host 2's disk was wiped
  p = recovery.plan([(held(0, 6, 5, 4), []), (held(1, 5, 4), []), ([], [])])
  assert (p.round, p.source, p.heal, p.run_id) == (5, 0, (2,), RUN)
  assert p.sha == f"{5:064x}"
  assert recovery.plan([(held(0, 6, 5), []), (held(1, 6, 5), [])]).heal == ()
  # no round in common: the newest, and whoever lacks it heals
  p = recovery.plan([(held(0, 8, 7), []), (held(1, 3), [])])
  assert (p.round, p.source, p.heal) == (8, 0, (1,))
  # a host back with older checkpoints (a round in common, but two saves behind) heals
  # rather than roll the others back
  p = recovery.plan([(held(0, 22, 21, 20), []), (held(1, 22, 21, 20), []), (held(2, 20, 19), [])])
  assert (p.round, p.heal) == (22, (2,))
  # a checkpoint written by another host id is not this host's: it heals
  assert recovery.plan([(held(0, 4), []), (held(0, 4), [])]).heal == (1,)
  assert recovery.plan([([], []), ([], [])]).round == 0  # a new run


def test_the_plan_refuses_what_it_cannot_resume_safely():
  with pytest.raises(store.CheckpointError,
                     match=r"round 5: hosts 0, 2: sha256 0{12}; host 1: sha256 f{12}\. "):
    recovery.plan([(held(0, 5), []), (held(1, 5, sha="f" * 64), []), (held(2, 5), [])])
  with pytest.raises(store.CheckpointError,
                     match=r"^host 1: checkpoints of another run \(run cdcdcdcd, "
                           r"rounds \[3\]\) than hosts 0, 2 \(run abababab\)"):
    recovery.plan([(held(0, 5), []), (held(1, 3, run=OTHER), []), (held(2, 5), [])])
  with pytest.raises(store.CheckpointError,
                     match=r"no host in this job holds a usable checkpoint to resume or heal "
                           r"from: host 1 cannot read rounds \[4, 3\]"):
    recovery.plan([([], []), ([], [4, 3])])


def test_a_tree_survives_its_file_and_a_wrong_layout_is_named(tmp_path):
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int32(7),
          "c": np.array([-0.0, np.nan], np.float32), "d": np.zeros((3, 0), np.float32),
          "e": np.arange(3).astype(jnp.bfloat16)}  # safetensors' numpy has no bfloat16
  path = str(tmp_path / "x.safetensors")
  record = files.write(path, tree)
  back = files.to_tree(files.read(path, record), tree, record, path)
  assert state_lib.fingerprint(back) == state_lib.fingerprint(tree)  # -0.0 and NaN too
  with safetensors.safe_open(path, "np") as f:  # any safetensors reader lists the leaves
    assert sorted(f.keys()) == ["['a']", "['b']", "['c']", "['d']", "['e']"]
  wrong = {**tree, "a": np.zeros((3, 2), np.float32)}
  with pytest.raises(store.CheckpointError,
                     match=r"x.safetensors: leaf \['a'\] is float32\[2, 3\], this run's "
                           r"state float32\[3, 2\]$"):
    files.to_tree(files.read(path, record), wrong, record, path)
  with pytest.raises(store.CheckpointError, match=r"has no leaf \['f'\]"):
    files.to_tree(files.read(path, record), {**tree, "f": np.int32(1)}, record, path)
  with pytest.raises(store.CheckpointError, match=r"holds leaves this run's state does not "
                                                  r"have: \['e'\]$"):
    files.to_tree(files.read(path, record), {k: v for k, v in tree.items() if k != "e"},
                  record, path)


class FakeJob:
  """`hosts` threads that meet in every collective, as processes would. A host that skips
  a collective or dies leaves the others at the barrier: after TIMEOUT_S it breaks and
  `run` fails naming the hosts, instead of hanging the suite."""

  TIMEOUT_S = 10  # the hosts meet within milliseconds

  def __init__(self, hosts):
    self.hosts, self.rows = hosts, {}
    self.barrier = threading.Barrier(hosts, timeout=self.TIMEOUT_S)

  def _meet(self, host, x, combine):
    self.rows[host] = x if x is None or isinstance(x, list) else np.asarray(x)
    self.barrier.wait()
    out = combine([self.rows[h] for h in range(self.hosts)])
    self.barrier.wait()  # nobody overwrites a row before everyone has read it
    return out

  def run(self, fn):
    results, failures = [None] * self.hosts, {}

    def host(h):
      try:
        results[h] = fn(h)
      except BaseException as e:  # noqa: BLE001 -- reported by the test's thread below
        failures[h] = e
        self.barrier.abort()  # the others stop waiting for this host

    threads = [threading.Thread(target=host, args=(h,)) for h in range(self.hosts)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=2 * self.TIMEOUT_S)
    stuck = [h for h, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"hosts {stuck} still running after {2 * self.TIMEOUT_S} s"
    if failures:
      raise AssertionError("hosts failed: " + "; ".join(
          f"host {h}: {type(e).__name__}: {e}" for h, e in sorted(failures.items())))
    return results


def test_broadcast_carries_bytes_unchanged_through_integer_sums(monkeypatch):
  """ddp's heal (jax.distributed has no point to point): HostCollective.broadcast."""
  from types import SimpleNamespace
  from diloco_jax.wire import collective as collective_lib
  monkeypatch.setattr(collective_lib, "BROADCAST_BYTES", 100)  # several chunks, one short
  payload = bytes(range(256)) * 3 + b"\x01"
  job = FakeJob(3)

  def host(h):
    c = SimpleNamespace(
        host_index=h,
        sum=lambda tree: {"bytes": job._meet(h, tree["bytes"], lambda rows: sum(rows))},
        allgather=lambda x: job._meet(h, x, np.stack))
    return collective_lib.HostCollective.broadcast(c, [payload] if h == 1 else None, 1)[0]
  got = job.run(host)
  assert got == [payload] * 3


def test_after_a_host_count_change_every_replica_reads_a_disjoint_new_shard(tmp_path):
  """4 hosts x 2 replicas become 3 x 2: the data is cut into 6 shards, every replica
  starts a new pass (resize.py), and within that pass no sequence is read by two replicas."""
  config = multihost.small_config(replicas_per_host=2)
  seen = []
  for host in range(3):
    data = data_lib.make_host_data(config.data, seq_len=config.model.seq_len,
                                   batch_size=config.batch_size, replicas_per_host=2,
                                   num_eval_batches=1, host_index=host, num_hosts=3)
    per_pass = config.data.num_sequences // 6 // config.batch_size
    batches = np.stack([data.next_batch() for _ in range(per_pass)])  # [T, R, B, L+1]
    for r in range(2):
      seen.append({row.tobytes() for row in batches[:, r].reshape(-1, batches.shape[-1])})
  for i in range(len(seen)):
    for j in range(i):
      assert not seen[i] & seen[j], (i, j)
  world = resize.Change(4, 3, ())
  assert world.changed and world.partial
  assert "cut into 6 shards" in world.message(9, replicas_per_host=2, inflight=True)
  with pytest.raises(store.CheckpointError, match="mode 'eager' keeps an outer state"):
    resize.check_mode(resize.Change(2, 2, (1,)), "eager", "checkpoint 3")
  resize.check_mode(resize.Change(2, 2, ()), "eager", "checkpoint 3")


def test_launcher_needs_a_workdir_to_split():
  text = multihost.start([sys.executable, "launch/local.py", "--hosts=2", "--workdir_per_host",
                          "--", "--config=configs/tiny.py"]).communicate(timeout=60)[0]
  assert "--workdir_per_host needs the trainer's --workdir=DIR" in text


@pytest.mark.parametrize("dirs,shared", [("aaa", True), ("abc", False), ("aab", None)],
                         ids=["one-shared", "one-per-host", "mixed"])
def test_hosts_find_out_whether_they_share_the_workdir(tmp_path, dirs, shared):
  """Host 0's nonce in its lock, looked for by every other host in its own workdir."""
  job = FakeJob(3)
  for d in set(dirs):
    (tmp_path / d).mkdir()

  def claim(h):
    try:
      return workdir_lib.claim(str(tmp_path / dirs[h]), host=h, num_hosts=3,
                               allgather=lambda x: job._meet(h, x, np.stack),
                               restart_from_scratch=False)
    except workdir_lib.WorkdirInUseError as e:
      return e

  claims = job.run(claim)
  try:
    if shared is None:
      assert all(isinstance(c, workdir_lib.WorkdirInUseError) for c in claims)
      assert "hosts [0, 1] share one --workdir and hosts [2] each have their own" in str(claims[0])
      assert not (tmp_path / "a" / workdir_lib.LOCK).exists()  # released
    else:
      assert [c.shared for c in claims] == [shared] * 3
      locked = [c.lock is not None for c in claims]
      assert locked == ([True, False, False] if shared else [True, True, True])
  finally:
    for c in claims:
      if isinstance(c, workdir_lib.Claim):
        c.release()


def test_a_save_that_hangs_stops_the_run_within_its_timeout(tmp_path, monkeypatch):
  """A host's own save never waits for a peer; one whose disk hangs fails after
  config.checkpoint.timeout with one line, the checkpoints before it intact."""
  from diloco_jax.wire import collective as collective_lib
  ckpt = per_host.PerHostStore(str(tmp_path), host=0, keep=2, dispatcher=None,
                                            collective=collective_lib.LocalCollective(),
                                            timeout=1)
  snap = store.Snapshot(1, {"anchor": np.arange(4, dtype=np.float32)},
                             {"replicas": np.ones((2, 3), np.float32)}, {"round": 1})
  ckpt.save(snap)
  ckpt.wait()
  assert ckpt.steps() == [1]
  hang = threading.Event()
  monkeypatch.setattr(per_host.files, "write", lambda *_: hang.wait())
  ckpt.save(store.Snapshot(2, snap.shared, snap.own, {"round": 2}))
  t = time.monotonic()
  with pytest.raises(store.CheckpointError,
                     match=r"^checkpoint 2 was not on disk in .* after 1 s \(config.checkpoint"
                           r".timeout\): the disk may hang. The checkpoints before it are intact$"):
    ckpt.wait()
  assert time.monotonic() - t < 5
  hang.set()
  assert ckpt.steps()[-1] == 1
  back = ckpt.read(1, lambda meta: snap)
  assert back.shared["anchor"].tolist() == [0, 1, 2, 3] and back.meta["host"] == 0


# A host's own checkpoints (checkpoints/per_host.py, files.py): every file checked by
# sha256 before use, and one policy for what cannot be read (checkpoints/store.py).

class Inline:
  """A dispatcher that runs each job on the calling thread (a thread stands in for a host)."""

  @staticmethod
  def run(fn, *args, what=None):
    del what
    return fn(*args)


def host_stores(tmp_path, job, hosts=2):
  """A PerHostStore per host, each with its workdir, meeting the others through `job`."""
  from types import SimpleNamespace
  out = []
  for h in range(hosts):
    collective = SimpleNamespace(
        live=list(range(hosts)), allgather=lambda x, h=h: job._meet(h, x, np.stack),
        broadcast=lambda parts, source, h=h: job._meet(h, parts, lambda rows: rows[source]),
        sum=lambda tree, h=h: {"bytes": job._meet(h, tree["bytes"], lambda rows: sum(rows))})
    s = per_host.PerHostStore(str(tmp_path / f"host{h}"), host=h, keep=3, dispatcher=Inline,
                              collective=collective)
    out.append(s)
  return out


def snapshot(r, host):
  """Round r's snapshot on `host`: the shared state the same on every host, `own` not."""
  return store.Snapshot(r, {"anchor": np.arange(5, dtype=np.float32) * r, "step": np.int32(r)},
                        {"replicas": np.full((2, 3), 10 * host + r, np.float32),
                         "data": store.encode_json([{"next_index": r}])},
                        {"round": r, "run_id": RUN})


def like(meta):
  return snapshot(meta["round"], 0)


def damage(path, offset=None):
  """Overwrites 4 bytes in the middle of the file (or at `offset`)."""
  raw = bytearray(path.read_bytes())
  i = len(raw) // 2 if offset is None else offset
  raw[i:i + 4] = bytes(255 - b for b in raw[i:i + 4])
  path.write_bytes(bytes(raw))


def saved(stores, *rounds):
  for r in rounds:
    for h, s in enumerate(stores):
      s.save(snapshot(r, h))
      s.wait()


def test_a_changed_byte_in_any_file_of_a_checkpoint_is_named(tmp_path):
  """Each file's sha256 is checked before its bytes are used: 4 bytes overwritten in the
  middle of either .safetensors file, or one digit of meta.json, is an error naming the
  file; the same bytes put back read again."""
  (s,) = host_stores(tmp_path, FakeJob(1), hosts=1)
  saved([s], 1)
  directory = tmp_path / "host0" / store.CHECKPOINTS / "1"
  assert sorted(p.name for p in directory.iterdir()) == [
      "meta.json", "own.safetensors", "shared.safetensors"]
  meta = json.loads((directory / "meta.json").read_text())
  for name in ("shared.safetensors", "own.safetensors"):
    record = meta["files"][name]
    assert record["sha256"] == hashlib.sha256((directory / name).read_bytes()).hexdigest()
    good = (directory / name).read_bytes()
    damage(directory / name)
    with pytest.raises(store.CheckpointError,
                       match=rf"^{directory / name}: sha256 mismatch \(meta.json records "
                             rf"{record['sha256'][:12]}, the bytes read hash to \w{{12}}\)"):
      s.read(1, like)
    (directory / name).write_bytes(good)
  good = (directory / "meta.json").read_text()
  (directory / "meta.json").write_text(good.replace('"round": 1', '"round": 2'))
  with pytest.raises(store.CheckpointError, match=rf"^{directory / 'meta.json'}: sha256 mismatch"):
    s.read(1, like)
  (directory / "meta.json").write_text(good)
  back = s.read(1, like)
  assert state_lib.fingerprint(back.shared) == state_lib.fingerprint(snapshot(1, 0).shared)
  assert state_lib.fingerprint(back.own) == state_lib.fingerprint(snapshot(1, 0).own)


def test_a_damaged_checkpoint_is_named_once_never_used_and_moved_aside(tmp_path, capsys):
  """Host 1's newest own file damaged: named in one line, both hosts resume from the
  round before (which both hold), and it is moved to checkpoints_unreadable/."""
  job = FakeJob(2)
  stores = host_stores(tmp_path, job)
  saved(stores, 1, 2)
  own = tmp_path / "host1" / store.CHECKPOINTS / "2" / "own.safetensors"
  damage(own)
  damaged = own.read_bytes()
  snaps = job.run(lambda h: stores[h].restore(like, lambda meta: None))
  assert [s.round for s in snaps] == [1, 1]
  assert [float(s.own["replicas"][0, 0]) for s in snaps] == [1, 11]
  assert [s.recovered.healed for s in stores] == [(), ()]
  lines = [line for line in capsys.readouterr().out.splitlines() if str(own) in line]
  assert len(lines) == 1 and lines[0].startswith(f"host 1: checkpoint 2 not used: {own}: "
                                                 f"sha256 mismatch"), lines
  assert stores[1].steps() == [1] and stores[0].steps() == [2, 1]
  (aside,) = (tmp_path / "host1" / store.UNREADABLE).iterdir()  # kept, not deleted
  assert aside.name.startswith("2-") and (aside / "own.safetensors").read_bytes() == damaged


def test_a_host_whose_only_checkpoint_is_damaged_heals_from_a_peer(tmp_path, capsys):
  """Host 1 holds round 2 only, its shared file damaged: it heals from host 0, which
  sends its shared file's bytes; the receiver checks them against host 0's sha256."""
  job = FakeJob(2)
  stores = host_stores(tmp_path, job)
  saved(stores, 1, 2)
  shutil.rmtree(tmp_path / "host1" / store.CHECKPOINTS / "1")
  shared = tmp_path / "host1" / store.CHECKPOINTS / "2" / "shared.safetensors"
  damage(shared)
  snaps = job.run(lambda h: stores[h].restore(like, lambda meta: None))
  assert [s.round for s in snaps] == [2, 2] and snaps[1].own is None
  assert state_lib.fingerprint(snaps[1].shared) == state_lib.fingerprint(snaps[0].shared)
  sent = (tmp_path / "host0" / store.CHECKPOINTS / "2" / "shared.safetensors").stat().st_size
  assert (stores[1].recovered.healed, stores[1].recovered.bytes) == ((1,), sent)
  out = capsys.readouterr().out
  assert f"host 1: checkpoint 2 not used: {shared}: sha256 mismatch" in out
  assert "host 1 healed from host 0" in out


def restored(job, stores):
  """Each host's restore: its snapshot, or the CheckpointError it raised."""
  def attempt(h):
    try:
      return stores[h].restore(like, lambda meta: None)
    except store.CheckpointError as e:
      return e
  return job.run(attempt)


def test_nothing_readable_is_refused_and_nothing_is_moved(tmp_path):
  job = FakeJob(2)
  stores = host_stores(tmp_path, job)
  saved(stores, 1)
  for h in range(2):
    damage(tmp_path / f"host{h}" / store.CHECKPOINTS / "1" / "shared.safetensors")
  for error in restored(job, stores):  # the same refusal on every host
    assert isinstance(error, store.CheckpointError)
    assert str(error).startswith("no host in this job holds a usable checkpoint to resume or "
                                 "heal from: host 0 (")
  assert [s.steps() for s in stores] == [[1], [1]]
  assert not (tmp_path / "host0" / store.UNREADABLE).exists()


def test_a_checkpoint_of_the_first_format_is_refused_naming_its_directory(tmp_path, capsys):
  (s,) = host_stores(tmp_path, FakeJob(1), hosts=1)
  saved([s], 1, 2)
  for r in (1, 2):
    (tmp_path / "host0" / store.CHECKPOINTS / str(r) / "meta.json").write_text(
        json.dumps({"format": "diloco_jax.host_checkpoint/1", "round": r}))
  (error,) = restored(FakeJob(1), [s])
  assert f"host 0 ({s.directory}) cannot read rounds [2, 1]" in str(error)
  (line,) = [x for x in capsys.readouterr().out.splitlines() if "format" in x]
  assert line == (f"host 0: checkpoint(s) [2, 1] in {s.directory} not used: a checkpoint of "
                  f"format 'diloco_jax.host_checkpoint/1'; this version reads "
                  f"'{files.FORMAT}' only (format 1: written by an earlier diloco_jax, "
                  f"which resumes it)")


def test_the_table_holds_any_number_of_checkpoints():
  rows = held(0, *range(40, 0, -1))  # more than any fixed number of slots
  table = recovery.encode(rows, list(range(60, 41, -1)), rows=70)
  assert table.shape == (71, recovery.WORDS)
  assert recovery.decode(table) == (rows, list(range(60, 41, -1)))


def test_both_stores_declare_the_store_protocol():
  members = [m for m in vars(store.Store) if not m.startswith("_")] + list(
      store.Store.__annotations__)
  assert sorted(members) == ["close", "directory", "recovered", "restore", "save", "wait",
                             "write_seconds"]
  for cls in (shared_dir.SharedDirStore, per_host.PerHostStore):
    for name in ("save", "wait", "close", "restore"):
      assert (inspect.signature(getattr(cls, name)).parameters.keys()
              == inspect.signature(getattr(store.Store, name)).parameters.keys()), (cls, name)
  assert shared_dir.SharedDirStore.recovered is None
