"""Pieces the model families share: dense layers, RMSNorm, rotary positions, and causal
attention with an optional KV cache (for sampling), written in the layouts XLA:CPU runs
fastest where that costs other platforms nothing.

Names follow the shapes: B batch, L the tokens of this call, S the cache's length, D the
residual width, N query heads, K key/value heads (N % K == 0: grouped-query attention), H
the head width.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco_jax import errors


def dense(features: int, dtype: Any, std: float = 0.02, *, use_bias: bool = True,
          name: str | None = None) -> Dense:
  """A float32-param Dense computing in `dtype`, N(0, std) kernel init."""
  return Dense(features, dtype, nn.initializers.normal(std), use_bias=use_bias, name=name)


class Dense(nn.Module):
  """y = x · kernel (+ bias) over the last axis: `flax.linen.Dense`'s params (the same
  names, shapes and initialization order), with the weight gradient computed in the
  layout XLA:CPU runs fastest (`matmul`)."""
  features: int
  dtype: Any
  kernel_init: Any
  use_bias: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                        jnp.float32)
    tokens = math.prod(x.shape[:-1])  # not -1: a width of 0 must reshape too
    y = matmul(x.reshape(tokens, x.shape[-1]).astype(self.dtype), kernel.astype(self.dtype))
    y = y.reshape(*x.shape[:-1], self.features)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
      y = y + bias.astype(self.dtype)
    return y


@jax.custom_vjp
def matmul(x_TxI: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x · w, whose backward pass computes the weight gradient xᵀ · dy as XLA:CPU runs it
  fastest (`_weight_grad_cpu`) and like plain autodiff on every other platform."""
  return jnp.dot(x_TxI, w_IxO)


def _matmul_fwd(x_TxI, w_IxO):
  return jnp.dot(x_TxI, w_IxO), (x_TxI, w_IxO)


def _matmul_bwd(residuals, dy_TxO):
  x_TxI, w_IxO = residuals
  dw_IxO = jax.lax.platform_dependent(x_TxI, dy_TxO, cpu=_weight_grad_cpu,
                                      default=_weight_grad)
  return jnp.dot(dy_TxO, w_IxO.T), dw_IxO


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _weight_grad(x_TxI, dy_TxO):
  return jnp.dot(x_TxI.T, dy_TxO)


def _weight_grad_cpu(x_TxI, dy_TxO):
  # xᵀ · dy contracts the tokens, the first axis of both operands. XLA:CPU hands a dot to
  # its fast YNNPACK kernels only when the lhs contracts its last axis, so left alone it
  # folds the transpose into the dot, copies dy transposed and runs its slower generic
  # kernel. Transposing the narrower operand ourselves, behind optimization barriers so
  # XLA cannot fold it back, made configs/peer.py's inner step faster on one core, side by
  # side with plain autodiff (XLA:CPU of jax 0.10.2). CPU only: GPUs' matmuls take
  # transposed operands.
  barrier = jax.lax.optimization_barrier
  if x_TxI.shape[1] <= dy_TxO.shape[1]:
    return jnp.dot(barrier(x_TxI.T), dy_TxO)
  return barrier(jnp.dot(barrier(dy_TxO.T), x_TxI)).T


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


class AttentionError(errors.ConfigError):
  """config.model.attention asks for a kernel this backend or these shapes do not have."""


