"""The inner optimizers against independent numpy implementations (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax import config as config_lib
from diloco_jax.algo import optim

NS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz coefficients of Muon's paper


@pytest.fixture(autouse=True)
def x64():
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


def inner_config(**overrides):
  c = config_lib.get_default_config().inner
  c.update(dict(optimizer="muon", lr=1e-3, muon_lr=0.05, warmup_steps=2,
                final_lr_fraction=0.1, weight_decay=0.1, clip_norm=0.0,
                muon_momentum=0.9, muon_ns_steps=5))
  c.update(overrides)
  return c


def np_schedule(c, step, total):
  """Linear warmup to 1, then cosine decay to final_lr_fraction: the lr's multiplier."""
  if step < c.warmup_steps:
    return step / c.warmup_steps
  frac = min(max((step - c.warmup_steps) / max(total - c.warmup_steps, 1), 0.0), 1.0)
  end = c.final_lr_fraction
  return end + (1 - end) * 0.5 * (1 + np.cos(np.pi * frac))


def np_orthogonalize(m, steps, eps=1e-8):
  """Muon's Newton-Schulz iteration X <- aX + (bA + cA^2)X, A = XX^T, on the wide side."""
  x = m.T if m.shape[0] > m.shape[1] else m
  x = x / (np.sqrt((x ** 2).sum()) + eps)
  a, b, c = NS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if m.shape[0] > m.shape[1] else x


def np_muon(c, w, grads, total):
  """Muon on one [fan_in, fan_out] matrix: bias-corrected Nesterov momentum
  (mu <- beta mu + (1 - beta) g; mu_hat = beta mu/(1 - beta^(t+2)) + (1 - beta) g/(1 -
  beta^(t+1))), orthogonalized, scaled by sqrt(max(1, fan_out/fan_in)), decoupled weight
  decay, times -muon_lr x the schedule at step t."""
  beta, mu = c.muon_momentum, np.zeros_like(w)
  for t, g in enumerate(grads):
    mu = beta * mu + (1 - beta) * g
    mu_hat = beta * mu / (1 - beta ** (t + 2)) + (1 - beta) * g / (1 - beta ** (t + 1))
    u = np_orthogonalize(mu_hat, c.muon_ns_steps)
    u = u * np.sqrt(max(1.0, w.shape[1] / w.shape[0])) + c.weight_decay * w
    w = w - c.muon_lr * np_schedule(c, t, total) * u
  return w


def test_muon_equals_numpy_on_small_matrices():
  """A wide and a tall kernel (the tall one orthogonalized through its transpose) over 5
  steps across the warmup and the decay; the head's kernel and a bias go to AdamW."""
  c, total, steps = inner_config(), 6, 5
  rng = np.random.default_rng(0)
  params = {"block": {"up": {"kernel": rng.standard_normal((4, 6))},
                      "down": {"kernel": rng.standard_normal((6, 4)),
                               "bias": rng.standard_normal(4)}},
            "head": {"kernel": rng.standard_normal((4, 5))}}
  grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape), params) for _ in range(steps)]
  assert optim.muon_labels(params) == {
      "block": {"up": {"kernel": "muon"}, "down": {"kernel": "muon", "bias": "adamw"}},
      "head": {"kernel": "adamw"}}

  tx = optim.inner_optimizer(c, total)
  p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(jax.tree.map(jnp.asarray, g), state, p)
    p = optax.apply_updates(p, u)
  assert p["block"]["up"]["kernel"].dtype == jnp.float64
  for name in ("up", "down"):
    want = np_muon(c, params["block"][name]["kernel"],
                   [g["block"][name]["kernel"] for g in grads], total)
    np.testing.assert_allclose(p["block"][name]["kernel"], want, rtol=1e-12, atol=1e-12)

  adamw = optax.adamw(optim.inner_schedule(c, total), b1=c.b1, b2=c.b2, eps=c.eps,
                      weight_decay=c.weight_decay, mask=optim._is_matrix)
  q, s = params, adamw.init(params)
  for g in grads:
    u, s = adamw.update(g, s, q)
    q = optax.apply_updates(q, u)
  np.testing.assert_allclose(p["head"]["kernel"], q["head"]["kernel"], rtol=1e-12)
  np.testing.assert_allclose(p["block"]["down"]["bias"], q["block"]["down"]["bias"],
                             rtol=1e-12)


def test_newton_schulz_makes_singular_values_near_one():
  """What the iteration is for: the project's Muon update of a [16, 48] kernel, one step
  on one gradient (no warmup, no weight decay), is -muon_lr x sqrt(48 / 16) x the
  orthogonalized gradient, whose singular values land in about [0.5, 1.5]."""
  m = np.random.default_rng(1).standard_normal((16, 48))
  s = np.linalg.svd(np_orthogonalize(m, 5), compute_uv=False)
  assert 0.5 < s.min() and s.max() < 1.5
  c = inner_config(warmup_steps=0, weight_decay=0.0)
  params = {"block": {"up": {"kernel": jnp.zeros((16, 48))}}}
  tx = optim.inner_optimizer(c, 10)
  update, _ = tx.update({"block": {"up": {"kernel": jnp.asarray(m)}}}, tx.init(params), params)
  update = np.asarray(update["block"]["up"]["kernel"])
  np.testing.assert_allclose(update, np_muon(c, np.zeros((16, 48)), [m], 10), rtol=1e-12,
                             atol=1e-15)
  s = np.linalg.svd(-update / (c.muon_lr * np.sqrt(3)), compute_uv=False)
  assert 0.5 < s.min() and s.max() < 1.5, s
