"""Checkpoints on each host's own disk, for hosts that share no filesystem.

When every host has a --workdir of its own (runtime/workdir.py finds out at start), each
host writes whole checkpoints of its own: workdir/checkpoints/<round>/ holds

  shared.bin  the outer state every host holds bit for bit (anchor, outer momentum, ...),
  own.bin     this host's replicas, data iterators and, in async modes, its sum in flight,
  meta.json   the round, config and world; the run's id, the host that wrote it, the
              sha256 of the shared state, and where each leaf lies in the two files.

Each .bin file is the leaves' raw bytes in tree order. A save is written into
<round>.partial-<id>/ and renamed to <round>/ once every file is on disk (fsynced), so a
directory named by a round is complete; partial ones left by a crash are removed at start.
A save waits for no other host: it cannot hang on a peer. It is written by a thread of its
own while training goes on; the newest `keep` are kept.

Why not orbax: orbax 0.12.8 inside a multi-process JAX job writes numpy leaves on process 0
only and refuses arrays held by one process ("Cannot serialize host local jax.Array"), so
per-process checkpoints are not possible with it; its experimental `emergency` manager
needs a global mesh of replica slices. A shared workdir still uses orbax
(checkpoints/shared_dir.py). Which round the hosts resume from, and how a host without one heals
from a peer, is checkpoints/recovery.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time
import uuid
from typing import Any
from typing import Callable

import jax

from diloco_jax.algo import state as state_lib
from diloco_jax.checkpoints import store
from diloco_jax.checkpoints import recovery
from diloco_jax.checkpoints import treebytes
from diloco_jax.wire import collective as collective_lib

FORMAT = "diloco_jax.host_checkpoint/1"
META = "meta.json"
PARTIAL = ".partial-"



def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def present(workdir: str) -> bool:
  """Whether `workdir` holds host checkpoints (a run of one host resuming what hosts
  with their own disks wrote keeps that format)."""
  directory = os.path.join(workdir, store.CHECKPOINTS)
  return os.path.isdir(directory) and any(
      os.path.exists(os.path.join(directory, n, META)) for n in os.listdir(directory)
      if n.isdigit())


class LocalCheckpointer:
  """This host's checkpoints under its own workdir/checkpoints (module docstring), with
  the interface of `checkpoint.Checkpointer`; `restore` agrees with the other hosts on the
  round to resume from and heals a host that holds none (checkpoints/recovery.py)."""

  def __init__(self, workdir: str, *, keep: int, dispatcher, collective, timeout: int = 900):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, store.CHECKPOINTS)
    self.keep, self.dispatcher, self.collective = keep, dispatcher, collective
    self.host = jax.process_index()
    self.write_seconds: float | None = None
    self.recovered: recovery.Recovered | None = None  # what `restore` did, for the logs
    self.timeout = timeout  # config.checkpoint.timeout
    self._pending: tuple[int, concurrent.futures.Future] | None = None
    self._unreadable: set[int] = set()  # rounds this process failed to read (kept on disk)
    os.makedirs(self.directory, exist_ok=True)
    for name in os.listdir(self.directory):
      if PARTIAL in name:  # a save cut short by a crash: never a usable checkpoint
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # Saving.

  def save(self, snapshot: store.Snapshot, last: bool = False) -> float:
    """Starts writing `snapshot` on the writer thread; returns the seconds the caller was
    blocked (a private copy of the arrays, unless `last`)."""
    self._finish_previous()
    t = time.perf_counter()
    shared = store.to_host(snapshot.shared, not last)
    own = store.to_host(snapshot.own, not last)
    blocked = time.perf_counter() - t
    meta = dict(snapshot.meta, host=self.host)
    future = concurrent.futures.Future()

    def write():  # on a daemon thread: a disk that hangs cannot hold the process at exit
      try:
        future.set_result(self._write_checkpoint(snapshot.round, shared, own, meta))
      except BaseException as e:  # noqa: BLE001 -- reported by _finish_previous
        future.set_exception(e)
    threading.Thread(target=write, daemon=True, name=f"checkpoint-{snapshot.round}").start()
    self._pending = (snapshot.round, future)
    return blocked

  def _write_checkpoint(self, r: int, shared: Any, own: Any, meta: dict) -> None:
    t = time.monotonic()
    store.check_space(self.directory, r, collective_lib.payload_bytes(shared)
                               + collective_lib.payload_bytes(own))
    meta.update(format=FORMAT, shared_sha256=state_lib.fingerprint(shared),
                items={"shared": treebytes.index(shared), "own": treebytes.index(own)})
    partial = os.path.join(self.directory, f"{r}{PARTIAL}{uuid.uuid4().hex[:8]}")
    os.makedirs(partial)
    treebytes.write(os.path.join(partial, "shared.bin"), shared)
    treebytes.write(os.path.join(partial, "own.bin"), own)
    with open(os.path.join(partial, META), "w") as f:
      json.dump(meta, f, default=str)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(partial)
    final = os.path.join(self.directory, str(r))
    replaced = None
    if os.path.exists(final):  # the same round saved again (a run resumed before it)
      replaced = f"{final}.replaced{PARTIAL}{uuid.uuid4().hex[:8]}"
      os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_dir(self.directory)
    if replaced:
      shutil.rmtree(replaced, ignore_errors=True)
    for old in self.steps()[self.keep:]:
      shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
    self.write_seconds = time.monotonic() - t

  def _finish_previous(self) -> None:
    if self._pending is None:
      return
    r, future = self._pending
    self._pending = None
    try:
      future.result(timeout=self.timeout)
    except concurrent.futures.TimeoutError:
      raise store.CheckpointError(
          f"checkpoint {r} was not on disk in {self.directory} after {self.timeout} s "
          f"(config.checkpoint.timeout): the disk may hang. The checkpoints before it are "
          f"intact") from None
    except store.CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001 -- any write failure, reported with its round
      text = str(e)
      reason = ("no space left on device" if "No space left" in text
                else f"{type(e).__name__}: {text[:300]}")
      raise store.CheckpointError(f"checkpoint {r} could not be written to {self.directory}: "
                            f"{reason}. The checkpoints before it are intact") from None

  def wait(self) -> None:
    """Until the save started last is complete on disk (raises if it failed)."""
    self._finish_previous()

  def close(self) -> None:
    self._finish_previous()

  # Reading this host's own.

  def steps(self) -> list[int]:
    """The complete checkpoints on this host's disk, newest first."""
    try:
      names = os.listdir(self.directory)
    except FileNotFoundError:
      return []
    return sorted((int(n) for n in names if n.isdigit()
                   and os.path.exists(os.path.join(self.directory, n, META))), reverse=True)

  def read_meta(self, r: int) -> dict:
    with open(os.path.join(self.directory, str(r), META)) as f:
      meta = json.load(f)
    if meta.get("format") != FORMAT:
      raise store.CheckpointError(f"{self.directory}/{r}/{META} is not a diloco_jax host "
                            f"checkpoint (format {meta.get('format')!r})")
    return meta

  def read(self, r: int, like: Callable[[dict], store.Snapshot]) -> store.Snapshot:
    """Checkpoint r from this host's disk, its shared state checked against its hash."""
    where = f"checkpoint {r} in {self.directory}"
    meta = self.read_meta(r)
    want = like(meta)
    trees = {}
    for item in ("shared", "own"):
      treebytes.check_layout(meta["items"][item], getattr(want, item), f"{where} ({item}.bin)")
      with open(os.path.join(self.directory, str(r), f"{item}.bin"), "rb") as f:
        trees[item] = treebytes.from_buffer(f.read(), getattr(want, item), f"{where} ({item}.bin)")
    if state_lib.fingerprint(trees["shared"]) != meta["shared_sha256"]:
      raise store.CheckpointError(f"{where}: shared.bin does not match the hash written with it "
                            f"(the file changed on disk)")
    return store.Snapshot(r, trees["shared"], trees["own"], meta)

  def held(self) -> list[recovery.Held]:
    """What this host holds, newest first: rounds whose meta can be read (one that
    cannot, or that failed to read before, is listed as unreadable instead)."""
    out = []
    for r in self.steps():
      if r in self._unreadable:
        continue
      try:
        meta = self.read_meta(r)
        out.append(recovery.Held(r, int(meta["host"]), meta["shared_sha256"],
                                 meta.get("run_id") or ""))
      except (OSError, ValueError, KeyError, store.CheckpointError) as e:
        print(f"host {self.host}: cannot read checkpoint {r} in {self.directory}: "
              f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", flush=True)
        self._unreadable.add(r)
    return out

  def restore(self, like: Callable[[dict], store.Snapshot],
              check_meta: Callable[[dict], None]) -> store.Snapshot | None:
    """The snapshot to resume from, agreed with every host (checkpoints/recovery.py); None when
    no host holds a checkpoint. A host that holds none gets the shared state from a peer
    and `own` None."""
    snap, self.recovered = recovery.resume(self, like, check_meta)
    return snap

  def mark_unreadable(self, r: int) -> None:
    """Round r failed to read: listed as unreadable from now on (it stays on disk)."""
    self._unreadable.add(r)

  def unreadable(self) -> list[int]:
    return sorted(self._unreadable)
