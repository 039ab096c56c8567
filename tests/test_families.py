"""Model families and your own module: the llama family and a module from this test suite
train through the trainer exactly as `simulate` trains them; their configs are checked."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.loop import trainer
from diloco_jax.models import layers
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from tests.multihost import simulate_trainer
from tests.multihost import small_config

OWN = "tests.custom_model:make"


def max_anchor_diff(result, expected) -> float:
  return max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                          result.outer_state.anchor, expected.params)))


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"model.family": "llama", "model.num_kv_heads": 1},
    {"model.module": OWN, "model.num_layers": 2}],
    ids=["llama-gqa", "own-module"])
def test_trainer_equals_simulate(tmp_path, overrides):
  """The bound and its reason: tests/test_trainer.py::test_trainer_equals_simulate. (Tied
  embeddings and remat train in tests/test_checkpoint.py's delayed-llama resume test.)"""
  config = small_config(**overrides)
  result = trainer.train_and_evaluate(config, str(tmp_path))
  assert max_anchor_diff(result, simulate_trainer(config)) <= 2e-5
  names = set(result.outer_state.anchor)
  if "model.module" in overrides:
    assert names == {"embed", "block_0", "block_1", "head"}
  else:
    assert {"attn_norm", "q", "k", "v", "attn_out", "mlp_norm", "gate", "up", "down"} == set(
        result.outer_state.anchor["block_0"])
    assert "head" in names


def test_llama_shapes_and_counts():
  cfg = family_lib.ModelConfig(vocab_size=50, seq_len=8, num_layers=2, d_model=32, num_heads=4,
                              mlp_dim=48, family="llama", num_kv_heads=2)
  params = model_lib.init_params(cfg, jax.random.key(0))
  block = params["block_0"]
  assert block["q"]["kernel"].shape == (32, 32) and block["k"]["kernel"].shape == (32, 16)
  assert block["gate"]["kernel"].shape == (32, 48) and block["down"]["kernel"].shape == (48, 32)
  assert all("bias" not in layer for layer in block.values())
  n = 50 * 32 + 2 * (2 * 32 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48) + 32 + 32 * 50
  assert model_lib.count_params(params) == model_lib.num_params_of(cfg) == n
  assert model_lib.flops_per_token(cfg, n) == 6 * (n - 50 * 32) + 6 * 2 * 8 * 32


def test_gpt_without_biases():
  """`use_bias=False` drops every bias of the gpt family (Dense layers, LayerNorms) and
  nothing else; the default keeps them; the head has one only with `head_bias` (the
  params of earlier versions)."""
  base = dict(vocab_size=50, seq_len=8, num_layers=2, d_model=32, num_heads=4, mlp_dim=48)
  with_bias = family_lib.ModelConfig(**base)
  params = model_lib.init_params(family_lib.ModelConfig(**base, use_bias=False),
                                 jax.random.key(0))
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  assert not [path for path, _ in leaves if "bias" in jax.tree_util.keystr(path)]
  assert set(params["block_0"]["ln_attn"]) == {"scale"} and set(params["head"]) == {"kernel"}
  # per block: 2 LayerNorm biases, qkv, attn_out, mlp_in, mlp_out; ln_final
  biases = 2 * (2 * 32 + 3 * 32 + 32 + 48 + 32) + 32
  assert model_lib.count_params(params) == model_lib.num_params_of(with_bias) - biases
  assert "bias" in family_lib.param_shapes(with_bias)["block_0"]["qkv"]
  assert "bias" not in family_lib.param_shapes(with_bias)["head"]
  earlier = family_lib.ModelConfig(**base, head_bias=True)
  assert model_lib.num_params_of(earlier) == model_lib.num_params_of(with_bias) + 50


def test_gqa_equals_attention_with_repeated_heads():
  """Grouped-query attention with K key/value heads is full attention whose key and value
  heads are each repeated N/K times: an independent check of the head grouping."""
  base = dict(vocab_size=20, seq_len=8, num_layers=1, d_model=32, num_heads=4, mlp_dim=16,
              family="llama")
  grouped = family_lib.ModelConfig(**base, num_kv_heads=2)
  full = family_lib.ModelConfig(**base)
  params = model_lib.init_params(grouped, jax.random.key(1))

  def repeat(kernel_DxKH):  # heads [k0, k1] -> [k0, k0, k1, k1], as query heads are grouped
    return jnp.repeat(kernel_DxKH.reshape(32, 2, 8), 2, axis=1).reshape(32, 32)

  block = dict(params["block_0"])
  block.update({name: {"kernel": repeat(block[name]["kernel"])} for name in ("k", "v")})
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 20)
  a = family_lib.build(grouped).apply({"params": params}, tokens)
  b = family_lib.build(full).apply({"params": {**params, "block_0": block}}, tokens)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def numpy_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxH, visible_LxS):
  """Attention in float64 numpy, one query head at a time, head i reading key/value head
  i // (N / K)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q_BxLxNxH, k_BxSxKxH, v_BxSxKxH))
  n, kv = q.shape[2], k.shape[2]
  out = np.zeros_like(q)
  for i in range(n):
    scores = q[:, :, i] @ k[:, :, i // (n // kv)].transpose(0, 2, 1) / np.sqrt(q.shape[3])
    scores = np.where(visible_LxS, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out[:, :, i] = (weights / weights.sum(-1, keepdims=True)) @ v[:, :, i // (n // kv)]
  return out


@pytest.mark.parametrize("heads,kv_heads,cache", [(4, 4, 0), (4, 2, 0), (4, 1, 6)],
                         ids=["full", "gqa", "gqa-cache"])
def test_attention_equals_numpy(heads, kv_heads, cache):
  """`layers.attend` against a float64 numpy attention: causal over the call's tokens, and
  (`cache`) 3 queries at positions 2..4 reading a cache of 3 + `cache` slots."""
  rng = np.random.default_rng(0)
  l, s = (3, 3 + cache) if cache else (8, 8)
  q = rng.normal(size=(2, l, heads, 8)).astype(np.float32)
  k, v = (rng.normal(size=(2, s, kv_heads, 8)).astype(np.float32) for _ in range(2))
  positions = np.arange(l) + (2 if cache else 0)
  visible = np.arange(s)[None, :] <= positions[:, None]
  got = layers.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible))
  np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, visible), atol=2e-6)


@pytest.mark.parametrize("shape,use_bias", [((3, 5, 16), True), ((2, 40, 96), False)],
                         ids=["narrow-input", "narrow-output"])
def test_dense_equals_flax_dense(shape, use_bias):
  """`layers.dense` has flax.linen.Dense's params (names, shapes, initial values) and
  computes its outputs and gradients, both weight-gradient forms included."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=shape), jnp.float32)
  ours = layers.dense(32, jnp.float32, use_bias=use_bias)
  flax_dense = nn.Dense(32, use_bias=use_bias, kernel_init=nn.initializers.normal(0.02))
  params = ours.init(jax.random.key(4), x)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, params, flax_dense.init(jax.random.key(4), x)))

  def loss(params, module):
    return jnp.sum(jnp.sin(module.apply(params, x)))

  for a, b in zip(jax.tree.leaves(jax.value_and_grad(loss)(params, ours)),
                  jax.tree.leaves(jax.value_and_grad(loss)(params, flax_dense)), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_cpu_weight_gradients_contract_the_lhs_last_axis():
  """On XLA:CPU no product of the compiled train step contracts its lhs over the first
  axis (the form XLA cannot run on its fast matmul kernels; layers._weight_grad_cpu): with
  plain autodiff, every weight gradient of the model would."""
  cfg = family_lib.ModelConfig(vocab_size=64, seq_len=32, num_layers=2, d_model=64,
                              num_heads=4, mlp_dim=128, use_bias=False)
  params = model_lib.init_params(cfg, jax.random.key(0))
  batch = jnp.zeros((4, 33), jnp.int32)
  hlo = jax.jit(jax.grad(model_lib.make_loss_fn(cfg))).lower(params, batch).compile().as_text()
  assert hlo.count(" dot(") + hlo.count("__ynn_fusion") > 10  # the products are there
  assert "lhs_contracting_dims={0}" not in hlo


@pytest.mark.slow
def test_remat_changes_no_loss_or_gradient():
  cfg = family_lib.ModelConfig(vocab_size=20, seq_len=8, num_layers=2, d_model=16, num_heads=2,
                              mlp_dim=32, family="llama")
  params = model_lib.init_params(cfg, jax.random.key(0))
  batch = jax.random.randint(jax.random.key(3), (2, 9), 0, 20)
  plain = jax.value_and_grad(model_lib.make_loss_fn(cfg))(params, batch)
  remat = jax.value_and_grad(model_lib.make_loss_fn(
      family_lib.ModelConfig(**{**cfg.__dict__, "remat": "block"})))(params, batch)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)


