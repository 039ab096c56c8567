"""What runs around each round: `Hooks`, a list of (before, after) callbacks, each on a
schedule of its own.

The round loop (`trainer.Trainer.run`) knows nothing of checkpoints, records, profiles or
admissions: each is a hook the trainer adds once, in the order they run. A hook's `after`
may stop the run after its round (a preemption): the hooks after it do not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Hook:
  """Attributes:
    name: what it does (for errors and for reading).
    after: after round r, when due: returns True to stop the run after r.
    before: before round r, when due (None: nothing).
    every: due in the rounds r with r % every == 0 (1: every round).
  """
  name: str
  after: Callable[[int], bool | None]
  before: Callable[[int], None] | None = None
  every: int = 1

  def due(self, r: int) -> bool:
    return r % self.every == 0


class Hooks:
  """The run's hooks, in the order they were added."""

  def __init__(self):
    self._hooks: list[Hook] = []

  def add(self, name: str, after: Callable[[int], bool | None], *,
          before: Callable[[int], None] | None = None, every: int = 1) -> None:
    if every < 1:
      raise ValueError(f"hook {name!r}: every = {every}, must be >= 1")
    self._hooks.append(Hook(name, after, before, every))

  def before_round(self, r: int) -> None:
    for hook in self._hooks:
      if hook.before is not None and hook.due(r):
        hook.before(r)

  def after_round(self, r: int) -> bool:
    """Runs the hooks due after round r; returns whether one stops the run there."""
    for hook in self._hooks:
      if hook.due(r) and hook.after(r):
        return True
    return False

  @property
  def names(self) -> list[str]:
    return [hook.name for hook in self._hooks]
