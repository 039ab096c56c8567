"""A preemption notice (SIGTERM) or Ctrl-C: finish the round, checkpoint, exit 0; every host
stops after the same round."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils


class Preemption:
  """Whether the run should stop after this round with a checkpoint: a preemption notice
  (SIGTERM) or a Ctrl-C (SIGINT) on any host. Several hosts: JAX's preemption notifier
  (on by default) turns SIGTERM into a sync point that every host reaches at the same
  round, through the coordination service; a first Ctrl-C sends this process SIGTERM. One
  host: handlers installed for the run. A second Ctrl-C stops the process at once."""

  def __init__(self):
    self._requested = threading.Event()
    self._interrupts = 0

  def request(self) -> None:
    self._requested.set()

  def reached(self, r: int) -> bool:
    """Whether to stop after round r: the same answer on every host."""
    if jax.process_count() == 1:
      return self._requested.is_set()
    try:
      return multihost_utils.reached_preemption_sync_point(r)
    except RuntimeError:  # the preemption service is off
      return False

  def _interrupted(self, *_) -> None:
    self._interrupts += 1
    if self._interrupts > 1:
      sys.stderr.write("Ctrl-C again: stopping now, without a checkpoint of this round\n")
      sys.stderr.flush()
      os._exit(130)
    sys.stderr.write("Ctrl-C: finishing this round, then saving a checkpoint and stopping "
                     "(Ctrl-C again stops at once)\n")
    sys.stderr.flush()
    if jax.process_count() > 1:
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
    if jax.process_count() == 1:
      previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda *_: self.request())
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
