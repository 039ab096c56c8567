"""How many inner steps each host trains in a round when hosts run at unequal speeds.

Under `balance = "speed"` every host should finish its inner phase at the same moment, so
that none idles while the slowest catches up: the slowest host trains H steps, and a host
f times as fast trains about f·H. The outer step then weights each replica by the tokens
it trained (docs/algorithms.md §9), so a fast host's extra steps count for what they are.

`speed_steps` is that decision as a pure function of measured seconds per step, one
number per host. It is made identically on every host from the same all-gathered
timings, so it needs no further agreement; the trainer records each decision (metrics,
run.json, the checkpoint) so that a resumed run replays it rather than measuring anew.

Measured step times jitter by a few percent even on identical hosts. A host within
`tolerance` of the slowest trains H steps too, so equal hosts decide equal steps, and the
weighted rule is then the plain one bit for bit (s_m = 1.0 exactly). A host is never
given more than `max_factor`·H steps: a host measured as very fast (a cache warm-up, a
clock glitch) cannot make everyone else wait for its long round to be weighed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def speed_steps(seconds_per_step: Sequence[float], inner_steps: int, *,
                tolerance: float = 0.1, max_factor: int = 4) -> list[int]:
  """Inner steps per host: H for the slowest host and every host within `tolerance` of
  its speed; ⌊H·f⌋ for a host f = t_slowest / t_host times as fast, at most
  `max_factor`·H. Raises ValueError for a timing that is not a positive number."""
  if inner_steps < 1:
    raise ValueError(f"inner_steps = {inner_steps}: must be >= 1")
  if max_factor < 1:
    raise ValueError(f"max_factor = {max_factor}: must be >= 1")
  bad = [(h, t) for h, t in enumerate(seconds_per_step) if not (math.isfinite(t) and t > 0)]
  if not seconds_per_step or bad:
    raise ValueError(f"seconds per inner step must be positive numbers, one per host: "
                     f"{bad or 'none given'}")
  slowest = max(seconds_per_step)
  steps = []
  for t in seconds_per_step:
    speedup = slowest / t
    if speedup < 1 + tolerance:
      steps.append(inner_steps)
    else:  # rounded down (never the round's longest phase), but 0.3 / 0.1 is 3, not 2.99..
      steps.append(min(int(inner_steps * slowest / t + 1e-9), max_factor * inner_steps))
  return steps


def round_seconds(seconds_per_step: Sequence[float], steps: Sequence[int]) -> float:
  """How long a round takes with these steps: the longest host's inner phase."""
  return max(t * s for t, s in zip(seconds_per_step, steps))


def busy_fractions(seconds_per_step: Sequence[float], steps: Sequence[int]) -> list[float]:
  """Each host's share of the round spent training (the rest it waits for the slowest)."""
  total = round_seconds(seconds_per_step, steps)
  return [t * s / total for t, s in zip(seconds_per_step, steps)]