def fused_attention(implementation: str, q_BxLxNxH: jax.Array,
                    platform: str | None = None) -> bool:
  """Whether causal attention over the whole sequence runs cuDNN's fused kernel
  (`jax.nn.dot_product_attention(implementation="cudnn")`, which never holds the
  [B, N, L, L] scores in memory) rather than `attend`: 'xla' never, 'cudnn' always (an
  AttentionError where it cannot), 'auto' where it can: a GPU, bf16 or fp16, head size a
  multiple of 8 up to 128. `platform`: the backend's (default: jax's default backend)."""
  if implementation == "xla":
    return False
  platform = platform or jax.default_backend()
  h = q_BxLxNxH.shape[-1]
  if platform != "gpu":
    why = f"it runs on GPUs only (this backend: {platform})"
  elif q_BxLxNxH.dtype not in (jnp.bfloat16, jnp.float16):
    why = f"it needs bf16 or fp16 compute (config.model.dtype), not {q_BxLxNxH.dtype}"
  elif h % 8 or h > 128:
    why = f"it needs a head size that is a multiple of 8 up to 128, not {h}"
  else:
    return True
  if implementation == "cudnn":
    raise AttentionError(f"config.model.attention = 'cudnn': {why}; use 'auto' (cuDNN "
                         f"where it can run) or 'xla'")
  return False


def causal_attention(module: nn.Module, q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array,
                     v_BxLxKxH: jax.Array, positions_L: jax.Array, *, decode: bool,
                     cache_len: int, implementation: str = "auto") -> jax.Array:
  """Causal attention (`attend`, or cuDNN's fused kernel: `fused_attention`). With
  `decode`, k and v are written into `module`'s "cache" collection at `positions_L`
  (contiguous) and the queries attend to every cached position up to their own: one call
  prefills a prompt, the next ones add a token each (always `attend`: the cache's mask is
  no causal triangle)."""
  l = q_BxLxNxH.shape[1]
  if not decode:
    if fused_attention(implementation, q_BxLxNxH):
      return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True,
                                          implementation="cudnn")
    return attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, jnp.tri(l, dtype=bool))
  b, _, kv_heads, h = k_BxLxKxH.shape
  ready = module.has_variable("cache", "key")
  key = module.variable("cache", "key", jnp.zeros, (b, cache_len, kv_heads, h),
                        k_BxLxKxH.dtype)
  value = module.variable("cache", "value", jnp.zeros, (b, cache_len, kv_heads, h),
                          v_BxLxKxH.dtype)
  if not ready:  # creating the cache: only its shapes matter
    return attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, jnp.tri(l, dtype=bool))
  start = (0, positions_L[0], 0, 0)
  key.value = jax.lax.dynamic_update_slice(key.value, k_BxLxKxH, start)
  value.value = jax.lax.dynamic_update_slice(value.value, v_BxLxKxH, start)
  visible_LxS = jnp.arange(cache_len)[None, :] <= positions_L[:, None]
  return attend(q_BxLxNxH, key.value, value.value, visible_LxS)


def attend(q_BxLxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
           visible_LxS: jax.Array) -> jax.Array:
  """softmax(q · kᵀ / √H, where visible) · v, query head i reading key/value head
  i // (N / K). Scores and softmax in float32 whatever the compute dtype.

  Computed heads-first ([B, K, G, L, H], G = N / K query heads per key/value head), so
  both products batch over leading axes and contract trailing ones, the layout XLA:CPU's
  fast matmul kernels take without copies; `jax.nn.dot_product_attention`'s XLA
  formulation keeps heads after the tokens and was slower for configs/peer.py's inner step
  on one core, side by side (XLA:CPU of jax 0.10.2). It is no fused kernel on any platform
  either.
  """
  b, l, n, h = q_BxLxNxH.shape
  kv = k_BxSxKxH.shape[2]
  q_BxKxGxLxH = (q_BxLxNxH * h ** -0.5).reshape(b, l, kv, n // kv, h).transpose(0, 2, 3, 1, 4)
  k_BxKxSxH = k_BxSxKxH.transpose(0, 2, 1, 3)
  v_BxKxSxH = v_BxSxKxH.transpose(0, 2, 1, 3)
  scores = jnp.einsum("bkglh,bksh->bkgls", q_BxKxGxLxH, k_BxKxSxH,
                      preferred_element_type=jnp.float32)
  scores = jnp.where(visible_LxS, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxH.dtype)
  out_BxKxGxLxH = jnp.einsum("bkgls,bksh->bkglh", probs, v_BxKxSxH)
  return out_BxKxGxLxH.transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)


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
