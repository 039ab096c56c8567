"""Where a host's start went: `Phases`, the seconds of each phase, for run.json's
`start.seconds`."""

from __future__ import annotations

import os
import time


class Phases:
  """Seconds of a start by phase, for run.json's `start.seconds`: `done(name)` closes the
  phase that began where the last one ended; the first, "process", is the process's age
  when this was made (the interpreter, the imports, jax.distributed's start)."""

  def __init__(self):
    self.seconds = {"process": round(process_age(), 3)}
    self._since = time.perf_counter()

  def done(self, name: str) -> None:
    now = time.perf_counter()
    self.seconds[name] = round(now - self._since, 3)
    self._since = now


def process_age() -> float:
  """Seconds since this process started (Linux: to the kernel's 10 ms ticks; elsewhere,
  since this module was imported)."""
  try:
    with open("/proc/self/stat") as f:
      started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
      return max(float(f.read().split()[0]) - started, 0.0)
  except (OSError, ValueError, IndexError):
    return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
