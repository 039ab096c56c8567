"""A preemption notice (SIGTERM) or Ctrl-C: finish the round, checkpoint, exit 0; every host
of a job of fixed membership stops after the same round."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils


class Preemption:
  """Whether the run should stop after this round with a checkpoint: a preemption notice
  (SIGTERM) or a Ctrl-C (SIGINT) on any host; a second Ctrl-C stops the process at once.

  Several hosts, in a mode whose rounds end with a sum of pseudo-gradients (every DiLoCo
  mode): the request is a word on that sum (this object is a `wire.exchange.Rider`), and
  every host stops after the round in which a sum that carries it arrives: the same
  round on every host, at the next round boundary (the next but one in the async modes,
  whose sums arrive a round late). ddp (sums at every step): JAX's preemption notifier
  turns SIGTERM into a sync point that every host reaches at the same round. A live job
  (each host a JAX world of its own): the host that gets the signal stops alone and
  leaves; the others carry on. The whole live job stops when its coordinator is asked to
  (`job_stopping()` turns true on each host as its coordinator's answers say so, at
  different times): that is the word on the sums, so every host stops after one round.
  `stop_job`, where given, is how this host's own signal stops the whole job instead: the
  host that serves the job's coordinator (host 0 of a job started with
  --coordinator_address) cannot leave alone, since the others need its coordinator.
  """
  name, keep, divisor = "stop", False, None

  def __init__(self, rides_sums: bool = True, job_stopping: Callable[[], bool] | None = None,
               stop_job: Callable[[], None] | None = None):
    self._stop_job = stop_job
    self._requested = threading.Event()
    self._agreed = False  # a sum said that some host was asked to stop
    self._interrupts = 0
    self._job_stopping = job_stopping  # live membership: whether the coordinator says so
    self._words = rides_sums and (jax.process_count() > 1 or job_stopping is not None)

  def request(self) -> None:
    if self._stop_job is not None:
      self._stop_job()  # every host stops after the same round, this one with them
    else:
      self._requested.set()

  # A rider of every sum of pseudo-gradients (`wire.exchange.Rider`).

  def words(self, round_: int):
    del round_
    if self._job_stopping is not None:  # live: this host's own stop is its alone
      return {"stop": np.float32(self._job_stopping())}
    return {"stop": np.float32(self._requested.is_set())}

  @staticmethod
  def like():
    return {"stop": np.float32(0)}

  def arrived(self, riders) -> None:
    """A sum's riders (in the order every host takes them): stop if it says so."""
    words = riders.get(self.name)
    if words is not None and float(words["stop"]) > 0:
      self._agreed = True

  def reached(self, r: int) -> bool:
    """Whether to stop after round r: the same answer on every host (live: also this
    host's own stop, when it alone leaves)."""
    if self._job_stopping is not None:
      return self._requested.is_set() or self._agreed
    if jax.process_count() == 1:
      return self._requested.is_set()
    if self._words:
      return self._agreed
    try:
      return multihost_utils.reached_preemption_sync_point(r)
    except RuntimeError:  # the preemption service is off
      return False

  @property
  def alone(self) -> bool:
    """Live membership: this host stops on a signal of its own, the others go on."""
    return self._job_stopping is not None and self._requested.is_set() and not self._agreed

  def _interrupted(self, *_) -> None:
    self._interrupts += 1
    if self._interrupts > 1:
      sys.stderr.write("Ctrl-C again: stopping now, without a checkpoint of this round\n")
      sys.stderr.flush()
      os._exit(130)
    sys.stderr.write("Ctrl-C: finishing this round, then saving a checkpoint and stopping "
                     "(Ctrl-C again stops at once)\n")
    sys.stderr.flush()
    if jax.process_count() > 1 and not self._words:  # (never live: one process per world)
      os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier: every host stops alike
    else:
      self.request()

  @contextlib.contextmanager
  def handling_signals(self):
    """On the main thread, for as long as this lasts: SIGINT (and, on one host, SIGTERM)
    ask for a stop after the round."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, self._interrupted)}
    if jax.process_count() == 1 or self._words:  # else JAX's notifier takes SIGTERM
      previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda *_: self.request())
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
