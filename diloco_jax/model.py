"""The model: a family (`gpt`, `llama`) or your own Flax module, and what the trainer asks
of it (initial params, the loss, sizes, FLOPs, memory).

Parameters are float32; `dtype` is the compute dtype (bfloat16 on accelerators). Logits
come back in float32 so the loss is computed at full precision.

Your own module: `config.model.module = "package.module:factory"`, where
`factory(cfg: ModelConfig) -> flax.linen.Module` builds a module whose `__call__(tokens_BxL)`
returns float32 logits [B, L, V]. Every other part of the trainer (simulate, checkpoints,
all modes) sees only its params. Streaming DiLoCo cuts the params into fragments of whole
blocks: name the module's top-level blocks `block_0`, `block_1`, ... (everything else goes
with fragment 0). Sampling uses a KV cache for the built-in families and recomputes the
whole window for your own module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from diloco_jax import config as config_lib
from diloco_jax import gpt, llama

Params = Any
FAMILIES = {"gpt": gpt.GPT, "llama": llama.Llama}
REMAT = ("none", "block")


class ModuleError(config_lib.ConfigError):
  """`config.model.module` cannot be imported or does not build a usable module."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's shape, resolved from `config.model` and the data's vocabulary."""
  vocab_size: int
  seq_len: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32
  family: str = "gpt"
  num_kv_heads: int = 0  # llama: key/value heads; 0 = num_heads (no grouping)
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  use_bias: bool = True  # gpt: biases in Dense layers, LayerNorms and the head
  remat: str = "none"
  module: str = ""  # "package.module:factory", instead of the family

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    return cls(vocab_size=vocab_size, seq_len=model.seq_len, num_layers=model.num_layers,
               d_model=model.d_model, num_heads=model.num_heads, mlp_dim=model.mlp_dim,
               dtype=jnp.dtype(model.dtype), family=model.family,
               num_kv_heads=model.num_kv_heads, rope_base=float(model.rope_base),
               norm_eps=float(model.norm_eps), tie_embeddings=model.tie_embeddings,
               use_bias=model.use_bias, remat=model.remat, module=model.module)


@functools.cache
def import_factory(spec: str) -> Callable[[ModelConfig], nn.Module]:
  """The factory named by "package.module:factory" (a ModuleError naming what is wrong)."""
  path, _, name = spec.partition(":")
  if not path or not name:
    raise ModuleError(f"config.model.module = {spec!r}: must be 'package.module:factory'")
  try:
    mod = importlib.import_module(path)
  except Exception as e:  # noqa: BLE001 -- any failure of the user's import is reported
    raise ModuleError(f"config.model.module = {spec!r}: cannot import {path}: "
                      f"{type(e).__name__}: {e}") from None
  factory = getattr(mod, name, None)
  if not callable(factory):
    raise ModuleError(f"config.model.module = {spec!r}: {path} has no callable {name!r}")
  return factory


def build(cfg: ModelConfig, decode: bool = False) -> nn.Module:
  """The Flax module of `cfg`; `decode`: with a KV cache (built-in families only)."""
  if cfg.module:
    module = import_factory(cfg.module)(cfg)
    if not isinstance(module, nn.Module):
      raise ModuleError(f"config.model.module = {cfg.module!r}: returned "
                        f"{type(module).__name__}, not a flax.linen.Module")
    return module
  return FAMILIES[cfg.family](cfg, decode=decode)


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
  """Initial params, always through the same jit, so every caller gets the same bits."""
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  return jax.jit(build(cfg).init)(rng, tokens)["params"]


def load_exported(path: str) -> tuple[nn.Module, Params]:
  """(module, params) of a model written by `python -m diloco_jax.export`: the
  .safetensors file at `path` and the config.json beside it (export.py says what they
  hold); params are float32 numpy arrays in the module's tree."""
  from diloco_jax import export  # pylint: disable=import-outside-toplevel
  # Imported here: export imports trained, which imports this module.
  return export.load(path)


def param_shapes(cfg: ModelConfig) -> Params:
  """The params' shapes and dtypes (jax.ShapeDtypeStruct), without computing anything."""
  tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
  return jax.eval_shape(build(cfg).init, jax.random.key(0), tokens)["params"]


