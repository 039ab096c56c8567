"""One replica's plain optimizer step, knowing nothing about DiLoCo: the pure function that
`device.inner` jits over the host's devices and `simulate` scans over replicas."""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import optax

Params = Any
LossFn = Callable[[Params, jax.Array], jax.Array]


def make_grad_fn(loss_fn: LossFn, grad_accum_steps: int = 1):
  """(params, batch_BxL1) -> (loss, grads), averaged over `grad_accum_steps` micro-batches."""
  grad_fn = jax.value_and_grad(loss_fn)
  if grad_accum_steps == 1:
    return grad_fn

  def accumulated(params, batch):
    b = batch.shape[0]
    # Micro-batch j takes rows j, j+A, j+2A, ...: each micro-batch keeps the batch's
    # contiguous per-device blocks, so the 'data' sharding carries over unchanged.
    micro = batch.reshape(b // grad_accum_steps, grad_accum_steps,
                          *batch.shape[1:]).swapaxes(0, 1)

    def body(carry, micro_batch):
      loss, grads = grad_fn(params, micro_batch)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zeros, micro)
    return loss / grad_accum_steps, jax.tree.map(lambda g: g / grad_accum_steps, grads)

  return accumulated


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    grad_accum_steps: int = 1):
  """One replica's plain step: (params, opt_state, batch) -> (params, opt_state, loss)."""
  grad_fn = make_grad_fn(loss_fn, grad_accum_steps)

  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step
