"""The `llama` family: RMSNorm, rotary positions, SwiGLU MLP, no biases, grouped-query
attention (`num_kv_heads` ≤ `num_heads`), optionally tied embeddings.

Param names and layouts map one to one onto Hugging Face's `LlamaForCausalLM` (export.py
does the renaming and transposes kernels); rotary embeddings use its half-split
convention, so no permutation of the q/k projections is needed either way.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from diloco_jax.models import layers


class Block(nn.Module):
  """x + attn(rmsnorm(x)), then x + down(silu(gate(h)) · up(h)) with h = rmsnorm(x)."""
  cfg: Any  # model.ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_L: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, l, d = x_BxLxD.shape
    n, k = cfg.num_heads, cfg.kv_heads
    h = d // n
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5  # as the gpt family: depth-scaled

    def dense(features, name, std=0.02):
      return layers.dense(features, cfg.dtype, std, use_bias=False, name=name)

    x = layers.RMSNorm(cfg.norm_eps, cfg.dtype, name="attn_norm")(x_BxLxD)
    q_BxLxNxH = layers.rope(dense(n * h, "q")(x).reshape(b, l, n, h), positions_L,
                            cfg.rope_base)
    k_BxLxKxH = layers.rope(dense(k * h, "k")(x).reshape(b, l, k, h), positions_L,
                            cfg.rope_base)
    v_BxLxKxH = dense(k * h, "v")(x).reshape(b, l, k, h)
    attn = layers.causal_attention(self, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, positions_L,
                                   decode=self.decode, cache_len=cfg.seq_len,
                                   implementation=cfg.attention)
    x_BxLxD = x_BxLxD + dense(d, "attn_out", out_std)(attn.reshape(b, l, n * h))

    x = layers.RMSNorm(cfg.norm_eps, cfg.dtype, name="mlp_norm")(x_BxLxD)
    x = nn.silu(dense(cfg.mlp_dim, "gate")(x)) * dense(cfg.mlp_dim, "up")(x)
    return x_BxLxD + dense(d, "down", out_std)(x)


class Llama(nn.Module):
  """Token embeddings, `num_layers` blocks, final RMSNorm, head (or the embeddings')."""
  cfg: Any  # model.ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    cfg = self.cfg
    embed = layers.token_embedding(cfg)
    positions_L = layers.positions(self, tokens_BxL.shape[1], self.decode)
    x_BxLxD = layers.blocks(Block, cfg, self.decode, embed(tokens_BxL).astype(cfg.dtype),
                            positions_L)
    x_BxLxD = layers.RMSNorm(cfg.norm_eps, cfg.dtype, name="final_norm")(x_BxLxD)
    return layers.head(cfg, embed, x_BxLxD, use_bias=False)
