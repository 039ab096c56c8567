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
from diloco_jax import streaming

Params = Any
MODES = ("sync", "delayed", "eager", "streaming")


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
             mode: str = "sync", fragment_ids: Params | None = None,
             overlap_steps: int = 0, merge_alpha: float = 0.0) -> SimulateResult:
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
      (drained), so `params` contains every round. 'streaming': ALGORITHMS.md §4 with
      the phase convention of `streaming.py`.
    fragment_ids, overlap_steps, merge_alpha: streaming only. A pytree like
      `init_params` giving each leaf's fragment in 0..P−1 (None: one fragment), τ, and α.
      `outer_state` is then the list of the fragments' OuterStates.
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

  def streaming_run(init_params, batches):
    leaves, treedef = jax.tree.flatten(init_params)
    ids = (jax.tree.leaves(fragment_ids) if fragment_ids is not None else [0] * len(leaves))
    num_p = max(ids) + 1
    kk = streaming.check_schedule(h, num_p, overlap_steps)
    tau = overlap_steps
    outer = streaming.outer_states(outer_optimizer, init_params, ids, num_p)

    def receive(outer, replicas, p, mean_p):
      outer = list(outer)
      outer[p] = diloco.outer_update(outer_optimizer, outer[p], mean_p)
      parts = streaming.split(replicas.params, ids, num_p)
      parts[p] = streaming.merge(parts[p], outer[p].anchor, merge_alpha, k)
      return outer, replicas.replace(params=streaming.join(parts, ids, treedef))

    def gated_receive(outer, replicas, p, mean_p, has):
      return jax.lax.cond(has, lambda o, r: receive(o, r, p, mean_p),
                          lambda o, r: (list(o), r), outer, replicas)

    def steps(replicas, batches_KxH, start, stop):
      if stop == start:
        return replicas, None
      return inner_phase(replicas, jax.tree.map(lambda x: x[:, start:stop], batches_KxH))

    def round_(carry, batches_KxH):
      outer, replicas, prev_mean, prev_has, r = carry
      losses = []
      prev_p = 0  # fragment 0 sent at the end of the previous round (if any)
      for q in range(1, num_p + 1):
        start = (q - 1) * kk
        if tau:
          replicas, l1 = steps(replicas, batches_KxH, start, start + tau)
          outer, replicas = gated_receive(outer, replicas, prev_p, prev_mean[prev_p],
                                          prev_has)
          replicas, l2 = steps(replicas, batches_KxH, start + tau, start + kk)
          losses += [l1, l2]
        else:
          replicas, l = steps(replicas, batches_KxH, start, start + kk)
          losses.append(l)
        p = q % num_p
        sends = r >= 2 if q < num_p else True  # fragment p ≥ 1 first sends in round 2
        mean_p = streaming.send(outer[p], streaming.split(replicas.params, ids, num_p)[p])
        if tau == 0:
          if q < num_p:
            outer, replicas = gated_receive(outer, replicas, p, mean_p, sends)
          else:
            outer, replicas = receive(outer, replicas, p, mean_p)
          prev_has = jnp.asarray(False)
        else:
          prev_mean = [mean_p if i == p else m for i, m in enumerate(prev_mean)]
          prev_has = jnp.asarray(sends)
        prev_p = p
      losses = jnp.concatenate([x for x in losses if x is not None], axis=1)
      return (outer, replicas, prev_mean, prev_has, r + 1), losses

    replicas = state_lib.init_replica_state(inner_optimizer, init_params, k)
    zeros = [jax.tree.map(jnp.zeros_like, part) for part in streaming.split(init_params, ids,
                                                                            num_p)]
    carry = (outer, replicas, zeros, jnp.asarray(False), jnp.asarray(1))
    (outer, replicas, prev_mean, prev_has, _), losses = jax.lax.scan(round_, carry, batches)
    if tau:  # the mean of fragment 0, sent after the last step, arrives
      outer, replicas = gated_receive(outer, replicas, 0, prev_mean[0], prev_has)
    anchor = streaming.join([o.anchor for o in outer], ids, treedef)
    return SimulateResult(anchor, losses, outer, replicas)

  @jax.jit
  def run(init_params, batches):
    if mode == "streaming":
      return streaming_run(init_params, batches)
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
