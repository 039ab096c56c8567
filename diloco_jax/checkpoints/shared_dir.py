"""Checkpoints at round boundaries in a workdir every host shares: orbax, written in the
background, restored on start. (Hosts with a workdir each: `per_host`.)

A checkpoint is one orbax step directory, workdir/checkpoints/<round>, with three items:

  shared  what every host holds bit for bit (the outer state): fully replicated global
          arrays, read by every host on restore.
  hosts   what each host holds for itself (its replicas' params and inner optimizer
          state, its data iterators, in async modes the pseudo-gradients still in flight):
          global arrays with a leading hosts axis, each host writing and reading its row.
          (In a multi-host job orbax refuses host-local jax.Arrays, and numpy leaves
          are written by host 0 alone: measured with orbax 0.12.8.)
  meta    JSON: the round, the config, the world (hosts × replicas), versions.

Saving costs the main thread one copy of the state into host memory; the dispatch thread
hands that copy to orbax, which writes it in the background while training goes on. Every
orbax call runs on the dispatch thread (the one that issues cross-host collectives,
`wire/dispatch.py`); orbax's barriers use the coordination service, never gloo, so they
never interleave with a cross-host sum.

Restoring tries the newest checkpoint first. Every host reads its part, and the hosts
agree (an all-gather of ok flags) before anyone uses it; a host that cannot read it says
so in one line (orbax's error). When an older checkpoint is then read, every newer one
that some host could not read is moved to workdir/checkpoints_unreadable/ by host 0, with
a warning naming it. When none can be read, they all stay where they are and the run is
refused, on this attempt and every later one: a run never starts over from round 1 while
checkpoints it could not read exist (the policy of every store: checkpoints/store.py).
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import sys
import threading
import time
import weakref
from typing import Any
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import units
from diloco_jax.checkpoints import store
from diloco_jax.wire import collective as collective_lib


def _ocp(barrier_timeout: int | None = None):
  """orbax.checkpoint, imported on first use: a run that starts in an empty directory
  needs it only at its first save, which runs on the dispatch thread while round 1
  trains. Its import took 0.13 s of every host's start (orbax-checkpoint 0.12, 2 CPU cores).
  `barrier_timeout`: how long orbax's coordination-service barriers wait for a host (its
  default 300 s). Private: orbax has no option for it; a barrier timeout in
  `MultiprocessingOptions` would replace this module constant."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  if barrier_timeout is not None:
    from orbax.checkpoint._src.multihost import multihost  # pylint: disable=import-outside-toplevel
    multihost._DEFAULT_BARRIER_TIMEOUT = barrier_timeout
  _settle_failed_reads()
  return ocp


SETTLE_S = 60  # how long a failed read (or write) waits for the ones beside it to end


def _settle_failed_reads() -> None:
  """Makes orbax's `run_sync`, when its coroutine fails, wait for the tasks it started
  before it closes its event loop. Orbax runs each read (and write) in a loop of its
  own, closed as soon as the first of the reads it gathers fails (a file cut short); the
  others are tensorstore's, which end later on tensorstore's threads and hand their
  results to the closed loop: "Event loop is closed", raised where no one can catch it
  (an unraisable exception, about 20 per failed read of a checkpoint: pytest reports them
  in whatever test runs then). Private: where orbax's internals differ (another
  version), nothing changes."""
  try:
    from orbax.checkpoint._src import asyncio_utils  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  run_sync = getattr(asyncio_utils, "run_sync", None)
  if run_sync is None or getattr(run_sync, "settles", False):
    return

  @functools.wraps(run_sync)
  def settled(coro):
    return run_sync(_settling(coro))

  settled.settles = True
  asyncio_utils.run_sync = settled


