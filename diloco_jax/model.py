"""A GPT-style decoder-only transformer in Flax (pre-norm, causal attention).

Parameters are float32; `dtype` is the compute dtype (bfloat16 on accelerators). Logits
come back in float32 so the loss is computed at full precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

Params = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int
  seq_len: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, vocab_size: int) -> GPTConfig:
    return cls(vocab_size=vocab_size, seq_len=model.seq_len, num_layers=model.num_layers,
               d_model=model.d_model, num_heads=model.num_heads, mlp_dim=model.mlp_dim,
               dtype=jnp.dtype(model.dtype))


def _dense(features: int, cfg: GPTConfig, std: float = 0.02, name: str | None = None):
  return nn.Dense(features, dtype=cfg.dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(std), name=name)


class Block(nn.Module):
  """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, l, d = x_BxLxD.shape
    head_dim = d // cfg.num_heads
    # Residual projections are scaled down with depth (GPT-2) so the stream's variance
    # does not grow with the number of blocks.
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5

    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_attn")(x_BxLxD)
    qkv = _dense(3 * d, cfg, name="qkv")(h).reshape(b, l, 3, cfg.num_heads, head_dim)
    q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    attn = jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, is_causal=True)
    x_BxLxD = x_BxLxD + _dense(d, cfg, out_std, name="attn_out")(attn.reshape(b, l, d))

    h = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_mlp")(x_BxLxD)
    h = nn.gelu(_dense(cfg.mlp_dim, cfg, name="mlp_in")(h))
    return x_BxLxD + _dense(d, cfg, out_std, name="mlp_out")(h)


class GPT(nn.Module):
  """Token + learned position embeddings, `num_layers` blocks, final norm, untied head."""
  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
    x_BxLxD = (embed(tokens_BxL) + pos[: tokens_BxL.shape[1]]).astype(cfg.dtype)
    for i in range(cfg.num_layers):
      x_BxLxD = Block(cfg, name=f"block_{i}")(x_BxLxD)
    x_BxLxD = nn.LayerNorm(dtype=cfg.dtype, param_dtype=jnp.float32, name="ln_final")(x_BxLxD)
    logits_BxLxV = _dense(cfg.vocab_size, cfg, name="head")(x_BxLxD)
    return logits_BxLxV.astype(jnp.float32)


def init_params(cfg: GPTConfig, rng: jax.Array) -> Params:
  """Initial params, always through the same jit, so every caller gets the same bits."""
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  return jax.jit(GPT(cfg).init)(rng, tokens)["params"]


def make_loss_fn(cfg: GPTConfig):
  """Returns loss_fn(params, batch_BxL1) -> mean next-token cross-entropy (nats)."""
  model = GPT(cfg)

  def loss_fn(params: Params, batch_BxL1: jax.Array) -> jax.Array:
    inputs, targets = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    logits = model.apply({"params": params}, inputs)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

  return loss_fn


def count_params(params: Params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def flops_per_token(cfg: GPTConfig, num_params: int) -> float:
  """Training FLOPs per token: 6N over the matmul params plus causal attention (PaLM app. B).

  The embedding tables are lookups, not matmuls, so they are left out of N.
  """
  matmul_params = num_params - (cfg.vocab_size + cfg.seq_len) * cfg.d_model
  return 6 * matmul_params + 6 * cfg.num_layers * cfg.seq_len * cfg.d_model


def num_params_of(cfg: GPTConfig) -> int:
  """The number of params of GPT(cfg), from the shapes alone: `count_params` of
  `init_params(cfg, ...)` without building anything (for checks before allocation)."""
  d, m, v = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
  block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
  return v * d + cfg.seq_len * d + cfg.num_layers * block + 2 * d + (d * v + v)


def memory_estimate(cfg: GPTConfig, *, param_sets: int, grad_copies: int, host_copies: int,
                    micro_batch: int) -> tuple[dict[str, int], dict[str, int]]:
  """Bytes of a training run's pieces: ({part: bytes} on every local device, {part: bytes}
  in host memory), in this trainer's layout (params and optimizer state replicated on
  every local device, the batch split over them, the outer state on the host).

  With N = num_params_of(cfg), s the compute dtype's bytes, b = `micro_batch` sequences
  per device, and L, D, M, V, H, layers from `cfg`:

    per device  state        param_sets x 12N  float32 params + AdamW's two moments
                step         (grad_copies + 2) x 4N  the gradients alive at once, the
                             optimizer's update, and the params placed for evaluation
                activations  b x L x layers x (8D + 2M + H x L) x s  what the backward pass
                             keeps of one micro-batch's blocks: the residual, norm outputs,
                             q, k, v, attention output, MLP input and GELU output, and
                             every token's H x L attention weights
                logits       b x L x V x (s + 4)  the head's output and its float32 copy
    host        outer        host_copies x 4N  anchor, outer momentum, the pseudo-gradients
                             and the copies they are computed from

  The state figures are exact; activations and logits are an estimate of what cannot be
  avoided (XLA may fuse some intermediates away, keep others longer), meant to tell a
  config that cannot fit from one that might. Evaluation runs `batch_size` sequences per
  device at once, not micro-batches: its logits are not counted here.
  """
  n = 4 * num_params_of(cfg)  # float32 bytes of one copy of the params
  s = jnp.dtype(cfg.dtype).itemsize
  tokens = micro_batch * cfg.seq_len
  device = {"state": param_sets * 3 * n, "step": (grad_copies + 2) * n,
            "activations": tokens * cfg.num_layers * s * (
                8 * cfg.d_model + 2 * cfg.mlp_dim + cfg.num_heads * cfg.seq_len),
            "logits": tokens * cfg.vocab_size * (s + 4)}
  return device, {"outer": host_copies * n}
