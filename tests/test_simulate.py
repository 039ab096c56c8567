"""`simulate` against an independent numpy DiLoCo, and the invariants of docs/algorithms.md §8."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import diloco_jax
from diloco_jax import config as config_lib
from diloco_jax.algo import optim

T, K, H, B, D, O = 3, 3, 4, 5, 4, 2  # rounds, replicas, inner steps, batch, in, out


@pytest.fixture(autouse=True)
def x64():
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


def loss_fn(params, batch):
  residual = batch["x"] @ params["w"] + params["b"] - batch["y"]
  return jnp.mean(residual ** 2)


def np_grads(params, batch):
  """Hand-derived gradient of mean((x w + b − y)²) over the B×O residual entries."""
  residual = batch["x"] @ params["w"] + params["b"] - batch["y"]
  scale = 2.0 / residual.size
  return {"w": scale * batch["x"].T @ residual, "b": scale * residual.sum(axis=0)}


def make_problem(seed=0):
  rng = np.random.default_rng(seed)
  batches = {"x": rng.normal(size=(T, K, H, B, D)), "y": rng.normal(size=(T, K, H, B, O))}
  params = {"w": rng.normal(size=(D, O)) * 0.1, "b": np.zeros(O)}
  return params, batches


def np_schedule(step, inner, total):
  if step < inner.warmup_steps:
    return inner.lr * step / inner.warmup_steps
  end = inner.lr * inner.final_lr_fraction
  frac = (step - inner.warmup_steps) / (total - inner.warmup_steps)
  return end + (inner.lr - end) * 0.5 * (1 + np.cos(np.pi * frac))


class NumpyAdamW:
  """AdamW + global-norm clipping + warmup/cosine, written from the formulas."""

  def __init__(self, inner, total, params):
    self.inner, self.total, self.count = inner, total, 0
    self.mu = {k: np.zeros_like(v) for k, v in params.items()}
    self.nu = {k: np.zeros_like(v) for k, v in params.items()}

  def step(self, params, grads):
    c = self.inner
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
    if norm > c.clip_norm:
      grads = {k: g * c.clip_norm / norm for k, g in grads.items()}
    lr = np_schedule(self.count, c, self.total)
    self.count += 1
    out = {}
    for k, g in grads.items():
      self.mu[k] = c.b1 * self.mu[k] + (1 - c.b1) * g
      self.nu[k] = c.b2 * self.nu[k] + (1 - c.b2) * g * g
      mu_hat = self.mu[k] / (1 - c.b1 ** self.count)
      nu_hat = self.nu[k] / (1 - c.b2 ** self.count)
      update = mu_hat / (np.sqrt(nu_hat) + c.eps)
      if params[k].ndim >= 2:  # decay matrices only
        update = update + c.weight_decay * params[k]
      out[k] = params[k] - lr * update
    return out


def np_diloco(params, batches, inner, outer_lr, momentum):
  """docs/algorithms.md §2 in numpy: K replicas, H AdamW steps, Nesterov on the mean Δ."""
  anchor = {k: v.copy() for k, v in params.items()}
  buf = {k: np.zeros_like(v) for k, v in params.items()}
  opts = [NumpyAdamW(inner, T * H, params) for _ in range(K)]
  losses = np.zeros((T, K, H))
  for t in range(T):
    deltas = []
    for m in range(K):
      local = {k: v.copy() for k, v in anchor.items()}
      for h in range(H):
        batch = {k: v[t, m, h] for k, v in batches.items()}
        residual = batch["x"] @ local["w"] + local["b"] - batch["y"]
        losses[t, m, h] = np.mean(residual ** 2)
        local = opts[m].step(local, np_grads(local, batch))
      deltas.append({k: anchor[k] - local[k] for k in anchor})
    for k in anchor:
      mean = sum(d[k] for d in deltas) / K
      buf[k] = momentum * buf[k] + mean
      anchor[k] = anchor[k] - outer_lr * (mean + momentum * buf[k])
  return anchor, losses


def inner_config(**overrides):
  inner = config_lib.get_default_config().inner
  inner.update(dict(lr=0.05, warmup_steps=3, final_lr_fraction=0.1, weight_decay=0.1,
                    b1=0.9, b2=0.95, eps=1e-8, clip_norm=0.5))
  inner.update(overrides)
  return inner


@pytest.mark.device
def test_sync_matches_numpy_float64():
  params, batches = make_problem()
  inner = inner_config()
  outer = ml_collections.ConfigDict(dict(lr=0.7, momentum=0.9, nesterov=True))
  result = diloco_jax.simulate(
      loss_fn, params, batches, inner_optimizer=optim.inner_optimizer(inner, T * H),
      outer_optimizer=optim.outer_optimizer(outer))
  expected, expected_losses = np_diloco(params, batches, inner, 0.7, 0.9)
  assert result.params["w"].dtype == jnp.float64
  for k in expected:
    np.testing.assert_allclose(result.params[k], expected[k], atol=1e-10, rtol=0)
  np.testing.assert_allclose(result.losses, expected_losses, atol=1e-10, rtol=0)
  # Clipping, warmup and decay all took effect, so the test exercises them.
  assert not np.allclose(result.params["w"], params["w"])


def test_h1_sgd_equals_data_parallel_sgd():
  """H=1, inner SGD(η), outer SGD(1, μ=0) ≡ data-parallel SGD(η) on the mean gradient."""
  params, batches = make_problem(1)
  batches = {k: v[:, :, :1] for k, v in batches.items()}  # H = 1
  eta = 0.1
  result = diloco_jax.simulate(loss_fn, params, batches, inner_optimizer=optax.sgd(eta),
                               outer_optimizer=optax.sgd(1.0))
  p = {k: v.copy() for k, v in params.items()}
  for t in range(T):
    grads = [np_grads(p, {k: v[t, m, 0] for k, v in batches.items()}) for m in range(K)]
    p = {k: p[k] - eta * sum(g[k] for g in grads) / K for k in p}
  for k in p:
    np.testing.assert_allclose(result.params[k], p[k], atol=1e-13, rtol=0)


def test_one_replica_equals_plain_training():
  """K=1, outer SGD(1, μ=0) ≡ plain training with the inner optimizer (state carried)."""
  params, batches = make_problem(2)
  batches = {k: v[:, :1] for k, v in batches.items()}  # K = 1
  inner_opt = optim.inner_optimizer(inner_config(), T * H)
  result = diloco_jax.simulate(loss_fn, params, batches, inner_optimizer=inner_opt,
                               outer_optimizer=optax.sgd(1.0))
  p, opt_state = params, inner_opt.init(params)
  for t in range(T):
    for h in range(H):
      grads = jax.grad(loss_fn)(p, {k: v[t, 0, h] for k, v in batches.items()})
      updates, opt_state = inner_opt.update(grads, opt_state, p)
      p = optax.apply_updates(p, updates)
  for k in p:  # θ − (θ − θ₁) may differ from θ₁ by an ulp (docs/algorithms.md §8).
    np.testing.assert_allclose(result.params[k], p[k], atol=1e-14, rtol=0)
  # The inner state was carried across rounds, never reset: T·H steps were counted.
  counts = [x for x in jax.tree.leaves(result.replicas.opt_state) if x.dtype == jnp.int32]
  assert counts and all(int(np.max(c)) == T * H for c in counts)


def test_zero_outer_lr_keeps_anchor():
  params, batches = make_problem(3)
  result = diloco_jax.simulate(loss_fn, params, batches, inner_optimizer=optax.sgd(0.1),
                               outer_optimizer=optax.sgd(0.0, momentum=0.9, nesterov=True))
  for k in params:
    np.testing.assert_array_equal(result.params[k], params[k])


def test_identical_replicas_equal_one_replica():
  """K replicas fed identical batches ≡ K = 1 (docs/algorithms.md §8)."""
  params, batches = make_problem(4)
  same = {k: np.repeat(v[:, :1], K, axis=1) for k, v in batches.items()}
  one = {k: v[:, :1] for k, v in batches.items()}
  kwargs = dict(inner_optimizer=optim.inner_optimizer(inner_config(), T * H),
                outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
  a = diloco_jax.simulate(loss_fn, params, same, **kwargs)
  b = diloco_jax.simulate(loss_fn, params, one, **kwargs)
  for k in params:
    np.testing.assert_allclose(a.params[k], b.params[k], atol=1e-14, rtol=0)


def test_constant_mock_closed_form():
  """Each inner step adds −c: Δ = Hc, and with μ=0, θ^(r) = θ⁰ − rηHc (docs/algorithms.md §8)."""
  c, eta = 0.25, 0.5
  params = {"w": np.ones(3)}
  batches = {"x": np.zeros((T, K, H, 1))}
  linear = lambda p, b: jnp.sum(p["w"]) * c + 0 * jnp.sum(b["x"])  # gradient c everywhere
  result = diloco_jax.simulate(linear, params, batches, inner_optimizer=optax.sgd(1.0),
                               outer_optimizer=optax.sgd(eta))
  np.testing.assert_allclose(result.params["w"], 1 - T * eta * H * c, atol=1e-14)


def test_bad_batches_rejected():
  params, batches = make_problem()
  with pytest.raises(ValueError, match="leading dims"):
    diloco_jax.simulate(loss_fn, params, {"x": np.zeros((3, 2))},
                        inner_optimizer=optax.sgd(0.1), outer_optimizer=optax.sgd(1.0))
  with pytest.raises(ValueError, match="mode"):
    diloco_jax.simulate(loss_fn, params, batches, inner_optimizer=optax.sgd(0.1),
                        outer_optimizer=optax.sgd(1.0), mode="bogus")
