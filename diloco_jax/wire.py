"""Pseudo-gradients across hosts in a wire format, combined over all K replicas.

`outer.compression = 'none'` with `outer.aggregation = 'mean'` needs none of this: the
outer step sums Δ with the collective's plain all-reduce. Otherwise each host hands
`collective.reduce_encoded` rows of float32:

  mean           one row, Σ of its replicas' Δ (the bytes of a sum); the result is
                 Σ over all K, divided by K later as in the plain path.
  trimmed_mean,  one row per replica (R× the bytes of a sum): a coordinate-wise order
  median         statistic needs every replica's value. The host that owns a chunk
                 combines its n·R rows (`aggregate.aggregate`); the result is Δ̄ itself.

Error feedback (`outer.error_feedback`, lossy formats): what the wire did not carry of
a row, x − decode(encode(x)), is added to the same row the next time the same fragment
is sent, so nothing is lost for good, only late (for `topk`, the entries not sent). It
covers the first encoding; the re-encoding of the reduced chunks (identical on every
host) is not fed back. A row whose Δ had NaN or Inf gets its residual reset to 0.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import ml_collections
import numpy as np

from diloco_jax import aggregate
from diloco_jax import collective as collective_lib

Params = Any


class Wire:
  """How Δ crosses hosts, and the error-feedback residuals (this host's, per fragment)."""

  def __init__(self, outer: ml_collections.ConfigDict, num_replicas: int):
    self.compression, self.aggregation = outer.compression, outer.aggregation
    self.trim, self.topk_fraction = outer.trim, outer.topk_fraction
    self.feedback = outer.error_feedback and outer.compression != "none"
    self.plain = outer.compression == "none" and outer.aggregation == "mean"
    self.aggregates = outer.aggregation != "mean"  # the result is Δ̄, not Σ Δ
    self.tolerated = aggregate.tolerated(outer.aggregation, num_replicas, outer.trim)
    self.residual: dict[int, np.ndarray] = {}  # fragment -> [rows, N] float32

  def init_residuals(self, entries: dict[int, int], replicas_per_host: int) -> None:
    """Zero residuals for fragments of these sizes (so checkpoints know their layout)."""
    if self.feedback:
      rows = replicas_per_host if self.aggregates else 1
      self.residual = {key: np.zeros((rows, n), np.float32) for key, n in entries.items()}

  def reduce(self, collective, rows: Params, key: int = 0) -> Params:
    """Σ over all K replicas (mean) or Δ̄ (robust aggregation) of `rows`, sent encoded;
    the same bytes on every host. Runs on the dispatch thread; updates the residual of
    `key` (the caller reads it only after this returns)."""
    leaves, treedef = jax.tree.flatten(rows)
    x = _flat(rows)
    if self.feedback:
      x = x + self.residual[key]
    combine = collective_lib.sum_rows
    if self.aggregates:
      combine = functools.partial(aggregate.aggregate, aggregation=self.aggregation,
                                  trim=self.trim)
    out, carried = collective.reduce_encoded(x, self.compression, combine,
                                             topk_fraction=self.topk_fraction)
    if self.feedback:
      residual = x - carried
      self.residual[key] = np.where(np.isfinite(residual), residual, np.float32(0))
    sizes = [int(np.prod(leaf.shape[1:])) for leaf in leaves]
    parts = np.split(out, np.cumsum(sizes)[:-1])
    return jax.tree.unflatten(treedef, [p.reshape(leaf.shape[1:]) for p, leaf in
                                        zip(parts, leaves)])


def _flat(rows: Params) -> np.ndarray:
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(rows)]
  return np.concatenate([x.reshape(x.shape[0], -1) for x in leaves], axis=1)
