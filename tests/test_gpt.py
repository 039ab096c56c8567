"""The GPT: causality, shapes, dtypes, and the loss at initialisation."""

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.models import family

from diloco_jax.models import model as model_lib

CFG = family.ModelConfig(vocab_size=17, seq_len=12, num_layers=2, d_model=32, num_heads=4,
                          mlp_dim=64)


def test_causal():
  """Changing token j changes no logits before position j."""
  params = model_lib.init_params(CFG, jax.random.key(0))
  model = family.build(CFG)
  tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab_size)
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % CFG.vocab_size)
  a = model.apply({"params": params}, tokens)
  b = model.apply({"params": params}, changed)
  assert a.shape == (2, CFG.seq_len, CFG.vocab_size)
  np.testing.assert_array_equal(a[:, :7], b[:, :7])
  assert not np.allclose(a[:, 7:], b[:, 7:])


def test_params_float32_with_bf16_compute():
  cfg = family.ModelConfig(**{**CFG.__dict__, "dtype": jnp.bfloat16})
  params = model_lib.init_params(cfg, jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  assert family.build(cfg).apply({"params": params}, tokens).dtype == jnp.float32
  loss = model_lib.make_loss_fn(cfg)(params, jnp.zeros((2, cfg.seq_len + 1), jnp.int32))
  assert jnp.isfinite(loss)


def test_initial_loss_near_uniform():
  """Small init: the first loss is close to log(vocab), the loss of a uniform guess."""
  params = model_lib.init_params(CFG, jax.random.key(0))
  batch = jax.random.randint(jax.random.key(2), (8, CFG.seq_len + 1), 0, CFG.vocab_size)
  loss = model_lib.make_loss_fn(CFG)(params, batch)
  assert abs(float(loss) - np.log(CFG.vocab_size)) < 0.1


def test_param_count_and_flops():
  params = model_lib.init_params(CFG, jax.random.key(0))
  d, f, v, l = CFG.d_model, CFG.mlp_dim, CFG.vocab_size, CFG.seq_len
  block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
  expected = v * d + l * d + CFG.num_layers * block + 2 * d + d * v  # the head: no bias (GPT-2)
  assert model_lib.count_params(params) == expected
  assert model_lib.flops_per_token(CFG, expected) == (
      6 * (expected - (v + l) * d) + 6 * CFG.num_layers * l * d)
