"""The `gpt` family: a GPT-2-style decoder (pre-norm LayerNorm, learned positions, fused
QKV, GELU MLP with the tanh approximation, untied head unless `tie_embeddings`), with
biases in its Dense layers and LayerNorms unless `use_bias` is False. It maps one to one
onto Hugging Face's `GPT2LMHeadModel` (models/hf.py); `head_bias` adds a bias to the head,
which GPT-2 has not (in earlier versions of diloco_jax, the gpt head had one with `use_bias`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco_jax.models import layers


def layer_norm(cfg: Any, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.norm_eps, use_bias=cfg.use_bias, dtype=cfg.dtype,
                      param_dtype=jnp.float32, name=name)


def dense(cfg: Any, features: int, std: float = 0.02, *, name: str) -> nn.Dense:
  return layers.dense(features, cfg.dtype, std, use_bias=cfg.use_bias, name=name)


class Block(nn.Module):
  """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""
  cfg: Any  # model.ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_L: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, l, d = x_BxLxD.shape
    head_dim = d // cfg.num_heads
    # Residual projections are scaled down with depth (GPT-2) so the stream's variance
    # does not grow with the number of blocks.
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5

    h = layer_norm(cfg, "ln_attn")(x_BxLxD)
    qkv = dense(cfg, 3 * d, name="qkv")(h).reshape(b, l, 3, cfg.num_heads, head_dim)
    attn = layers.causal_attention(self, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                   positions_L, decode=self.decode, cache_len=cfg.seq_len,
                                   implementation=cfg.attention)
    x_BxLxD = x_BxLxD + dense(cfg, d, out_std, name="attn_out")(attn.reshape(b, l, d))

    h = layer_norm(cfg, "ln_mlp")(x_BxLxD)
    h = nn.gelu(dense(cfg, cfg.mlp_dim, name="mlp_in")(h), approximate=True)  # GPT-2's gelu_new
    return x_BxLxD + dense(cfg, d, out_std, name="mlp_out")(h)


class GPT(nn.Module):
  """Token + learned position embeddings, `num_layers` blocks, final norm, head."""
  cfg: Any  # model.ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    cfg = self.cfg
    embed = layers.token_embedding(cfg)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.positions, cfg.d_model))
    positions_L = layers.positions(self, tokens_BxL.shape[1], self.decode)
    pos_LxD = jnp.take(pos, positions_L, axis=0) if self.decode else pos[: tokens_BxL.shape[1]]
    x_BxLxD = (embed(tokens_BxL) + pos_LxD).astype(cfg.dtype)
    x_BxLxD = layers.blocks(Block, cfg, self.decode, x_BxLxD, positions_L)
    x_BxLxD = layer_norm(cfg, "ln_final")(x_BxLxD)
    return layers.head(cfg, embed, x_BxLxD, use_bias=cfg.head_bias)
