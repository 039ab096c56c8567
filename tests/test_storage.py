"""Hosts that share no disk: per-host checkpoints, the resume plan, heals, other host counts.

Checked here in one process (threads stand in for hosts where they must meet): the plan
every host computes from the table of what each holds, the bytes a heal sends, the data
rule after a host-count change, how hosts find out whether they share a workdir, and a
save that hangs. End to end, with processes: tests/test_checkpoint.py (a SIGKILLed job
resumes bit for bit, a divergence is refused, a wiped host heals) and bench/chaos.py's
smoke in tests/test_bench.py (4 hosts resumed on 3, one wiped, then on 5).
"""

import sys
import threading
import time

import numpy as np
import pytest

from diloco_jax.algo import state as state_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.checkpoints import store
from diloco_jax.checkpoints import recovery
from diloco_jax.checkpoints import resize
from diloco_jax.checkpoints import treebytes
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


def test_a_tree_survives_its_bytes_and_a_wrong_layout_is_named():
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int32(7),
          "c": np.array([-0.0, np.nan], np.float32)}
  back = treebytes.from_buffer(treebytes.to_bytes(tree), tree, "x")
  assert state_lib.fingerprint(back) == state_lib.fingerprint(tree)  # -0.0 and NaN too
  with pytest.raises(treebytes.LayoutError, match="leaf 0: .*float32.*2, 3"):
    treebytes.check_layout(treebytes.index({"a": np.zeros((3, 2), np.float32)}), tree, "x")


class FakeJob:
  """`hosts` threads that meet in every collective, as processes would."""

  def __init__(self, hosts):
    self.hosts, self.barrier, self.rows = hosts, threading.Barrier(hosts), {}

  def _meet(self, host, x, combine):
    self.rows[host] = np.asarray(x)
    self.barrier.wait()
    out = combine([self.rows[h] for h in range(self.hosts)])
    self.barrier.wait()  # nobody overwrites a row before everyone has read it
    return out

  def run(self, fn):
    results = [None] * self.hosts
    threads = [threading.Thread(target=lambda h=h: results.__setitem__(h, fn(h)))
               for h in range(self.hosts)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    return results


def test_broadcast_carries_bytes_unchanged_through_integer_sums(monkeypatch):
  monkeypatch.setattr(recovery, "CHUNK_BYTES", 100)  # several chunks, the last one short
  payload = bytes(range(256)) * 3 + b"\x01"
  job = FakeJob(3)
  got = job.run(lambda h: recovery.broadcast(
      payload if h == 1 else None, 1, host=h,
      sum_=lambda tree, h=h: {"bytes": job._meet(h, tree["bytes"], lambda rows: sum(rows))},
      allgather=lambda x, h=h: job._meet(h, x, np.stack)))
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
  world = resize.World(4, 3, ())
  assert world.changed and world.partial
  assert "cut into 6 shards" in world.message(9, replicas_per_host=2, inflight=True)
  with pytest.raises(store.CheckpointError, match="mode 'eager' keeps an outer state"):
    resize.check_mode(resize.World(2, 2, (1,)), "eager", "checkpoint 3")
  resize.check_mode(resize.World(2, 2, ()), "eager", "checkpoint 3")


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
  from diloco_jax.checkpoints import per_host
  from diloco_jax.wire import collective as collective_lib
  ckpt = per_host.LocalCheckpointer(str(tmp_path), keep=2, dispatcher=None,
                                            collective=collective_lib.LocalCollective(),
                                            timeout=1)
  snap = store.Snapshot(1, {"anchor": np.arange(4, dtype=np.float32)},
                             {"replicas": np.ones((2, 3), np.float32)}, {"round": 1})
  ckpt.save(snap)
  ckpt.wait()
  assert ckpt.steps() == [1]
  hang = threading.Event()
  monkeypatch.setattr(per_host.treebytes, "write", lambda *_: hang.wait())
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
