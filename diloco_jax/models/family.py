"""The model families (`gpt`, `llama`) by name, or your own Flax module, and the resolved
shape every other part builds from (`ModelConfig`).

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
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from diloco_jax import compile_cache
from diloco_jax import errors
from diloco_jax.models import gpt
from diloco_jax.models import llama

Params = Any
FAMILIES = {"gpt": gpt.GPT, "llama": llama.Llama}
REMAT = ("none", "block")


class ModuleError(errors.ConfigError):
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
  use_bias: bool = True  # gpt: biases in Dense layers and LayerNorms
  head_bias: bool = False  # gpt: a bias in the head too (GPT-2 has none)
  max_positions: int = 0  # gpt: rows of the position table; 0 = seq_len
  remat: str = "none"
  module: str = ""  # "package.module:factory", instead of the family
  attention: str = "auto"  # "xla", "cudnn" or "auto" (layers.causal_attention)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def positions(self) -> int:
    """The longest sequence the model takes: gpt's position table rows (llama's rotary
    positions have no table: the longest its source was trained on, else seq_len)."""
    return max(self.max_positions, self.seq_len)

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    return cls(vocab_size=model.get("vocab_size") or vocab_size, seq_len=model.seq_len,
               num_layers=model.num_layers,
               d_model=model.d_model, num_heads=model.num_heads, mlp_dim=model.mlp_dim,
               dtype=jnp.dtype(model.dtype), family=model.family,
               num_kv_heads=model.num_kv_heads, rope_base=float(model.rope_base),
               norm_eps=float(model.norm_eps), tie_embeddings=model.tie_embeddings,
               use_bias=model.use_bias, head_bias=model.get("head_bias", False),
               max_positions=model.get("max_positions", 0), remat=model.remat,
               module=model.module,
               attention=model.get("attention", "auto"))


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


def default_device() -> jax.Device:
  """Where a program whose arguments are not placed runs: `jax.default_device`'s, else
  the first local device."""
  device = jax.config.jax_default_device
  if isinstance(device, str):
    return jax.local_devices(backend=device)[0]
  return device or jax.local_devices()[0]


@functools.lru_cache(maxsize=8)
def init_program(cfg: ModelConfig, device: jax.Device) -> jax.stages.Traced | jax.stages.Compiled:
  """The module's init (variables from a PRNG key and a batch of tokens) on `device`:
  compiled, where a start before this one kept it whole (compile_cache.py: no
  trace, no compile), else traced, once per config. The params' shapes (`param_shapes`)
  and the program that draws them (`compiled_init`) both come from it: each trace of a
  Flax init took about 0.05 s of a start, and a start asked for three."""
  found = compile_cache.load("init", _init_spec(cfg, device), devices=[device])
  if found is not None:
    return found.program
  tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
  return jax.jit(build(cfg).init).trace(jax.random.key(0), tokens)


def compiled_init(cfg: ModelConfig, device: jax.Device) -> jax.stages.Compiled:
  """`init_program` compiled for `device` (and kept whole, where the cache is on)."""
  program = init_program(cfg, device)
  if isinstance(program, jax.stages.Compiled):
    return program
  with jax.default_device(device):
    program = program.lower().compile()
  compile_cache.store("init", _init_spec(cfg, device), program)
  return program


def _init_spec(cfg: ModelConfig, device: jax.Device) -> dict[str, str]:
  # The model's shape is all its init is built from (its code: the entry's sources).
  return {"model": repr(cfg), "device": f"{device.platform}:{device.id}"}


def param_shapes(cfg: ModelConfig) -> Params:
  """The params' shapes and dtypes (jax.ShapeDtypeStruct), without computing anything."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                      init_program(cfg, default_device()).out_info["params"])
