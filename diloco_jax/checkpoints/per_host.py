"""Checkpoints on each host's own disk, for hosts that share no filesystem.

When every host has a --workdir of its own (runtime/workdir.py finds out at start), each
host writes whole checkpoints of its own: workdir/checkpoints/<round>/ holds

  shared.safetensors  the outer state every host holds bit for bit (anchor, outer
                      momentum, ...),
  own.safetensors     this host's replicas, data iterators and, in async modes, its sum in
                      flight,
  model.safetensors   in a finished run's last checkpoint only: the trained params (what
                      `sample` and `export` read; readback/trained.py),
  meta.json           the round, config and world; the run's id, the host that wrote it,
                      the sha256 of the shared state (what the hosts compare), and the
                      sha256 of every file, checked before a byte of it is used
                      (checkpoints/files.py).

A save is written into <round>.partial-<id>/ and renamed to <round>/ once every file is on
disk (fsynced), so a directory named by a round is complete; partial ones left by a crash
are removed at start. A save waits for no other host: it cannot hang on a peer. It is
written by a thread of its own while training goes on; the newest `keep` are kept.

Which round the hosts resume from, and how a host without one heals from a peer, is
checkpoints/recovery.py; a checkpoint this host cannot read (a file whose sha256 is not
the one meta.json records, say) is named in one line, never used, and moved to
workdir/checkpoints_unreadable/ once the run has resumed (the policy: checkpoints/store.py).
Checkpoints of format 1 (raw leaf bytes, before safetensors) are not read: refused, with
the directory named.

Why not orbax: orbax 0.12.8 inside a multi-process JAX job writes numpy leaves on process 0
only and refuses arrays held by one process ("Cannot serialize host local jax.Array"), so
per-process checkpoints are not possible with it; its experimental `emergency` manager
needs a global mesh of replica slices. A shared workdir still uses orbax
(checkpoints/shared_dir.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
import time
import uuid
from typing import Any
from typing import Callable


from diloco_jax.algo import state as state_lib
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import recovery
from diloco_jax.checkpoints import store
from diloco_jax.wire import collective as collective_lib

PARTIAL = ".partial-"
ITEMS = ("shared", "own")
MODEL = "model"  # a finished run's trained params (store.Snapshot.model)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _line(e: BaseException) -> str:
  """An error as one line: the message of a CheckpointError, else its type too."""
  text = " ".join(str(e).split())[:400]
  return text if isinstance(e, store.CheckpointError) else f"{type(e).__name__}: {text}"


def present(workdir: str) -> bool:
  """Whether `workdir` holds host checkpoints (a run of one host resuming what hosts
  with their own disks wrote keeps that format)."""
  directory = os.path.join(workdir, store.CHECKPOINTS)
  return os.path.isdir(directory) and any(
      os.path.exists(os.path.join(directory, n, files.META)) for n in os.listdir(directory)
      if n.isdigit())


class PerHostStore:
  """This host's checkpoints under its own workdir/checkpoints (module docstring), a
  `store.Store`; `restore` agrees with the other hosts on the round to resume from and
  heals a host that holds none (checkpoints/recovery.py)."""

  def __init__(self, workdir: str, *, host: int, keep: int, dispatcher, collective,
               timeout: int = 900):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, store.CHECKPOINTS)
    self.keep, self.dispatcher, self.collective = keep, dispatcher, collective
    self.host = host
    self.write_seconds: float | None = None
    self.recovered: store.Recovered | None = None  # what `restore` did, for the logs
    self.timeout = timeout  # config.checkpoint.timeout
    self._pending: tuple[int, concurrent.futures.Future] | None = None
    self._unreadable: set[int] = set()  # rounds this process failed to read (still on disk)
    os.makedirs(self.directory, exist_ok=True)
    for name in os.listdir(self.directory):
      if PARTIAL in name:  # a save cut short by a crash: never a usable checkpoint
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  # Saving.

  def save(self, snapshot: store.Snapshot, last: bool = False,
           after: threading.Event | None = None) -> float:
    """Starts writing `snapshot` on the writer thread; returns the seconds the caller was
    blocked (a private copy of the arrays, unless `last`)."""
    self._finish_previous()
    t = time.perf_counter()
    shared = store.to_host(snapshot.shared, not last)
    own = store.to_host(snapshot.own, not last)
    model = None if snapshot.model is None else store.to_host(snapshot.model, not last)
    blocked = time.perf_counter() - t
    meta = dict(snapshot.meta, host=self.host)
    future = concurrent.futures.Future()

    def write():  # on a daemon thread: a disk that hangs cannot hold the process at exit
      try:
        if after is not None:
          after.wait()
        future.set_result(self._write_checkpoint(snapshot.round, shared, own, meta, model))
      except BaseException as e:  # noqa: BLE001 -- reported by _finish_previous
        future.set_exception(e)
    threading.Thread(target=write, daemon=True, name=f"checkpoint-{snapshot.round}").start()
    self._pending = (snapshot.round, future)
    return blocked

  def _write_checkpoint(self, r: int, shared: Any, own: Any, meta: dict,
                        model: Any = None) -> None:
    t = time.monotonic()
    trees = dict(zip(ITEMS, (shared, own)), **({MODEL: model} if model is not None else {}))
    store.check_space(self.directory, r,
                      sum(collective_lib.payload_bytes(tree) for tree in trees.values()))
    partial = os.path.join(self.directory, f"{r}{PARTIAL}{uuid.uuid4().hex[:8]}")
    os.makedirs(partial)
    written = {files.filename(item): files.write(os.path.join(partial, files.filename(item)),
                                                 tree)
               for item, tree in trees.items()}
    # shared_sha256 hashes the tree, not the file: what the hosts compare does not depend
    # on how a safetensors version lays out a file.
    meta.update(format=files.FORMAT, shared_sha256=state_lib.fingerprint(shared),
                files=written)
    files.write_meta(os.path.join(partial, files.META), meta)
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
                   and os.path.exists(os.path.join(self.directory, n, files.META))), reverse=True)

  def path(self, r: int, name: str = "") -> str:
    return os.path.join(self.directory, str(r), name)

  def file_bytes(self, r: int, name: str) -> bytes:
    """The bytes of one file of checkpoint r (a heal sends them as they are on disk)."""
    with open(self.path(r, name), "rb") as f:
      return f.read()

  def read_meta(self, r: int) -> dict:
    """Checkpoint r's meta.json, its format and own sha256 checked."""
    return files.load_meta(self.file_bytes(r, files.META), self.path(r, files.META))

  def read(self, r: int, like: Callable[[dict], store.Snapshot]) -> store.Snapshot:
    """Checkpoint r from this host's disk; every file's sha256 is checked before a byte of
    it is used, and the trees' leaves against `like(meta)`'s."""
    meta = self.read_meta(r)
    want = like(meta)
    trees = {}
    for item in ITEMS:
      path, record = self.path(r, files.filename(item)), meta["files"][files.filename(item)]
      trees[item] = files.to_tree(files.read(path, record), getattr(want, item), record, path)
    return store.Snapshot(r, trees["shared"], trees["own"], meta)

  def held(self) -> list[recovery.Held]:
    """What this host holds, newest first: rounds whose meta.json can be read (one that
    cannot, or that failed to read before, is listed as unreadable instead, and named
    in one line; checkpoints of another format in one line for them all)."""
    out, other_format = [], []
    for r in self.steps():
      if r in self._unreadable:
        continue
      try:
        meta = self.read_meta(r)
        out.append(recovery.Held(r, int(meta["host"]), meta["shared_sha256"],
                                 meta.get("run_id") or ""))
      except (OSError, ValueError, KeyError, TypeError, store.CheckpointError) as e:
        if isinstance(e, files.FormatError):
          other_format.append((r, e))
        else:
          self.report_unreadable(r, e)
        self._unreadable.add(r)
    if other_format:  # the same reason for each: one line
      rounds = [r for r, _ in other_format]
      reason = str(other_format[0][1]).split(f"{files.META}: ", 1)[-1]
      print(f"host {self.host}: checkpoint(s) {rounds} in {self.directory} not used: "
            f"{reason}", flush=True)
    return out

  def report_unreadable(self, r: int, error: BaseException) -> None:
    """The one line naming an unreadable checkpoint (the file, or its directory, and why)."""
    line, where = _line(error), os.path.join(self.directory, str(r))
    if where not in line:  # an error that names no file (a key missing from meta.json)
      line = f"{where}: {line}"
    print(f"host {self.host}: checkpoint {r} not used: {line}", flush=True)

  def restore(self, like: Callable[[dict], store.Snapshot],
              check_meta: Callable[[dict], None]) -> store.Snapshot | None:
    """The snapshot to resume from, agreed with every host (checkpoints/recovery.py); None when
    no host holds a checkpoint. A host that holds none gets the shared state from a peer
    and `own` None. Then the checkpoints this host could not read are moved aside."""
    snap, self.recovered = recovery.resume(self, like, check_meta)
    if self._unreadable:
      moved = [store.move_aside(self.workdir, self.path(r), r) for r in self.unreadable()]
      print(f"host {self.host}: unreadable checkpoint(s) {self.unreadable()} moved to "
            f"{os.path.dirname(moved[0])}", flush=True)
      self._unreadable.clear()
    return snap

  def mark_unreadable(self, r: int, error: BaseException) -> None:
    """Round r failed to read: named in one line, listed as unreadable from now on."""
    self.report_unreadable(r, error)
    self._unreadable.add(r)

  def unreadable(self) -> list[int]:
    return sorted(self._unreadable)
