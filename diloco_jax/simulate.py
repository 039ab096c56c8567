"""`simulate`: K DiLoCo replicas of any loss function in one process, for research and tests.

It runs exactly the math of the trainer (`inner.make_train_step` for the inner steps,
`diloco` for the outer step) under one `jax.jit`, with the replicas vmapped.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax

from diloco_jax import diloco
from diloco_jax import inner
from diloco_jax import state as state_lib

Params = Any
MODES = ("sync",)


class SimulateResult(NamedTuple):
  """Attributes: params, the anchor after T outer steps; losses, [T, K, H] inner losses;
  outer_state, the final OuterState; replicas, the final ReplicaState [K, ...]."""
  params: Params
  losses: jax.Array
  outer_state: state_lib.OuterState
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
    mode: 'sync' (ALGORITHMS.md §1).
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

  def one_round(carry, batches_KxH):
    outer_state, replicas = carry
    batches_HxK = jax.tree.map(lambda x: x.swapaxes(0, 1), batches_KxH)

    def one_step(replicas, batch_K):
      params, opt_state, loss_K = train_step(replicas.params, replicas.opt_state, batch_K)
      return state_lib.ReplicaState(params=params, opt_state=opt_state), loss_K

    replicas, losses_HxK = jax.lax.scan(one_step, replicas, batches_HxK)
    outer_state = diloco.sync_outer_step(outer_optimizer, outer_state, replicas.params)
    replicas = replicas.replace(params=state_lib.broadcast_to_replicas(outer_state.anchor, k))
    return (outer_state, replicas), losses_HxK.T

  @jax.jit
  def run(init_params, batches):
    outer_state = state_lib.init_outer_state(outer_optimizer, init_params)
    replicas = state_lib.init_replica_state(inner_optimizer, init_params, k)
    (outer_state, replicas), losses_TxKxH = jax.lax.scan(
        one_round, (outer_state, replicas), batches)
    return SimulateResult(outer_state.anchor, losses_TxKxH, outer_state, replicas)

  return run(init_params, batches)
