"""Encodings of pseudo-gradients (compress.py) and robust aggregation (aggregate.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.algo import aggregate
from diloco_jax.algo import compress


def sample(n=10_000, seed=0):
  rng = np.random.default_rng(seed)
  # Blocks of very different magnitudes, as the layers of a model have.
  return (rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-4, 1, n // 100 + 1),
                                             100)[:n]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["none", "bf16", "int8", "4bit", "2bit"])
def test_round_trip_within_bound(fmt):
  x = sample()
  y = compress.decode(compress.encode(x, fmt))
  assert y.dtype == np.float32 and y.shape == x.shape
  assert (np.abs(y - x) <= compress.error_bound(x, fmt)).all()


def test_exactly_representable_values_survive():
  rng = np.random.default_rng(1)
  c = np.float32(0.03125)  # a power of two: k * c and the scale are exact
  for fmt, qmax in (("int8", 127), ("4bit", 7)):
    k = rng.integers(-qmax, qmax + 1, 4 * compress.BLOCK)
    k[::compress.BLOCK] = qmax  # every block's largest entry sets its scale to c
    x = (k * c).astype(np.float32)
    np.testing.assert_array_equal(compress.decode(compress.encode(x, fmt)), x)
  x = rng.standard_normal(1000).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(compress.decode(compress.encode(x, "bf16")), x)
  zeros = np.zeros(300, np.float32)
  for fmt in compress.FORMATS:
    np.testing.assert_array_equal(compress.decode(compress.encode(zeros, fmt)), zeros)


def test_bytes_on_the_wire():
  n = 1 << 20
  x = sample(n)
  fp32 = 4 * n
  assert compress.encode(x, "none").nbytes == fp32
  assert compress.encode(x, "bf16").nbytes == fp32 // 2
  assert compress.encode(x, "int8").nbytes <= 0.27 * fp32  # scales included
  assert compress.encode(x, "4bit").nbytes <= 0.15 * fp32
  assert compress.encode(x, "2bit").nbytes == n // 4 + 4 * (n // compress.BLOCK)
  enc = compress.encode(x, "topk", topk_fraction=0.01)
  k = round(0.01 * n)
  assert enc.nbytes == 8 * k  # int32 index + float32 value each


def test_two_bit_levels():
  """Four levels ±s/2, ±3s/2 with s = max|x|/1.5 per block: each entry goes to the middle
  of its cell [qs, (q + 1)s), the block's extremes exactly; a full block and a padded one."""
  x = np.array([1.5, 0.7, 0.2, -0.2, -0.9, -1.5, 3.0, 2.9, -0.1, 0.0], np.float32)
  y = compress.decode(compress.encode(x, "2bit", block=6), block=6)
  # Block 2: s = 3.0 / 1.5 = 2: 3.0 and 2.9 -> 3.0 (cell [2, 4)), -0.1 -> -1, 0 -> 1.
  np.testing.assert_array_equal(y, np.array([1.5, 0.5, 0.5, -0.5, -0.5, -1.5,
                                             3.0, 3.0, -1.0, 1.0], np.float32))


def test_topk_keeps_the_largest_entries_exactly():
  x = sample(5000)
  y = compress.decode(compress.encode(x, "topk", topk_fraction=0.1))
  kept = y != 0
  assert kept.sum() == 500
  np.testing.assert_array_equal(y[kept], x[kept])
  assert np.abs(x[~kept]).max() <= np.abs(x[kept]).min()


def honest_and_bad(bad):
  rng = np.random.default_rng(2)
  honest = 1.0 + 0.01 * rng.standard_normal((7, 1000)).astype(np.float32)
  deltas = np.concatenate([honest, bad(honest[:1])])
  return jnp.asarray(deltas), honest.mean(axis=0)


@pytest.mark.parametrize("bad", [lambda h: h * 1e6, lambda h: np.full_like(h, np.nan),
                                 lambda h: np.full_like(h, -np.inf)])
def test_robust_aggregation_ignores_one_bad_replica(bad):
  deltas, honest = honest_and_bad(bad)
  # K = 8, trim 0.2: one value dropped from each end of every coordinate, the bad one among
  # them (NaN and x 1e6 sort last, -Inf first); the rest are the honest values, sorted.
  rows = np.sort(np.asarray(deltas[:7], np.float64), axis=0)
  kept = rows[:-1] if (np.asarray(deltas[7]) < rows[0]).all() else rows[1:]
  want = {"trimmed_mean": kept.mean(axis=0), "median": (kept[2] + kept[3]) / 2}
  for how in ("trimmed_mean", "median"):
    got = np.asarray(aggregate.aggregate(deltas, how, trim=0.2))
    np.testing.assert_allclose(got, want[how], rtol=2e-6, err_msg=how)  # float32 sums
    assert (np.abs(got - honest) <= rows[-1] - rows[0]).all(), how  # within the spread
  mean = np.asarray(aggregate.aggregate(deltas, "mean"))
  assert not (np.abs(mean - honest) < 0.05).all()


def test_trimmed_mean_and_median_values():
  d = jnp.asarray([[1.0], [2.0], [3.0], [4.0], [100.0]])
  assert float(aggregate.aggregate(d, "trimmed_mean", trim=0.2)[0]) == 3.0  # (2+3+4)/3
  assert float(aggregate.aggregate(d, "median")[0]) == 3.0
  assert float(aggregate.aggregate(d[:4], "median")[0]) == 2.5


def test_too_few_replicas_for_the_trim_is_an_error():
  with pytest.raises(ValueError, match="K = 4 replicas trims 0 from each end"):
    aggregate.check("trimmed_mean", 4, 0.2)
  aggregate.check("trimmed_mean", 5, 0.2)
  with pytest.raises(ValueError, match="median over K = 2"):
    aggregate.check("median", 2, 0.2)


def test_one_host_encoded_sum_is_the_round_trip_twice():
  from diloco_jax.wire import collective
  x = sample(1000)
  rt = lambda v: compress.decode(compress.encode(v, "int8"))
  padded = np.pad(x, (0, 24))  # whole 256-entry blocks
  got, carried = collective.LocalCollective().reduce_encoded(x[None], "int8")
  np.testing.assert_array_equal(got, rt(rt(padded))[:1000])
  np.testing.assert_array_equal(carried[0], rt(padded)[:1000])  # what error feedback sees