def make_loss_fn(cfg: ModelConfig):
  """Returns loss_fn(params, batch_BxL1) -> mean next-token cross-entropy (nats)."""
  model = build(cfg)

  def loss_fn(params: Params, batch_BxL1: jax.Array) -> jax.Array:
    inputs, targets = batch_BxL1[:, :-1], batch_BxL1[:, 1:]
    logits = model.apply({"params": params}, inputs)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

  return loss_fn


def count_params(params: Params) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


@functools.cache  # start-up asks it more than once (memory check, estimate); it traces init
def num_params_of(cfg: ModelConfig) -> int:
  """The number of params of build(cfg), from the shapes alone (for checks before
  anything is allocated)."""
  return count_params(param_shapes(cfg))


def lookup_params(cfg: ModelConfig) -> int:
  """Params used as table lookups rather than matmuls: the token embeddings (unless tied
  to the head) and the gpt family's positions. 0 for your own module (unknown)."""
  if cfg.module:
    return 0
  table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
  return table + (cfg.seq_len * cfg.d_model if cfg.family == "gpt" else 0)


def flops_per_token(cfg: ModelConfig, num_params: int) -> float:
  """Training FLOPs per token: 6N over the matmul params plus causal attention (PaLM app. B:
  6 · layers · L · D). For your own module every param is counted as a matmul param."""
  return 6 * (num_params - lookup_params(cfg)) + 6 * cfg.num_layers * cfg.seq_len * cfg.d_model


def _activation_floats(cfg: ModelConfig) -> int:
  """Floats the backward pass keeps per token and block (see memory_estimate)."""
  d, m, kv = cfg.d_model, cfg.mlp_dim, cfg.kv_heads * (cfg.d_model // cfg.num_heads)
  if cfg.family == "llama" and not cfg.module:
    # residual, 2 norm outputs, q, k, v (rotated and not), attention output, gate, up,
    # their product and silu, and the attention weights
    return 5 * d + 4 * kv + 4 * m + cfg.num_heads * cfg.seq_len
  return 8 * d + 2 * m + cfg.num_heads * cfg.seq_len


def memory_estimate(cfg: ModelConfig, *, param_sets: int, grad_copies: int, host_copies: int,
                    micro_batch: int, fsdp: int = 1) -> tuple[dict[str, int], dict[str, int]]:
  """Bytes of a training run's pieces: ({part: bytes} on every local device, {part: bytes}
  in host memory), in this trainer's layout (params and optimizer state replicated on
  every device of a replica's group, or sharded `fsdp` ways, the batch split over the
  group, the outer state on the host).

  With N = num_params_of(cfg), s the compute dtype's bytes, b = `micro_batch` sequences
  per device, and L, D, M, V, H, layers from `cfg`:

    per device  state        param_sets x 12N  float32 params + AdamW's two moments
                step         (grad_copies + 2) x 4N  the gradients alive at once, the
                             optimizer's update, and the params placed for evaluation
                activations  b x L x layers x A x s  what the backward pass keeps of one
                             micro-batch's blocks, A floats per token (gpt: 8D + 2M + H x L:
                             the residual, norm outputs, q, k, v, attention output, MLP
                             input and GELU output, and every token's H x L attention
                             weights; llama: 5D + 4 x kv width + 4M + H x L)
                logits       b x L x V x (s + 4)  the head's output and its float32 copy
    host        outer        host_copies x 4N  anchor, outer momentum, the pseudo-gradients
                             and the copies they are computed from

  With `fsdp` > 1, state and step are divided by `fsdp` (what XLA gathers for one layer
  at a time is left out). The state figures are exact; activations and logits are an
  estimate of what cannot be avoided (XLA may fuse some intermediates away, keep others
  longer; `remat` = block keeps less), meant to tell a config that cannot fit from one
  that might. Evaluation runs
  `batch_size` sequences per device at once, not micro-batches: its logits are not counted.
  """
  n = 4 * num_params_of(cfg)  # float32 bytes of one copy of the params
  s = jnp.dtype(cfg.dtype).itemsize
  tokens = micro_batch * cfg.seq_len
  device = {"state": param_sets * 3 * n // fsdp, "step": (grad_copies + 2) * n // fsdp,
            "activations": tokens * cfg.num_layers * s * _activation_floats(cfg),
            "logits": tokens * cfg.vocab_size * (s + 4)}
  return device, {"outer": host_copies * n}
