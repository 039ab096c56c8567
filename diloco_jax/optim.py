"""Optimizer factories: the inner AdamW of every replica and the outer Nesterov SGD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax


def inner_schedule(inner: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * final_lr_fraction` at `total_steps`.

  The schedule spans the whole run (all rounds), as in DiLoCo; it is driven by the inner
  optimizer's own step count, which is never reset between rounds.
  """
  peak, end, warmup = inner.lr, inner.lr * inner.final_lr_fraction, inner.warmup_steps
  decay = max(total_steps - warmup, 1)

  def schedule(count):
    # Computed in the default float dtype (float64 under jax_enable_x64), unlike optax's
    # own schedules, so a float64 run is float64 throughout.
    step = jnp.asarray(count, jnp.result_type(float))
    warm = peak * step / max(warmup, 1)
    frac = jnp.clip((step - warmup) / decay, 0.0, 1.0)
    cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    return jnp.where(step < warmup, warm, cosine)

  return schedule


def _is_matrix(params):
  # Decay weight matrices and embeddings only; biases and norm scales are left alone.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def inner_optimizer(inner: ml_collections.ConfigDict,
                    total_steps: int) -> optax.GradientTransformation:
  """AdamW with warmup + cosine decay and global-norm clipping (clip_norm 0: no clipping)."""
  adamw = optax.adamw(inner_schedule(inner, total_steps), b1=inner.b1, b2=inner.b2,
                      eps=inner.eps, weight_decay=inner.weight_decay, mask=_is_matrix)
  if inner.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(inner.clip_norm), adamw)
  return adamw


def outer_optimizer(outer: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """SGD on the mean pseudo-gradient: b ← μb + Δ̄; θ ← θ − η(Δ̄ + μb) with Nesterov."""
  return optax.sgd(outer.lr, momentum=outer.momentum or None, nesterov=outer.nesterov)
