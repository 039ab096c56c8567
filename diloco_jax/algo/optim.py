"""Optimizer factories: the inner optimizer of every replica (AdamW, or Muon on the hidden
matrices with AdamW on the rest) and the outer Nesterov SGD."""

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


def muon_labels(params):
  """'muon' for the blocks' 2-D weight matrices (Dense kernels), 'adamw' for the rest:
  embeddings, norms, biases and the output head (a leaf under a top-level 'head'), which
  Muon's authors leave to AdamW."""
  def label(path, p):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    is_head = bool(names) and names[0] == "head"
    return "muon" if p.ndim == 2 and names[-1:] == ["kernel"] and not is_head else "adamw"
  return jax.tree_util.tree_map_with_path(label, params)


def _scale_by_shape(updates, state, params=None):
  del params
  return jax.tree.map(lambda u: u * max(1.0, u.shape[1] / u.shape[0]) ** 0.5, updates), state


def muon(inner: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """Muon (Jordan et al. 2024) on `muon_labels`'s matrices: optax's momentum and
  Newton-Schulz orthogonalization (`optax.contrib.scale_by_muon`: bias-corrected Nesterov
  momentum, `muon_ns_steps` quintic iterations on the Frobenius-normalized matrix), scaled
  by sqrt(max(1, fan_out / fan_in)), decoupled weight decay, and `muon_lr` on the same
  warmup and cosine decay as `lr`. AdamW with `lr` on the rest."""
  peak = inner.muon_lr / inner.lr
  schedule = inner_schedule(inner, total_steps)
  matrices = optax.chain(
      optax.contrib.scale_by_muon(
          ns_steps=inner.muon_ns_steps, beta=inner.muon_momentum, nesterov=True,
          # Each matrix as [fan_in, fan_out]; the other leaves are masked out here.
          weight_dimension_numbers=lambda tree: jax.tree.map(
              lambda _: optax.contrib.MuonDimensionNumbers(), tree)),
      optax.GradientTransformation(optax.init_empty_state, _scale_by_shape),
      optax.add_decayed_weights(inner.weight_decay),
      optax.scale_by_learning_rate(lambda count: peak * schedule(count)))
  rest = optax.adamw(schedule, b1=inner.b1, b2=inner.b2, eps=inner.eps,
                     weight_decay=inner.weight_decay, mask=_is_matrix)
  return optax.multi_transform({"muon": matrices, "adamw": rest}, muon_labels)


def inner_optimizer(inner: ml_collections.ConfigDict,
                    total_steps: int) -> optax.GradientTransformation:
  """`inner.optimizer` (AdamW, or Muon with AdamW) with warmup + cosine decay, after
  global-norm clipping (clip_norm 0: no clipping)."""
  if inner.optimizer == "muon":
    tx = muon(inner, total_steps)
  else:
    tx = optax.adamw(inner_schedule(inner, total_steps), b1=inner.b1, b2=inner.b2,
                     eps=inner.eps, weight_decay=inner.weight_decay, mask=_is_matrix)
  if inner.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(inner.clip_norm), tx)
  return tx


def outer_optimizer(outer: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """SGD on the mean pseudo-gradient: b ← μb + Δ̄; θ ← θ − η(Δ̄ + μb) with Nesterov."""
  return optax.sgd(outer.lr, momentum=outer.momentum or None, nesterov=outer.nesterov)
