"""A user's own model, as `config.model.module = "tests.custom_model:make"` names it: not a
transformer, to show that the trainer needs nothing of one. Each block mixes tokens with a
causal running mean (token t sees the mean of tokens 0..t), then an MLP. Its blocks are
named block_0, block_1, ... so that streaming DiLoCo can cut it into fragments."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RunningMeanBlock(nn.Module):
  width: int
  hidden: int

  @nn.compact
  def __call__(self, x_BxLxD):
    counts_L = jnp.arange(1, x_BxLxD.shape[1] + 1, dtype=x_BxLxD.dtype)
    mixed = jnp.cumsum(x_BxLxD, axis=1) / counts_L[None, :, None]
    x_BxLxD = x_BxLxD + nn.Dense(self.width, name="mix")(nn.LayerNorm(name="norm")(mixed))
    return x_BxLxD + nn.Dense(self.width, name="out")(
        jax.nn.relu(nn.Dense(self.hidden, name="hidden")(x_BxLxD)))


class RunningMeanLM(nn.Module):
  vocab_size: int
  width: int
  hidden: int
  num_blocks: int

  @nn.compact
  def __call__(self, tokens_BxL):
    x_BxLxD = nn.Embed(self.vocab_size, self.width, name="embed")(tokens_BxL)
    for i in range(self.num_blocks):
      x_BxLxD = RunningMeanBlock(self.width, self.hidden, name=f"block_{i}")(x_BxLxD)
    return nn.Dense(self.vocab_size, name="head")(x_BxLxD).astype(jnp.float32)


def make(cfg):
  """The factory: a diloco_jax.model.ModelConfig in, a Flax module out."""
  return RunningMeanLM(cfg.vocab_size, cfg.d_model, cfg.mlp_dim, cfg.num_layers)


def not_a_module(cfg):
  del cfg
  return "a string"


def make_one_block(cfg):
  """A module with fewer blocks than config.model.num_layers says (1)."""
  return RunningMeanLM(cfg.vocab_size, cfg.d_model, cfg.mlp_dim, 1)
