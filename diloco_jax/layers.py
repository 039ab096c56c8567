"""Pieces the model families share: dense layers, RMSNorm, rotary positions, and causal
attention with an optional KV cache (for sampling).

Names follow the shapes: B batch, L the tokens of this call, S the cache's length, D the
residual width, N query heads, K key/value heads (N % K == 0: grouped-query attention), H
the head width.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def dense(features: int, dtype: Any, std: float = 0.02, *, use_bias: bool = True,
          name: str | None = None) -> nn.Dense:
  """A float32-param Dense computing in `dtype`, N(0, std) kernel init."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(std), name=name)


class RMSNorm(nn.Module):
  """x / sqrt(mean(x²) + eps) · scale, the statistics in float32 whatever the compute
  dtype (the Llama convention: normalise in float32, cast, then scale)."""
  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (scale * normed.astype(self.dtype)).astype(self.dtype)


def rope(x_BxLxNxH: jax.Array, positions_L: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding in the half-split convention (Hugging Face's Llama): the
  pair (x_i, x_{i+H/2}) is rotated by position · base^(−2i/H). Computed in float32."""
  h = x_BxLxNxH.shape[-1]
  inv_freq_H2 = 1.0 / base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  angles_LxH2 = positions_L.astype(jnp.float32)[:, None] * inv_freq_H2[None, :]
  cos_LxH = jnp.cos(jnp.concatenate([angles_LxH2, angles_LxH2], -1))[None, :, None, :]
  sin_LxH = jnp.sin(jnp.concatenate([angles_LxH2, angles_LxH2], -1))[None, :, None, :]
  x = x_BxLxNxH.astype(jnp.float32)
  rotated = jnp.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
  return (x * cos_LxH + rotated * sin_LxH).astype(x_BxLxNxH.dtype)


def causal_attention(module: nn.Module, q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array,
                     v_BxLxKxH: jax.Array, positions_L: jax.Array, *, decode: bool,
                     cache_len: int) -> jax.Array:
  """Causal attention through `jax.nn.dot_product_attention` (a GPU gets its fused
  kernel). With `decode`, k and v are written into `module`'s "cache" collection at
  `positions_L` (contiguous) and the queries attend to every cached position up to their
  own: one call prefills a prompt, the next ones add a token each."""
  if not decode:
    return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True)
  b, _, kv_heads, h = k_BxLxKxH.shape
  ready = module.has_variable("cache", "key")
  key = module.variable("cache", "key", jnp.zeros, (b, cache_len, kv_heads, h),
                        k_BxLxKxH.dtype)
  value = module.variable("cache", "value", jnp.zeros, (b, cache_len, kv_heads, h),
                          v_BxLxKxH.dtype)
  if not ready:  # creating the cache: only its shapes matter
    return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True)
  start = (0, positions_L[0], 0, 0)
  key.value = jax.lax.dynamic_update_slice(key.value, k_BxLxKxH, start)
  value.value = jax.lax.dynamic_update_slice(value.value, v_BxLxKxH, start)
  visible_LxS = jnp.arange(cache_len)[None, :] <= positions_L[:, None]
  return jax.nn.dot_product_attention(q_BxLxNxH, key.value, value.value,
                                      mask=visible_LxS[None, None])


def positions(module: nn.Module, length: int, decode: bool) -> jax.Array:
  """The positions of this call's tokens: 0..L−1, or with `decode` the next L after
  those already in the cache (a counter in the "cache" collection)."""
  if not decode:
    return jnp.arange(length)
  ready = module.has_variable("cache", "position")
  count = module.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
  start = count.value
  if ready:
    count.value = start + length
  return start + jnp.arange(length)


# The decoder trunk both families share: called inside a module's compact __call__, so the
# submodules they create are that module's (embed, block_<i>, head).


def token_embedding(cfg: Any) -> nn.Embed:
  return nn.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.float32,
                  embedding_init=nn.initializers.normal(0.02), name="embed")


def blocks(block: type[nn.Module], cfg: Any, decode: bool, x_BxLxD: jax.Array,
           positions_L: jax.Array) -> jax.Array:
  """`cfg.num_layers` blocks named block_<i> (streaming fragments are cut by these
  names), each rematerialised in the backward pass when cfg.remat is "block"."""
  block = nn.remat(block) if cfg.remat == "block" else block
  for i in range(cfg.num_layers):
    x_BxLxD = block(cfg, decode, name=f"block_{i}")(x_BxLxD, positions_L)
  return x_BxLxD


def head(cfg: Any, embed: nn.Embed, x_BxLxD: jax.Array, *, use_bias: bool) -> jax.Array:
  """float32 logits: the embedding table transposed when tied, else a "head" Dense."""
  if cfg.tie_embeddings:
    return embed.attend(x_BxLxD.astype(jnp.float32)).astype(jnp.float32)
  logits_BxLxV = dense(cfg.vocab_size, cfg.dtype, use_bias=use_bias, name="head")(x_BxLxD)
  return logits_BxLxV.astype(jnp.float32)
