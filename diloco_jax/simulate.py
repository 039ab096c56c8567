"""`simulate`: K DiLoCo replicas of any loss function in one process, for research and tests.

It runs exactly the math of the trainer (`inner.make_train_step` for the inner steps,
`diloco` for the outer step) under one `jax.jit`, with the replicas vmapped.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax import diloco
from diloco_jax import inner
from diloco_jax import state as state_lib

Params = Any
MODES = ("sync", "delayed", "eager")


class SimulateResult(NamedTuple):
  """Attributes: params, the anchor after T outer steps (eager: the mean of the replicas'
  params); losses, [T, K, H] inner losses; outer_state, the final OuterState (eager: the
  final EagerState); replicas, the final ReplicaState [K, ...]."""
  params: Params
  losses: jax.Array
  outer_state: Any
  replicas: state_lib.ReplicaState


def simulate(loss_fn: Callable[[Params, Any], jax.Array], init_params: Params, batches: Any,
             *, inner_optimizer: optax.GradientTransformation,
             outer_optimizer: optax.GradientTransformation,
             mode: str = "sync") -> SimulateResult:
  """Trains K replicas of `loss_fn` from `init_params` with DiLoCo for T rounds of H steps.

  Args:
    loss_fn: (params, batch) -> scalar loss, where batch is one leaf-slice of `batches`.
    init_params: the initial anchor (any pytree, any float dtype, e.g. float64 under
      `jax_enable_x64`).
    batches: a pytree whose leaves have leading dims [T, K, H, ...]: outer step, replica,
      inner step.
    inner_optimizer, outer_optimizer: any optax transformations.
    mode: 'sync', 'delayed' or 'eager' (ALGORITHMS.md §1, §2, §3). In the async modes the
      mean of the last round, still in flight when the rounds end, is applied at the end
      (drained), so `params` contains every round.
  """
  if mode not in MODES:
    raise ValueError(f"simulate: mode={mode!r} is not one of {MODES}")
  leaves = jax.tree.leaves(batches)
  if not leaves or any(x.ndim < 3 for x in leaves):
    raise ValueError("simulate: every leaf of `batches` needs leading dims [T, K, H, ...]")
  t, k, h = leaves[0].shape[:3]
  if any(x.shape[:3] != (t, k, h) for x in leaves):
    raise ValueError("simulate: the leaves of `batches` disagree on [T, K, H]: "
                     f"{[x.shape[:3] for x in leaves]}")

  train_step = jax.vmap(inner.make_train_step(loss_fn, inner_optimizer))
  mean = lambda total: diloco.divide(total, k)

  def inner_phase(replicas, batches_KxH):
    batches_HxK = jax.tree.map(lambda x: x.swapaxes(0, 1), batches_KxH)

    def one_step(replicas, batch_K):
      params, opt_state, loss_K = train_step(replicas.params, replicas.opt_state, batch_K)
      return state_lib.ReplicaState(params=params, opt_state=opt_state), loss_K

    replicas, losses_HxK = jax.lax.scan(one_step, replicas, batches_HxK)
    return replicas, losses_HxK.T

  def sync_round(carry, batches_KxH):
    outer_state, replicas = carry
    replicas, losses = inner_phase(replicas, batches_KxH)
    outer_state = diloco.sync_outer_step(outer_optimizer, outer_state, replicas.params)
    replicas = replicas.replace(params=state_lib.broadcast_to_replicas(outer_state.anchor, k))
    return (outer_state, replicas), losses

  def delayed_round(carry, batches_KxH):
    # §2: Δ against this round's start s_r; s_{r+1} = OuterOpt(s_r, Δ̄ of round r−1).
    outer_state, replicas, in_flight, has_in_flight = carry
    replicas, losses = inner_phase(replicas, batches_KxH)
    total = diloco.replica_sum(diloco.pseudo_gradients(outer_state.anchor, replicas.params))
    outer_state = diloco.maybe_outer_update(outer_optimizer, outer_state, mean(in_flight),
                                            has_in_flight)
    replicas = replicas.replace(params=state_lib.broadcast_to_replicas(outer_state.anchor, k))
    return (outer_state, replicas, total, True), losses

  def eager_round(carry, batches_KxH):
    # §3: each replica applies Δ_m/K + (Δ̄_prev − Δ_m,prev/K) from its own θ_m.
    eager, replicas = carry
    replicas, losses = inner_phase(replicas, batches_KxH)
    deltas_K = jax.tree.map(lambda s, p: s - p, eager.params, replicas.params)
    eager = diloco.eager_update(outer_optimizer, eager, deltas_K, eager.prev_mean, k)
    # The mean of this round's Δ, in flight during the next round, arrives as prev_mean.
    eager = eager.replace(prev_mean=mean(diloco.replica_sum(deltas_K)))
    replicas = replicas.replace(params=eager.params)
    return (eager, replicas), losses

  @jax.jit
  def run(init_params, batches):
    replicas = state_lib.init_replica_state(inner_optimizer, init_params, k)
    if mode == "sync":
      outer_state = state_lib.init_outer_state(outer_optimizer, init_params)
      (outer_state, replicas), losses = jax.lax.scan(sync_round, (outer_state, replicas),
                                                     batches)
      return SimulateResult(outer_state.anchor, losses, outer_state, replicas)
    if mode == "delayed":
      outer_state = state_lib.init_outer_state(outer_optimizer, init_params)
      zeros = jax.tree.map(jnp.zeros_like, init_params)
      (outer_state, replicas, in_flight, _), losses = jax.lax.scan(
          delayed_round, (outer_state, replicas, zeros, False), batches)
      outer_state = diloco.outer_update(outer_optimizer, outer_state, mean(in_flight))  # drain
      return SimulateResult(outer_state.anchor, losses, outer_state, replicas)
    eager = state_lib.init_eager_state(outer_optimizer, init_params, k)
    (eager, replicas), losses = jax.lax.scan(eager_round, (eager, replicas), batches)
    # Drain: the last round's mean arrives; each replica swaps its fresh proxy for it.
    params_K = diloco.eager_drain(outer_optimizer, eager, eager.prev_mean, k)
    return SimulateResult(jax.tree.map(lambda p: jnp.mean(p, axis=0), params_K), losses,
                          eager, replicas)

  return run(init_params, batches)
