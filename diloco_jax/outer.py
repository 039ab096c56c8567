"""The outer step as the trainer runs it: on the host, across hosts, timed in its parts.

The accelerators hold only what plain training holds. The anchor, the outer momentum and
Δ live on this host's CPU device (DESIGN.md, "Where the outer state lives"):

  replicas' params ──d2h──► Σ_local (anchor − θ_m) ──dispatch thread──► Σ over hosts
      ──► outer optimizer on Σ / K ──► new anchor ──h2d──► every local replica

The math is `diloco`'s, so `simulate` and the trainer agree; this module adds placement,
the cross-host sum (always on the dispatch thread) and the timings.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from diloco_jax import diloco
from diloco_jax import state as state_lib

Params = Any


class SyncOuterStep:
  """ALGORITHMS.md §1: wait for the mean pseudo-gradient of all K replicas, then apply it.

  `__call__` returns the new outer state, the replicas reset to the new anchor, the
  anchor on the local devices (for eval) and a record of figures for the metrics.
  """

  def __init__(self, outer_optimizer: optax.GradientTransformation, *, mesh: Mesh,
               collective, dispatcher, replicas_per_host: int):
    self.collective, self.dispatcher = collective, dispatcher
    self.num_replicas = replicas_per_host * collective.num_hosts  # K
    self.host_device = (getattr(collective, "device", None)
                        or jax.local_devices(backend="cpu")[0])
    self.host = SingleDeviceSharding(self.host_device)
    self._on_mesh = NamedSharding(mesh, P())  # the anchor, replicated on every local device
    self._optimizer = outer_optimizer
    # Σ over this host's replicas of Δ_m = anchor − θ_m (the cross-host sum adds hosts).
    self._delta_sum = jax.jit(
        lambda anchor, local_R: diloco.replica_sum(diloco.pseudo_gradients(anchor, local_R)))
    self._update = jax.jit(self._apply_mean, donate_argnums=0)
    self._broadcast = jax.jit(
        functools.partial(state_lib.broadcast_to_replicas, num_replicas=replicas_per_host),
        out_shardings=self._on_mesh)

  def _apply_mean(self, outer_state, delta_total):
    mean_delta = diloco.divide(delta_total, self.num_replicas)  # Δ̄ = Σ_all Δ_m / K
    return diloco.outer_update(self._optimizer, outer_state, mean_delta)

  def init(self, anchor: Params) -> state_lib.OuterState:
    # Committed to the host CPU device, as every later outer state is, so the outer-step
    # programs compile once rather than again in round 2.
    return jax.device_put(state_lib.init_outer_state(self._optimizer, anchor), self.host)

  def cross_host_sum(self, tree: Params, round_: int) -> Params:
    """Σ over hosts, issued on the dispatch thread; blocks until it is done."""
    return self.dispatcher.run(self.collective.sum, tree, round_=round_,
                               what="cross-host sum of pseudo-gradients")

  def __call__(self, outer_state: state_lib.OuterState, replicas: state_lib.ReplicaState,
               loss_sum: jax.Array, round_: int):
    times = {}
    # Wait for the inner phase first, so the figures below time the outer step alone.
    jax.block_until_ready(replicas.params)
    t = time.perf_counter()
    local_R = jax.block_until_ready(jax.device_put(replicas.params, self.host))
    times["outer_d2h"], t = _lap(t)
    sent = self.collective.bytes_sent
    # The round's summed train loss rides along with Δ: one collective, not two.
    total = self.cross_host_sum(
        {"delta": self._delta_sum(outer_state.anchor, local_R), "loss": loss_sum}, round_)
    times["outer_mean"], t = _lap(t)
    outer_state = jax.block_until_ready(self._update(outer_state, total["delta"]))
    times["outer_update"], t = _lap(t)
    anchor = jax.device_put(outer_state.anchor, self._on_mesh)
    replicas = replicas.replace(params=jax.block_until_ready(self._broadcast(anchor)))
    times["outer_h2d"], t = _lap(t)
    record = {**times, "outer_time": sum(times.values()),
              "bytes_sent": self.collective.bytes_sent - sent,
              "loss_sum": float(np.asarray(total["loss"]))}
    return outer_state, replicas, anchor, record


def _lap(t0: float) -> tuple[float, float]:
  t = time.perf_counter()
  return t - t0, t
