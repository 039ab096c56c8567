"""What the trainer asks of a model: initial params, the loss, sizes, FLOPs, memory, and a
model exported earlier (`load_exported`). Which model: `family.py`."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.models import family
from diloco_jax.models import layers
from diloco_jax.models.family import ModelConfig
from diloco_jax.models.family import build
from diloco_jax.models.family import param_shapes

Params = Any


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
  """Initial params, always through the same jit, so every caller gets the same bits."""
  tokens = np.zeros((1, cfg.seq_len), np.int32)
  if isinstance(rng, jax.core.Tracer):  # inside a trace (eval_shape, jit): a compiled
    return jax.jit(build(cfg).init)(rng, tokens)["params"]  # program cannot take tracers
  # The trace `param_shapes` made (or the program a start before kept): the same program.
  return family.compiled_init(cfg, family.default_device())(rng, tokens)["params"]


def load_exported(path: str) -> tuple[nn.Module, Params]:
  """(module, params) of a model written by `python -m diloco_jax.export`: the
  .safetensors file at `path` and the config.json beside it (models/exported.py says
  what they hold); params are float32 numpy arrays in the module's tree."""
  from diloco_jax.models import exported  # pylint: disable=import-outside-toplevel
  # Imported here: safetensors is not needed to train from scratch.
  return exported.load(path)


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
  return table + (cfg.positions * cfg.d_model if cfg.family == "gpt" else 0)


def flops_per_token(cfg: ModelConfig, num_params: int) -> float:
  """Training FLOPs per token: 6N over the matmul params plus causal attention (PaLM app. B:
  6 · layers · L · D). For your own module every param is counted as a matmul param."""
  return 6 * (num_params - lookup_params(cfg)) + 6 * cfg.num_layers * cfg.seq_len * cfg.d_model


def attention_kernel(cfg: ModelConfig, platform: str) -> str:
  """What causal attention over whole sequences runs on `platform` under
  `cfg.attention`: 'cudnn' (the fused kernel) or 'xla' ('own' for a model of your own
  module). Decoding with a KV cache always runs 'xla'. Raises `layers.AttentionError`
  where 'cudnn' was asked for and cannot run."""
  if cfg.module:
    return "own"
  q = jax.ShapeDtypeStruct((1, 1, cfg.num_heads, cfg.d_model // cfg.num_heads), cfg.dtype)
  return "cudnn" if layers.fused_attention(cfg.attention, q, platform) else "xla"


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
