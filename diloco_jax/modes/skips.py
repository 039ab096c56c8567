"""The NaN-skip policy: whether a round's mean is applied when some replica's Δ had NaN/Inf.

Each host flags its replicas whose pseudo-gradient is not finite; the flags travel as a [K]
vector inside the round's cross-host sum, so every host sees the same flags and decides
the same (docs/algorithms.md §6). Up to `Arrived.tolerated` bad replicas are left out by
robust aggregation; more skip the outer step on every host; `outer.max_skipped_rounds`
skipped rounds in a row stop the run. The counters (`state.SkipCounters`) are checkpointed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from diloco_jax import errors
from diloco_jax.algo import state as state_lib
from diloco_jax.wire import exchange as exchange_lib


class BadPseudoGradientError(errors.DilocoError, RuntimeError):
  """Pseudo-gradients with NaN or Inf entries in `outer.max_skipped_rounds` rounds in a row."""


class Synced(NamedTuple):
  """A sum that arrived and what the NaN policy made of it (for the round's record)."""
  arrived: exchange_lib.Arrived
  applied: bool  # False: skipped on every host
  skipped_rounds: int  # skipped so far in the run
  bad_replicas: str  # "host h replica m, ..." ('' when every Δ was finite)


def decide(skips: state_lib.SkipCounters, arrived: exchange_lib.Arrived, *,
           replicas_per_host: int, max_skipped_rounds: int, aggregation: str,
           prints: bool) -> tuple[state_lib.SkipCounters, Synced]:
  """Whether to apply `arrived`'s mean: not when more replicas had NaN/Inf in their Δ than
  its aggregation leaves out (`arrived.tolerated`). Every host sees the same flags, so
  every host decides the same; the host that `prints` says so. Raises after
  `max_skipped_rounds` skipped rounds in a row."""
  bad_K, total = arrived.bad_K, int(skips.total)
  where = ", ".join(f"host {g // replicas_per_host} replica {g % replicas_per_host}"
                    for g in np.flatnonzero(bad_K))
  if prints and arrived.aggregation != aggregation:
    print(f"WARNING: round {arrived.round}: {arrived.replicas} replicas in the sum are too "
          f"few for {aggregation}: their mean instead", flush=True)
  if bad_K.sum() <= arrived.tolerated:  # none, or trimmed away by robust aggregation
    if where and prints:
      print(f"WARNING: round {arrived.round}: NaN or Inf in the pseudo-gradient of {where}; "
            f"left out by {arrived.aggregation}", flush=True)
    return state_lib.SkipCounters.of(total, 0), Synced(arrived, True, total, where)
  in_a_row = int(skips.in_a_row) + 1
  if in_a_row >= max_skipped_rounds:
    raise BadPseudoGradientError(
        f"round {arrived.round}: pseudo-gradients with NaN or Inf entries in {in_a_row} "
        f"rounds in a row (outer.max_skipped_rounds={max_skipped_rounds}); this round "
        f"from {where}")
  if prints:
    print(f"WARNING: round {arrived.round}: NaN or Inf in the pseudo-gradient of {where}; "
          f"outer step skipped on every host ({in_a_row} in a row)", flush=True)
  return state_lib.SkipCounters.of(total + 1, in_a_row), Synced(arrived, False, total + 1,
                                                                where)
