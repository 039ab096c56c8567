"""The dispatch thread: the only thread that issues cross-host collectives.

Every host must issue the same collectives in the same order, and two threads issuing
collectives at once crash gloo (measured: both processes abort with a gloo size-mismatch
error). So all cross-host work is a job on one background thread, run strictly in FIFO
order; the main thread gets a future per job and keeps dispatching inner steps while the
collective runs (the overlap of Async DiLoCo).

After a job fails, the collective group is broken: every later job fails at once with the
same error instead of issuing another collective that would hang (until `recover`).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any
from typing import Callable

import jax

from diloco_jax import errors

_STOP = object()


class CollectiveError(errors.DilocoError, RuntimeError):
  """A cross-host job failed; the message names the round it belonged to."""

  def __init__(self, round_: int | None, what: str, cause: BaseException):
    where = f"round {round_}" if round_ is not None else "start-up"
    super().__init__(f"{what} failed in {where}: {type(cause).__name__}: {cause}")
    self.round = round_


class Dispatcher:
  """A FIFO of cross-host jobs on one daemon thread; `submit` returns a future.

  Use as a context manager, or call `close()`: it waits for the queued jobs, then stops
  the thread. The thread is a daemon, so a job stuck in a collective with a dead peer can
  never keep the process from exiting.
  """

  def __init__(self, name: str = "diloco-dispatch"):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._failure: CollectiveError | None = None
    self._closed = False
    self._abandoned = False  # a close gave up waiting for the thread
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  def submit(self, fn: Callable[..., Any], *args, round_: int | None = None,
             what: str | None = None) -> concurrent.futures.Future:
    """Queues fn(*args) behind every job submitted before it."""
    if self._closed:
      raise RuntimeError("Dispatcher.submit after close()")
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._jobs.put((future, fn, args, round_, what or getattr(fn, "__name__", "job")))
    return future

  def run(self, fn: Callable[..., Any], *args, round_: int | None = None,
          what: str | None = None) -> Any:
    """Submits fn(*args) and waits for its result (sync mode, start-up checks)."""
    return self.submit(fn, *args, round_=round_, what=what).result()

  def _loop(self) -> None:
    while True:
      item = self._jobs.get()
      if item is _STOP:
        return
      future, fn, args, round_, what = item
      if not future.set_running_or_notify_cancel():
        continue
      if self._failure is not None:
        future.set_exception(self._failure)
        continue
      try:
        label = what if round_ is None else f"{what} (round {round_})"
        with jax.profiler.TraceAnnotation(label):  # named in a profile (reporting/profiling.py)
          future.set_result(fn(*args))
      except BaseException as e:  # noqa: BLE001 -- handed to the main thread.
        self._failure = CollectiveError(round_, what, e)
        self._failure.__cause__ = e
        future.set_exception(self._failure)

  def recover(self) -> None:
    """After a job failed: waits until every job queued has ended (each failed at once),
    then takes jobs again (a host dropped from a live job, joining it again)."""
    try:
      self.run(lambda: None, what="the queue's end")
    except CollectiveError:
      pass
    self._failure = None

  @property
  def failed(self) -> bool:
    return self._failure is not None

  def close(self, timeout: float | None = None) -> bool:
    """Runs the queued jobs, then stops the thread; True if it stopped within `timeout`."""
    if not self._closed:
      self._closed = True
      self._jobs.put(_STOP)
    self._thread.join(0.0 if self._abandoned else timeout)
    # a thread that did not stop in time once is not waited for again (a leaver's op
    # that does not end: the daemon thread dies with the process)
    self._abandoned = self._thread.is_alive()
    return not self._abandoned

  def __enter__(self) -> Dispatcher:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # After an error a job may be stuck in a collective with a dead peer: do not wait
    # for it (the daemon thread dies with the process).
    self.close(timeout=None if exc_type is None and not self.failed else 0.0)
