"""A preempted run prints diloco_jax's own line ("preempted: stopped after round N ..."),
not the lines JAX and Orbax log on the way there. `quiet_preemption_logs` runs first thing
in the trainer, before jax is imported."""

from __future__ import annotations

import logging
import os

_ORBAX_PREEMPTION = "Reached preemption sync point"


def quiet_preemption_logs() -> None:
  """Several hosts: SIGTERM (or the trainer's Ctrl-C handler) makes TSL's C++ preemption
  notifier log `W... preemption_notifier.cc:90] SIGTERM caught at <time>` on every host,
  and Orbax log `W... multihost.py:436] [process=0][thread=...] Reached preemption sync
  point, step=N` through absl's Python logger, once per host and save thread."""
  # C++ has one log level for all its files: 2 drops INFO and WARNING and keeps ERROR
  # and FATAL. Before jax is imported, whose import sets 1 where unset, and TSL reads it
  # once; a user's own TF_CPP_MIN_LOG_LEVEL (e.g. 1: C++ warnings) is kept.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # Orbax logs with absl.logging.warning, i.e. on the "absl" logger that every absl user
  # shares: a filter drops this one message, not the logger's other warnings.
  logging.getLogger("absl").addFilter(_not_orbax_preemption)


def _not_orbax_preemption(record: logging.LogRecord) -> bool:
  return _ORBAX_PREEMPTION not in str(record.msg)
