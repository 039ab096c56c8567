"""The config schema (every field, with its default and meaning) and its validation.

`get_default_config()` is the one place where every field is declared; the files in
`configs/` start from it and change a few fields. `validate(config, ...)` runs before
anything is compiled and rejects every bad value with a `ConfigError` that names the field
and the values it accepts.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import ml_collections

MODES = ("sync", "ddp")
DATA_SOURCES = ("synthetic", "text", "tokens")
SHARDINGS = ("iid", "non_iid")
TOKEN_DTYPES = ("uint16", "int32")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def get_default_config() -> ml_collections.ConfigDict:
  """Every config field with its default. Config files start from this."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds parameter init; data seeds live in `data`.
  c.mode = "sync"  # One of MODES: 'sync' DiLoCo, or 'ddp' (gradients averaged every step).
  c.num_rounds = 20  # Rounds T: each is H inner steps plus one outer step.
  c.inner_steps = 50  # H: inner steps per round (in 'ddp', steps between log lines).
  c.replicas_per_host = 4  # DiLoCo replicas on this host; K = hosts * replicas_per_host.
  c.batch_size = 16  # Sequences per replica per inner step.
  c.grad_accum_steps = 1  # Micro-batches per inner step (batch_size must divide evenly).
  c.eval_every = 1  # Evaluate the anchor every this many rounds (and after the last).
  c.eval_batches = 8  # Held-out batches (of `batch_size` sequences) per evaluation.
  c.debug_checks = False  # Extra invariant checks after every round (slower).

  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 2  # Transformer blocks.
  c.model.d_model = 128  # Residual stream width.
  c.model.num_heads = 4  # Attention heads; must divide d_model.
  c.model.mlp_dim = 512  # Hidden width of each block's MLP.
  c.model.seq_len = 64  # Tokens per training sequence (the context length).
  c.model.dtype = "float32"  # Compute dtype (COMPUTE_DTYPES); params are always float32.

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"  # One of DATA_SOURCES.
  c.data.path = ""  # 'text': a file or a directory of files; 'tokens': a flat token file.
  c.data.token_dtype = "uint16"  # 'tokens' only: dtype of the flat token file.
  c.data.vocab_size = 32  # Symbols: synthetic alphabet, 256 for 'text', tokenizer size for 'tokens'.
  c.data.sharding = "iid"  # How replicas split the data: 'iid' or 'non_iid' (synthetic only).
  c.data.eval_fraction = 0.05  # Files: fraction of sequences held out for evaluation.
  c.data.seed = 0  # Seeds the synthetic chain, the split and the shuffles.
  c.data.markov_order = 2  # Synthetic: the chain's order (context length in tokens).
  c.data.branching = 4  # Synthetic: successors each context can emit (the sparsity).
  c.data.num_sequences = 32768  # Synthetic: training sequences generated (repeated after).
  c.data.num_eval_sequences = 1024  # Synthetic: held-out sequences generated.

  c.inner = ml_collections.ConfigDict()
  c.inner.lr = 3e-3  # Peak AdamW learning rate.
  c.inner.warmup_steps = 50  # Linear warmup from 0 over this many inner steps.
  c.inner.final_lr_fraction = 0.1  # Cosine decay ends at lr * this, at the last inner step.
  c.inner.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only).
  c.inner.b1 = 0.9  # AdamW first-moment decay.
  c.inner.b2 = 0.95  # AdamW second-moment decay.
  c.inner.eps = 1e-8  # AdamW epsilon.
  c.inner.clip_norm = 1.0  # Global-norm gradient clipping; 0 turns it off.

  c.outer = ml_collections.ConfigDict()
  c.outer.lr = 0.7  # Outer SGD learning rate (DiLoCo paper: 0.7).
  c.outer.momentum = 0.9  # Outer momentum (DiLoCo paper: 0.9); 0 is plain SGD.
  c.outer.nesterov = True  # Nesterov momentum (as in the paper).
  return c