async def _settling(coro):
  """`coro`; if it fails, first the end of every task made while it ran (within
  SETTLE_S), their errors taken (else asyncio logs each as never retrieved)."""
  loop = asyncio.get_running_loop()
  previous = loop.get_task_factory()
  made = weakref.WeakSet()  # a task that ended is not kept alive with its result

  def factory(of, task_coro, **kwargs):
    task = (previous(of, task_coro, **kwargs) if previous is not None
            else asyncio.Task(task_coro, loop=of, **kwargs))
    made.add(task)
    return task

  loop.set_task_factory(factory)
  try:
    return await coro
  except Exception:
    pending = [task for task in made if not task.done()]
    if pending:
      await asyncio.wait(pending, timeout=SETTLE_S)
    for task in list(made):
      if task.done() and not task.cancelled():
        task.exception()
    raise
  finally:
    loop.set_task_factory(previous)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
  """(fn(), None), or (None, the exception)."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001 -- any read failure: the caller tries the one before
    return None, e


class SharedDirStore:
  """Saves and restores `Snapshot`s under workdir/checkpoints, keeping the newest `keep`
  (a `store.Store`).

  Orbax deletes an old checkpoint only after a newer one is complete, so a crash during a
  save never leaves the run without a good one.
  """

  # A shared workdir never heals a host from a peer (per_host does): always None.
  recovered: store.Recovered | None = None

  def __init__(self, workdir: str, *, keep: int, dispatcher, collective, timeout: int = 900):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, store.CHECKPOINTS)
    self.dispatcher, self.collective = dispatcher, collective
    self.num_hosts, self.host = jax.process_count(), jax.process_index()
    self.keep = keep
    self._writing: int | None = None  # the round of the save orbax may still be writing
    self._save_started = 0.0
    self.write_seconds: float | None = None  # how long the last finished save took
    self.timeout = timeout  # config.checkpoint.timeout: a background save's own limit
    self._first_cpu = list(collective_lib.host_mesh().devices.flat)
    self.device = self._first_cpu[self.host]
    os.makedirs(self.directory, exist_ok=True)  # every host: the workdir is shared
    # One host, or ddp's hosts (who share fate): every host writes, for the whole run.
    self.hosts = list(range(self.num_hosts))
    self._replicated, self._rows = self._shardings(self.hosts)
    self._manager = None  # made on first use (`manager`)

  @property
  def manager(self):
    """The orbax CheckpointManager of `self.hosts`, made on first use (on the dispatch
    thread, where every use is). It waits at no barrier when made (create=False)."""
    if self._manager is None:
      self._manager = self._new_manager()
    return self._manager

  def _new_manager(self):
    # a save waiting for a host at a barrier gives up with the save's own timeout
    ocp = _ocp(barrier_timeout=self.timeout)
    hosts = self.hosts
    # An explicit set of processes makes orbax use coordination-service barriers, not
    # collective ones that could interleave with a sum on the dispatch thread.
    processes = set(hosts) if self.num_hosts > 1 else None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.keep, create=False, enable_async_checkpointing=True,
        cleanup_tmp_directories=True,  # a save cut short by a crash
        async_options=ocp.AsyncOptions(timeout_secs=self.timeout,
                                       post_finalization_callback=self._written),
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            active_processes=processes))
    return ocp.CheckpointManager(self.directory, options=options)

  def _written(self) -> None:
    """orbax's callback (on its thread) once a save is complete on disk."""
    self.write_seconds = time.monotonic() - self._save_started

  def _shardings(self, hosts: list[int]) -> tuple[NamedSharding, NamedSharding]:
    mesh = Mesh(np.array([self._first_cpu[h] for h in hosts]), (collective_lib.HOSTS_AXIS,))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P(collective_lib.HOSTS_AXIS))

  # Global arrays over the host mesh, built from (and read back into) host memory.
  def _to_replicated(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        x.shape, self._replicated, [jax.device_put(x, self.device)]), tree)

  def _to_rows(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        (len(self.hosts), *x.shape), self._rows, [jax.device_put(x[None], self.device)]), tree)

  def _abstract(self, tree: Any, sharding: NamedSharding, rows: int = 0) -> Any:
    lead = (rows,) if rows else ()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((*lead, *np.shape(x)), x.dtype,
                                                       sharding=sharding), tree)

  def save(self, snapshot: store.Snapshot, last: bool = False,
           after: threading.Event | None = None) -> float:
    """Starts writing `snapshot`; returns the seconds the caller was blocked (the copy).
    `last`: nothing will change the snapshot's arrays any more (the run's final save),
    so they are written without a private copy first: on CPU that copy was the biggest
    part of the host memory a save adds (bench/checkpoint.py measures a save)."""
    t = time.perf_counter()
    shared, own = store.to_host(snapshot.shared, not last), store.to_host(snapshot.own, not last)
    blocked = time.perf_counter() - t
    hosts = self.hosts
    snapshot.meta["hosts_in_rows"] = hosts
    # On a shared workdir host 0 writes the shared item and every host its row.
    needed = collective_lib.payload_bytes(shared) + len(hosts) * collective_lib.payload_bytes(own)

    def job():
      if after is not None:
        after.wait()
      self._finish_previous()
      store.check_space(self.directory, snapshot.round, needed)
      self._save_started = time.monotonic()
      ocp = _ocp()
      self.manager.save(snapshot.round, force=True, args=ocp.args.Composite(
          shared=ocp.args.StandardSave(self._to_replicated(shared)),
          hosts=ocp.args.StandardSave(self._to_rows(own)),
          meta=ocp.args.JsonSave(snapshot.meta)))
      self._writing = snapshot.round

    self.dispatcher.submit(job, round_=snapshot.round, what="checkpoint save")
    return blocked

  def _finish_previous(self) -> None:
    """Waits for the save still being written (orbax would, first thing in the next
    save) so that a failure is reported with the round it belongs to."""
    if self._manager is None:  # nothing was ever saved by this manager
      return
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._failed(self._writing, e) from None
    self._writing = None

  def _failed(self, r: int | None, error: BaseException) -> store.CheckpointError:
    text = str(error)
    full = "No space left on device" in text or "os_error_code='28'" in text
    reason = "no space left on device" if full else f"{type(error).__name__}: {text[:300]}"
    free = shutil.disk_usage(self.directory).free
    return store.CheckpointError(f"checkpoint {r} could not be written to {self.directory}: "
                           f"{reason} ({units.format_bytes(free)} free there). The "
                           f"checkpoints before it are intact")

  def wait(self) -> None:
    """Until every started save is complete on disk."""
    self.dispatcher.run(self._finish_previous, what="checkpoint save (finish)")

  def close(self) -> None:
    if self._manager is not None:
      self.dispatcher.run(self._manager.close, what="closing the checkpoint manager")

  def steps(self) -> list[int]:
    """Complete checkpoints, newest first; the same list on every host or an error."""
    steps = sorted(self.dispatcher.run(self._listed_steps), reverse=True)
    newest = np.array([steps[0] if steps else -1, len(steps)], np.int64)
    seen = self.dispatcher.run(self.collective.allgather, newest,
                               what="agreeing on the checkpoints")
    if not (seen == newest).all():
      raise store.CheckpointError(
          f"hosts see different checkpoints in {self.directory} (newest, count per host: "
          f"{seen.tolist()}): the workdir must be one directory shared by every host")
    return steps

  def _listed_steps(self) -> list[int]:
    if self._manager is None and not any(name.isdigit() for name in os.listdir(self.directory)):
      return []  # no step directory (orbax names them by the round): no orbax needed yet
    self.manager.reload()  # what is on disk now, not what this manager saw
    return list(self.manager.all_steps())

  def restore(self, like: Callable[[dict], store.Snapshot],
              check_meta: Callable[[dict], None]) -> store.Snapshot | None:
    """The newest checkpoint every host can read, or None if there is none.

    `like(meta)` gives the structure, shapes and dtypes; `check_meta(meta)` raises a
    store.CheckpointError if the checkpoint does not fit this run (not a read failure: it stops
    the run rather than falling back to an older checkpoint)."""
    tried = []
    steps = self.steps()
    ocp = _ocp() if steps else None
    for step in steps:
      # A read failure is caught on the dispatch thread: it must not count as a failed
      # collective (after which the dispatcher refuses every job).
      meta, error = self.dispatcher.run(_attempt, lambda: self.manager.restore(  # noqa: B023
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
      snapshot = None
      if error is None:
        check_meta(meta)
        want = like(meta)
        # The hosts that wrote rows: all of them, except in a checkpoint of an elastic
        # job before 0.2 that had lost some (a host without a row gets own=None and
        # starts its replicas afresh).
        writers = meta.get("hosts_in_rows", list(range(meta["num_hosts"])))
        everyone = self._shardings(list(range(self.num_hosts)))[0]  # a copy on every host
        # Each host reads its own row; if some host has none, every host reads all rows
        # (orbax cannot restore an array of which a host holds no shard).
        rows = self._rows if writers == self.hosts else everyone
        restored, error = self.dispatcher.run(_attempt, lambda: self.manager.restore(  # noqa: B023
            step, args=ocp.args.Composite(
                shared=ocp.args.StandardRestore(self._abstract(want.shared, everyone)),
                hosts=ocp.args.StandardRestore(self._abstract(want.own, rows,
                                                              len(writers))))))
        if error is None:
          shared = jax.tree.map(lambda g: np.asarray(g.addressable_data(0)), restored.shared)
          own = None
          if self.host in writers:
            row = 0 if rows is self._rows else writers.index(self.host)
            own = jax.tree.map(lambda g: np.asarray(g.addressable_data(0))[row],  # noqa: B023
                               restored.hosts)
          missing = tuple(h for h in range(self.num_hosts) if h not in writers)
          snapshot = store.Snapshot(step, shared, own, meta, missing)
      ok = error is None
      flags = self.dispatcher.run(self.collective.allgather, np.array([ok], np.int32),
                                  what="agreeing on a readable checkpoint")[:, 0]
      if flags.all():
        for newer, bad_hosts in tried:  # only now that an older one could be read
          self._set_aside(newer, bad_hosts, step)
        return snapshot
      if error is not None:
        detail = " ".join(str(error).split())  # one line (orbax's errors span many)
        sys.stderr.write(f"host {self.host}: cannot read checkpoint {step}: "
                         f"{type(error).__name__}: {detail[:300]}\n")
      tried.append((step, [h for h, f in enumerate(flags) if not f]))
    if tried:  # left where they are: every later attempt refuses the same way
      rounds = ", ".join(f"{step} (unreadable on host(s) {bad})" for step, bad in tried)
      raise store.CheckpointError(
          f"no checkpoint in {self.directory} could be read: rounds {rounds}. They are "
          f"left where they are, and this run is not started again from round 1 while "
          f"they exist. If a filesystem was missing for a moment, run the same command "
          f"again; to start this workdir from scratch anyway, add --restart_from_scratch "
          f"(the old run is moved to {self.workdir}/previous/, nothing is deleted)")
    return None

  def _set_aside(self, step: int, bad_hosts: list[int], resumed: int) -> None:
    """Moves an unreadable checkpoint newer than the one resumed from out of orbax's way
    (kept for inspection), on every host's view, with a warning naming it."""
    if self.host == 0:
      target = store.move_aside(self.workdir, os.path.join(self.directory, str(step)), step)
      print(f"WARNING: checkpoint {step} in {self.directory} is incomplete or corrupt "
            f"(unreadable on host(s) {bad_hosts}); moved to {target}; resuming from "
            f"checkpoint {resumed}", file=sys.stderr, flush=True)
    # Nobody lists the directory again before host 0 has moved it.
    self.dispatcher.run(self.collective.allgather, np.zeros(1, np.int32),
                        what="waiting for an unreadable checkpoint to be set aside")
    self.dispatcher.run(self.manager.reload, what="listing the checkpoints again")
