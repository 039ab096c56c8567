"""Robust aggregation of the K replicas' pseudo-gradients, coordinate by coordinate.

`mean` is DiLoCo's. `trimmed_mean` sorts each coordinate's K values and averages the
middle ones, dropping ⌊trim·K⌋ from each end; `median` takes the middle value (the mean
of the two middle ones for even K). One replica sending Δ × 10⁶, ±Inf or NaN moves a
trimmed mean or a median by at most the spread of the honest values. NaN sorts last,
like +Inf, so it is trimmed from the top.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("mean", "trimmed_mean", "median")


def trimmed_count(num_replicas: int, trim: float) -> int:
  return math.floor(trim * num_replicas)


def check(aggregation: str, num_replicas: int, trim: float) -> None:
  """Raises ValueError when `aggregation` cannot work with K replicas."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation {aggregation!r}: one of {AGGREGATIONS}")
  if aggregation == "trimmed_mean":
    t = trimmed_count(num_replicas, trim)
    if t < 1 or 2 * t >= num_replicas:
      raise ValueError(
          f"trimmed_mean with trim {trim} over K = {num_replicas} replicas trims {t} from "
          f"each end, which "
          + ("removes nothing" if t < 1 else "leaves no replica")
          + f"; it needs K >= {math.ceil(1 / trim) if trim > 0 else 'inf'} and trim < 0.5")
  if aggregation == "median" and num_replicas < 3:
    raise ValueError(f"median over K = {num_replicas} replicas is the mean; it needs K >= 3")


def for_replicas(aggregation: str, num_replicas: int, trim: float) -> str:
  """The aggregation a sum over `num_replicas` replicas runs: `aggregation`, or the mean
  where that is too few replicas for it (`check`). A live job's K changes from round to
  round, and a round that has lost hosts down to too few for the trim must still end."""
  try:
    check(aggregation, num_replicas, trim)
  except ValueError:
    return "mean"
  return aggregation


def tolerated(aggregation: str, num_replicas: int, trim: float) -> int:
  """How many replicas may send garbage (NaN, ±Inf, any size) without moving the result
  past the honest values' range: 0 for the mean."""
  if aggregation == "trimmed_mean":
    return trimmed_count(num_replicas, trim)
  return (num_replicas - 1) // 2 if aggregation == "median" else 0


def aggregate(deltas_K, aggregation: str, trim: float = 0.2):
  """[K, ...] -> [...]: the replicas' values combined coordinate-wise. numpy in, numpy
  out (the cross-host path, on the host); jax arrays in, jax out."""
  xp = np if isinstance(deltas_K, np.ndarray) else jnp
  k = deltas_K.shape[0]
  if aggregation == "mean":
    return xp.mean(deltas_K, axis=0)
  check(aggregation, k, trim)
  ordered = xp.sort(deltas_K, axis=0)
  if aggregation == "trimmed_mean":
    t = trimmed_count(k, trim)
    return xp.mean(ordered[t:k - t], axis=0)
  return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