def errors(**overrides) -> str:
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(small_config(**overrides))
  return str(e.value)


def test_bad_model_configs_name_the_field():
  assert errors(**{"model.family": "mamba"}) == (
      "config.model.family = 'mamba': must be one of ('gpt', 'llama')")
  assert errors(**{"model.num_kv_heads": 2}) == (
      "config.model.num_kv_heads = 2: applies to config.model.family = 'llama' only; "
      "leave it at 0")
  assert errors(**{"model.family": "llama", "model.num_heads": 4, "model.num_kv_heads": 3}
                ) == "config.model.num_kv_heads = 3: must divide config.model.num_heads = 4"
  assert errors(**{"model.family": "llama", "model.d_model": 30, "model.num_heads": 2}) == (
      "config.model.d_model = 30: / config.model.num_heads = 15 must be even (rotary "
      "embeddings turn pairs of a head's dimensions)")
  assert errors(**{"model.remat": "all"}) == (
      "config.model.remat = 'all': must be one of ('none', 'block')")
  assert errors(**{"model.module": "tests.no_such_module:make"}) == (
      "config.model.module = 'tests.no_such_module:make': cannot import "
      "tests.no_such_module: ModuleNotFoundError: No module named 'tests.no_such_module'")
  assert errors(**{"model.module": "tests.custom_model"}) == (
      "config.model.module = 'tests.custom_model': must be 'package.module:factory'")
  assert errors(**{"model.module": "tests.custom_model:nothing"}) == (
      "config.model.module = 'tests.custom_model:nothing': tests.custom_model has no "
      "callable 'nothing'")


