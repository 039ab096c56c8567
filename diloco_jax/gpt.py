"""The `gpt` family: a GPT-2-style decoder (pre-norm LayerNorm with biases, learned
positions, fused QKV, GELU MLP, untied head unless `tie_embeddings`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco_jax import layers


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

    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_attn")(x_BxLxD)
    qkv = layers.dense(3 * d, cfg.dtype, name="qkv")(h).reshape(b, l, 3, cfg.num_heads,
                                                                head_dim)
    attn = layers.causal_attention(self, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                   positions_L, decode=self.decode, cache_len=cfg.seq_len)
    x_BxLxD = x_BxLxD + layers.dense(d, cfg.dtype, out_std, name="attn_out")(
        attn.reshape(b, l, d))

    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_mlp")(x_BxLxD)
    h = nn.gelu(layers.dense(cfg.mlp_dim, cfg.dtype, name="mlp_in")(h))
    return x_BxLxD + layers.dense(d, cfg.dtype, out_std, name="mlp_out")(h)


class GPT(nn.Module):
  """Token + learned position embeddings, `num_layers` blocks, final norm, head."""
  cfg: Any  # model.ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    cfg = self.cfg
    embed = layers.token_embedding(cfg)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
    positions_L = layers.positions(self, tokens_BxL.shape[1], self.decode)
    pos_LxD = jnp.take(pos, positions_L, axis=0) if self.decode else pos[: tokens_BxL.shape[1]]
    x_BxLxD = (embed(tokens_BxL) + pos_LxD).astype(cfg.dtype)
    x_BxLxD = layers.blocks(Block, cfg, self.decode, x_BxLxD, positions_L)
    x_BxLxD = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_final")(x_BxLxD)
    return layers.head(cfg, embed, x_BxLxD, use_bias=True)
