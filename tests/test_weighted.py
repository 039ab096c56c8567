"""Unequal inner steps per replica and the token-weighted outer step (docs/algorithms.md
§9) in `simulate`, against independent float64 numpy implementations written here from
the definitions: the weighted mean Δ̄ = Σ_m w_m Δ_m / Σ_m w_m with w_m the replica's
tokens (its steps × the batch's tokens), and in eager each replica's own weighted share
w_m Δ_m / Σw now and the others' one round late."""

import jax
import numpy as np
import optax
import pytest

import diloco_jax
from diloco_jax.algo import optim
from tests.test_async import LR
from tests.test_async import MU
from tests.test_async import nesterov
from tests.test_simulate import B
from tests.test_simulate import D
from tests.test_simulate import H
from tests.test_simulate import K
from tests.test_simulate import NumpyAdamW
from tests.test_simulate import O
from tests.test_simulate import T
from tests.test_simulate import inner_config
from tests.test_simulate import loss_fn
from tests.test_simulate import make_problem
from tests.test_simulate import np_grads

# Round 1: replica 2 idle; round 2: one step against four; round 3: all H.
STEPS = np.array([[4, 2, 0], [1, 4, 3], [4, 4, 4]])
assert STEPS.shape == (T, K) and STEPS.max() == H


@pytest.fixture(autouse=True)
def x64():
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


def phase(start, opt, batches, t, m, steps):
  local = {n: v.copy() for n, v in start.items()}
  for h in range(steps):
    batch = {n: v[t, m, h] for n, v in batches.items()}
    local = opt.step(local, np_grads(local, batch))
  return local


def weighted_mean(deltas, w):
  return {n: sum(w[m] * d[n] for m, d in enumerate(deltas)) / w.sum() for n in deltas[0]}


def np_weighted(mode, params, batches, inner, steps):
  """sync: apply this round's weighted mean; delayed: the previous round's; eager (§4
  with weights): replica m applies w_m Δ_m/Σw + (Δ̄_prev − w_m,prev Δ_m,prev/Σw_prev)."""
  opts = [NumpyAdamW(inner, T * H, params) for _ in range(K)]
  copy = lambda tree: {n: v.copy() for n, v in tree.items()}
  zeros = {n: np.zeros_like(v) for n, v in params.items()}
  if mode == "eager":
    theta, buf = [copy(params) for _ in range(K)], [copy(zeros) for _ in range(K)]
    prev_share, prev_mean = [copy(zeros) for _ in range(K)], copy(zeros)
    for t in range(T):
      w = steps[t].astype(np.float64)
      deltas = [{n: theta[m][n] - v[n] for n in params}
                for m, v in enumerate(phase(theta[m], opts[m], batches, t, m, steps[t, m])
                                      for m in range(K))]
      share = [{n: w[m] * deltas[m][n] / w.sum() for n in params} for m in range(K)]
      for m in range(K):
        grad = {n: share[m][n] + prev_mean[n] - prev_share[m][n] for n in params}
        theta[m], buf[m] = nesterov(theta[m], buf[m], grad)
      prev_share, prev_mean = share, weighted_mean(deltas, w)
    final = [{n: theta[m][n] - LR * (1 + MU) * (prev_mean[n] - prev_share[m][n])
              for n in params} for m in range(K)]
    return {n: sum(f[n] for f in final) / K for n in params}
  anchor, buf, in_flight = copy(params), copy(zeros), None
  for t in range(T):
    locals_ = [phase(anchor, opts[m], batches, t, m, steps[t, m]) for m in range(K)]
    mean = weighted_mean([{n: anchor[n] - l[n] for n in anchor} for l in locals_],
                         steps[t].astype(np.float64))
    if mode == "sync":
      anchor, buf = nesterov(anchor, buf, mean)
    else:
      if in_flight is not None:
        anchor, buf = nesterov(anchor, buf, in_flight)
      in_flight = mean
  if mode == "delayed":
    anchor, buf = nesterov(anchor, buf, in_flight)
  return anchor


