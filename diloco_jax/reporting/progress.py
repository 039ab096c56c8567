"""The bar of inner steps below the round lines, on a terminal only."""

from __future__ import annotations

import sys


class ProgressBar:
  """A bar of inner steps below the round lines (rich), on a terminal only: nothing when
  stdout is not one (CI, SLURM logs, launch/local.py's pipes). While it runs, what the
  process prints goes above it; `close()` removes it."""

  def __init__(self, total: int, enabled: bool = True, stream=None):
    self.stream = stream or sys.stdout
    self.total = total
    self.enabled = enabled and self.stream.isatty()
    self._progress = None

  def update(self, step: int, note: str = "") -> None:
    if not self.enabled:
      return
    if self._progress is None:  # started at the first step, after the start-up lines
      from rich import progress as rich_progress
      from rich.console import Console
      self._progress = rich_progress.Progress(
          rich_progress.BarColumn(), rich_progress.MofNCompleteColumn(),
          rich_progress.TextColumn("{task.description}"),
          console=Console(file=self.stream, force_terminal=True), transient=True,
          refresh_per_second=4)
      self._task = self._progress.add_task(note, total=self.total)
      self._progress.start()
    self._progress.update(self._task, completed=step, description=note)

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()
      self._progress = None
