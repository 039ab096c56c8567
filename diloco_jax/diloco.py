"""The DiLoCo math as pure functions (ALGORITHMS.md §1). No I/O, no threads.

`simulate`, the single-host trainer and the multi-host trainer all call these, so the same
round gives the same numbers wherever it runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from diloco_jax import state as state_lib

Params = Any


def pseudo_gradients(anchor: Params, local_params_R: Params) -> Params:
  """Δ_m = θ − θ_m for every replica m (leading replica axis), in the anchor's dtype."""
  return jax.tree.map(lambda a, l: a[None] - l.astype(a.dtype), anchor, local_params_R)


def replica_sum(deltas_R: Params) -> Params:
  """Σ_m Δ_m over the leading replica axis.

  Means are taken as a sum followed by one division by the total replica count, so that a
  mean over hosts of per-host sums rounds exactly like a mean over one host's replicas.
  """
  return jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas_R)


def divide(tree: Params, count: int | jax.Array) -> Params:
  return jax.tree.map(lambda x: x / jnp.asarray(count, x.dtype), tree)


def mean_pseudo_gradient(anchor: Params, local_params_R: Params) -> Params:
  """Δ̄ = (1/R) Σ_m (θ − θ_m) over the replicas given (one host's, or all of them)."""
  num_replicas = jax.tree.leaves(local_params_R)[0].shape[0]
  return divide(replica_sum(pseudo_gradients(anchor, local_params_R)), num_replicas)


def outer_update(outer_optimizer: optax.GradientTransformation,
                 outer_state: state_lib.OuterState,
                 mean_delta: Params) -> state_lib.OuterState:
  """One outer step: the mean pseudo-gradient is the outer optimizer's gradient."""
  updates, opt_state = outer_optimizer.update(mean_delta, outer_state.opt_state,
                                              outer_state.anchor)
  return state_lib.OuterState(anchor=optax.apply_updates(outer_state.anchor, updates),
                              opt_state=opt_state, step=outer_state.step + 1)


def sync_outer_step(outer_optimizer: optax.GradientTransformation,
                    outer_state: state_lib.OuterState,
                    local_params_R: Params) -> state_lib.OuterState:
  """Sync DiLoCo on replicas that all live in one place (simulate, tests)."""
  return outer_update(outer_optimizer, outer_state,
                      mean_pseudo_gradient(outer_state.anchor, local_params_R))