def run(mode, params, batches, inner, steps):
  return diloco_jax.simulate(
      loss_fn, params, batches, inner_optimizer=optim.inner_optimizer(inner, T * H),
      outer_optimizer=optax.sgd(LR, momentum=MU, nesterov=True), mode=mode, steps=steps)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["sync", "delayed", "eager"])
def test_uneven_steps_match_numpy_float64(mode):
  params, batches = make_problem(7)
  inner = inner_config()
  result = run(mode, params, batches, inner, STEPS)
  expected = np_weighted(mode, params, batches, inner, STEPS)
  for n in expected:
    np.testing.assert_allclose(result.params[n], expected[n], atol=1e-12, rtol=0)
  # The steps a replica did not train have no loss; the others are real.
  trained = np.arange(H)[None, None] < STEPS[..., None]
  assert np.isnan(result.losses[~trained]).all() and np.isfinite(result.losses[trained]).all()
  uniform = run(mode, params, batches, inner, np.full((T, K), H))
  assert not np.allclose(result.params["w"], uniform.params["w"], atol=1e-6)


@pytest.mark.parametrize("mode", ["sync", "delayed", "eager"])
def test_equal_steps_are_the_unweighted_rule_bit_for_bit(mode):
  """Every replica at H: the weights are equal, each scale exactly 1.0."""
  params, batches = make_problem(8)
  inner = inner_config()
  weighted = run(mode, params, batches, inner, np.full((T, K), H))
  plain = run(mode, params, batches, inner, None)
  for n in params:
    np.testing.assert_array_equal(weighted.params[n], plain.params[n])
  np.testing.assert_array_equal(weighted.losses, plain.losses)


@pytest.mark.device
@pytest.mark.parametrize("mode", ["sync", "delayed", "eager"])
def test_equal_steps_over_five_rounds_are_the_plain_program(mode):
  """K = 3, T = 5, H = 4, AdamW inner, Nesterov outer, float64: steps = H everywhere gives
  every bit of steps=None (params, losses, the outer state), as the trainer's equal-speed
  hosts give plain DiLoCo's; the weighted program was once an ulp (2.2e-16) away here."""
  t = 5
  rng = np.random.default_rng(11)
  batches = {"x": rng.normal(size=(t, K, H, B, D)), "y": rng.normal(size=(t, K, H, B, O))}
  params = {"w": rng.normal(size=(D, O)) * 0.1, "b": np.zeros(O)}
  kw = dict(inner_optimizer=optim.inner_optimizer(inner_config(), t * H),
            outer_optimizer=optax.sgd(LR, momentum=MU, nesterov=True), mode=mode)
  weighted = diloco_jax.simulate(loss_fn, params, batches, steps=np.full((t, K), H), **kw)
  plain = diloco_jax.simulate(loss_fn, params, batches, **kw)
  for a, b in zip(jax.tree.leaves(weighted), jax.tree.leaves(plain), strict=True):
    np.testing.assert_array_equal(a, b)


def test_bad_steps_are_refused():
  params, batches = make_problem(9)
  inner = inner_config()
  bad = {
      "no replica trains in round\\(s\\) \\[2\\]: the weights of that round's mean are all "
      "zero": np.array([[1, 1, 1], [0, 0, 0], [1, 1, 1]]),
      "steps must be in 0..H = 4, got -1..4": np.array([[4, 4, -1]] * T),
      "steps must be integers of shape \\[T, K\\] = \\(3, 3\\)": np.full((T, K), 2.0),
  }
  for message, steps in bad.items():
    with pytest.raises(ValueError, match=message):
      run("sync", params, batches, inner, steps)
  with pytest.raises(ValueError, match="steps= is for sync, delayed and eager"):
    run("streaming", params, batches, inner, STEPS)