def test_own_module_that_is_not_a_module(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="returned str, not a flax.linen.Module"):
    trainer.train_and_evaluate(small_config(**{"model.module": "tests.custom_model:not_a_module"}),
                               str(tmp_path))


def test_more_fragments_than_the_modules_blocks(tmp_path):
  """Streaming fragments are made of whole blocks: a module with one block (whatever
  config.model.num_layers says) cannot be cut into two."""
  config = small_config(mode="streaming", **{"model.module": "tests.custom_model:make_one_block",
                                             "model.num_layers": 2, "outer.fragments": 2})
  with pytest.raises(config_lib.ConfigError, match=r"config.outer.fragments = 2: 2 fragments "
                     r"but the model has 1 blocks \(top-level params named block_0"):
    trainer.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_attention_auto_is_todays_on_cpu_and_cudnn_is_refused_where_it_cannot_run(family):
  """'auto' runs today's attention wherever cuDNN's fused kernel cannot (here: a CPU), bit
  for bit; 'cudnn' where it cannot run is one line naming why; on a GPU 'auto' takes
  cuDNN for bf16 and fp16 with head sizes up to 128 in steps of 8 (decided from shapes)."""
  base = dict(vocab_size=16, seq_len=8, num_layers=1, d_model=32, num_heads=2, mlp_dim=32,
              family=family)
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 16)
  logits = {}
  for attention in ("auto", "xla"):
    cfg = family_lib.ModelConfig(**base, attention=attention)
    params = model_lib.init_params(cfg, jax.random.key(1))
    logits[attention] = family_lib.build(cfg).apply({"params": params}, tokens)
    assert model_lib.attention_kernel(cfg, "cpu") == "xla"
  np.testing.assert_array_equal(logits["auto"], logits["xla"])
  cudnn = family_lib.ModelConfig(**base, attention="cudnn")
  with pytest.raises(layers.AttentionError, match=r"^config.model.attention = 'cudnn': it "
                     r"runs on GPUs only \(this backend: cpu\); use 'auto'"):
    model_lib.attention_kernel(cudnn, "cpu")
  bf16 = dict(base, dtype=jnp.bfloat16)
  assert model_lib.attention_kernel(family_lib.ModelConfig(**bf16), "gpu") == "cudnn"
  assert model_lib.attention_kernel(family_lib.ModelConfig(**base), "gpu") == "xla"  # float32
  with pytest.raises(layers.AttentionError, match="bf16 or fp16 compute"):
    model_lib.attention_kernel(cudnn, "gpu")
  wide = dict(bf16, d_model=2 * 136, attention="cudnn")  # head size 136
  with pytest.raises(layers.AttentionError, match="multiple of 8 up to 128, not 136"):
    model_lib.attention_kernel(family_lib.ModelConfig(**wide), "gpu")
