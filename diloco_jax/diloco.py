"""The DiLoCo math as pure functions (ALGORITHMS.md §1–3). No I/O, no threads.

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


def maybe_outer_update(outer_optimizer: optax.GradientTransformation,
                       outer_state: state_lib.OuterState, mean_delta: Params,
                       apply: jax.Array | bool) -> state_lib.OuterState:
  """`outer_update` when `apply`, else the state unchanged (traceable: delayed mode has
  nothing to apply after its first round)."""
  return jax.lax.cond(apply, lambda s: outer_update(outer_optimizer, s, mean_delta),
                      lambda s: s, outer_state)


def eager_gradients(deltas_R: Params, prev_mean: Params, prev_deltas_R: Params,
                    num_replicas: int) -> Params:
  """ALGORITHMS.md §3 step 5, per replica m: Δ̃_m = Δ_m/K + (Δ̄_prev − Δ_m,prev/K).

  The replica's fresh Δ stands in (weight 1/K) for its own stale contribution to the
  delayed mean of round r−1. In this form K = 1 is sync DiLoCo bit for bit: Δ̄_prev and
  Δ_m,prev are then the same number, so the bracket is exactly 0.
  """
  k = num_replicas

  def one(d_R, mean, prev_R):
    kk = jnp.asarray(k, d_R.dtype)
    return d_R / kk + (mean[None] - prev_R / kk)

  return jax.tree.map(one, deltas_R, prev_mean, prev_deltas_R)


def eager_update(outer_optimizer: optax.GradientTransformation,
                 eager: state_lib.EagerState, deltas_R: Params, prev_mean: Params,
                 num_replicas: int) -> state_lib.EagerState:
  """One eager outer step of every replica held here (leading axis R): each applies its
  own Δ̃_m with its own outer optimizer state, from its own start point θ_m."""
  grads_R = eager_gradients(deltas_R, prev_mean, eager.prev_deltas, num_replicas)

  def one(params, opt_state, grads):
    updates, opt_state = outer_optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # lax.map, not vmap: each replica runs the unbatched update program, so one replica
  # rounds exactly like sync DiLoCo's update of the anchor.
  params_R, opt_state_R = jax.lax.map(lambda a: one(*a),
                                      (eager.params, eager.opt_state, grads_R))
  return state_lib.EagerState(params=params_R, opt_state=opt_state_R, prev_deltas=deltas_R,
                              prev_mean=prev_mean, step=eager.step + 1)


def eager_drain(outer_optimizer: optax.GradientTransformation, eager: state_lib.EagerState,
                last_mean: Params, num_replicas: int) -> Params:
  """The end of an eager run: the mean of the last round arrives after the last inner phase.

  Each replica replaces its fresh proxy Δ_m/K by the true mean, g_m = Δ̄ − Δ_m/K, applying
  only g's immediate effect: the outer optimizer's update of g from a fresh state (for
  Nesterov −η(1+μ)g), since no new round happened to advance the momentum. With K = 1,
  g = 0 exactly and the params stay those of sync DiLoCo, bit for bit. Returns θ_m [R, ...].
  """
  zeros_R = jax.tree.map(jnp.zeros_like, eager.prev_deltas)
  grads_R = eager_gradients(zeros_R, last_mean, eager.prev_deltas, num_replicas)

  def one(params, grads):
    updates, _ = outer_optimizer.update(grads, outer_optimizer.init(params), params)
    return optax.apply_updates(params, updates)

  return jax.lax.map(lambda a: one(*a), (eager.params, grads_R))


def finite_replicas(deltas_R: Params) -> jax.Array:
  """[R] bool: whether every entry of replica m's Δ_m is finite (no NaN or Inf)."""
  per_leaf = [jnp.all(jnp.isfinite(d), axis=tuple(range(1, d.ndim)))
              for d in jax.tree.leaves(deltas_R)]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def drop_replicas(deltas_R: Params, keep_R: jax.Array) -> Params:
  """Δ_m where keep_R[m], else zeros: a dropped replica contributes nothing."""
  return jax.tree.map(
      lambda d: jnp.where(keep_R.reshape((-1,) + (1,) * (d.ndim - 1)), d, jnp.zeros_like(d)),
      deltas_R)


def zero_nonfinite(tree: Any) -> Any:
  """Every NaN or Inf entry replaced by 0 (an inner optimizer state after a replica
  diverged: its moments restart from zero where they broke)."""
  return jax.tree.map(
      lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))
      if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)
