"""The config schema: every field, with its default and meaning.

`get_default_config()` builds every field, one function per section (`_SECTIONS`), the one
place where each is declared; the trailing comment on each of their lines is that field's
documentation (`field_docs`, printed by `--print_config`); the files in `configs/` start
from it and change a few fields.
`checks.validate` rejects every bad value (see there).
"""

from __future__ import annotations

import difflib
import inspect
import io
import textwrap
import tokenize
from typing import Any

import ml_collections

from diloco_jax.errors import ConfigError

__all__ = ["ConfigError", "BALANCES", "DATA_SOURCES", "SHARDINGS", "TOKEN_DTYPES",
           "COMPUTE_DTYPES", "INNER_OPTIMIZERS", "MODEL_FAMILIES", "REMAT", "ATTENTIONS",
           "WANDB_MODES", "RESUMABLE_CHANGES", "get_default_config", "flatten", "from_saved",
           "known_names", "unknown_field", "field_docs", "format_config"]

BALANCES = ("fixed", "speed")
DATA_SOURCES = ("synthetic", "text", "tokens", "prepared")
SHARDINGS = ("iid", "non_iid")
TOKEN_DTYPES = ("uint16", "int32")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
INNER_OPTIMIZERS = ("adamw", "muon")
MODEL_FAMILIES = ("gpt", "llama")
REMAT = ("none", "block")
ATTENTIONS = ("auto", "xla", "cudnn")
WANDB_MODES = ("offline", "online")


def get_default_config() -> ml_collections.ConfigDict:
  """Every config field with its default. Config files start from this."""
  c = ml_collections.ConfigDict()
  for section in _SECTIONS:
    section(c)
  return c


def _run(c: ml_collections.ConfigDict) -> None:
  """The run: what it trains for, how often it evaluates and checks itself."""
  c.seed = 0  # Seeds parameter init; data seeds live in `data`.
  c.mode = "sync"  # 'sync', 'delayed', 'eager', 'streaming' DiLoCo, or 'ddp'.
  c.num_rounds = 20  # Rounds T: each is H inner steps plus one outer step (0: checkpoint 0).
  c.inner_steps = 50  # H: inner steps per round (in 'ddp', steps between log lines).
  c.replicas_per_host = 4  # DiLoCo replicas on this host; K = hosts * replicas_per_host.
  c.batch_size = 16  # Sequences per replica per inner step.
  c.grad_accum_steps = 1  # Micro-batches per inner step (batch_size must divide evenly).
  c.eval_every = 1  # Evaluate the anchor every this many rounds (and after the last).
  c.eval_batches = 8  # Held-out batches (of `batch_size` sequences) per evaluation.
  c.debug_checks = False  # Extra invariant checks after every round (slower).
  c.anchor_check_every = 10  # Rounds between cross-host compares of the outer state's hash; 0: off.


def _model(c: ml_collections.ConfigDict) -> None:
  """config.model: the network."""
  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 2  # Transformer blocks.
  c.model.d_model = 128  # Residual stream width.
  c.model.num_heads = 4  # Attention heads; must divide d_model.
  c.model.mlp_dim = 512  # Hidden width of each block's MLP.
  c.model.seq_len = 64  # Tokens per training sequence (the context length).
  c.model.dtype = "float32"  # Compute: 'float32', 'bfloat16' or 'float16'; params stay float32.
  c.model.family = "gpt"  # 'gpt' (GPT-2 style) or 'llama'.
  c.model.module = ""  # Your own model instead: 'package.module:factory' (see models/family.py).
  c.model.num_kv_heads = 0  # 'llama': key/value heads (GQA), dividing num_heads; 0: num_heads.
  c.model.rope_base = 10000.0  # 'llama': base (theta) of the rotary position embedding.
  c.model.norm_eps = 1e-5  # Epsilon of the norms (llama: RMSNorm; gpt: LayerNorm).
  c.model.tie_embeddings = False  # The head is the token embedding table, transposed.
  c.model.use_bias = True  # 'gpt': biases in Dense layers and LayerNorms (llama: none).
  c.model.head_bias = False  # 'gpt': a bias in the head too (GPT-2 has none; see docs: models).
  c.model.vocab_size = 0  # Rows of the embedding table; 0: the data's vocabulary.
  c.model.max_positions = 0  # 'gpt': rows of the position table (>= seq_len); 0: seq_len.
  c.model.init_from = ""  # A Hugging Face model directory to start from (docs: models).
  c.model.remat = "none"  # 'none', or 'block': recompute blocks in the backward pass.
  c.model.attention = "auto"  # 'xla'; 'cudnn' (fused, GPU); 'auto': cudnn where it can run.


def _data(c: ml_collections.ConfigDict) -> None:
  """config.data: what it trains on."""
  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"  # 'synthetic', 'text', 'tokens' or 'prepared' (docs: data).
  c.data.path = ""  # 'text': file or dir; 'tokens': flat token file; 'prepared': its directory.
  c.data.token_dtype = "uint16"  # 'tokens' only: dtype of the flat token file.
  c.data.vocab_size = 32  # Symbols: synthetic; 256 for 'text'; the tokenizer's (= the manifest's).
  c.data.sharding = "iid"  # How replicas split the data: 'iid' or 'non_iid' (synthetic only).
  c.data.eval_fraction = 0.05  # 'text', 'tokens': fraction of sequences held out for eval.
  c.data.seed = 0  # Seeds the synthetic chain, the split and the shuffles.
  c.data.markov_order = 2  # Synthetic: the chain's order (context length in tokens).
  c.data.branching = 4  # Synthetic: successors each context can emit (the sparsity).
  c.data.num_sequences = 32768  # Synthetic: training sequences generated (repeated after).
  c.data.num_eval_sequences = 1024  # Synthetic: held-out sequences generated.


def _inner(c: ml_collections.ConfigDict) -> None:
  """config.inner: each replica's own optimizer."""
  c.inner = ml_collections.ConfigDict()
  c.inner.lr = 3e-3  # Peak AdamW learning rate.
  c.inner.warmup_steps = 50  # Linear warmup from 0 over this many inner steps.
  c.inner.final_lr_fraction = 0.1  # Cosine decay ends at lr * this, at the last inner step.
  c.inner.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only).
  c.inner.b1 = 0.9  # AdamW first-moment decay.
  c.inner.b2 = 0.95  # AdamW second-moment decay.
  c.inner.eps = 1e-8  # AdamW epsilon.
  c.inner.clip_norm = 1.0  # Global-norm gradient clipping; 0 turns it off.
  c.inner.optimizer = "adamw"  # 'adamw', or 'muon': Muon on the blocks' matrices, AdamW elsewhere.
  c.inner.muon_lr = 0.02  # 'muon': peak learning rate of the Muon matrices (lr's warmup and decay).
  c.inner.muon_momentum = 0.95  # 'muon': Nesterov momentum of the Muon matrices.
  c.inner.muon_ns_steps = 5  # 'muon': Newton-Schulz iterations per update.


def _outer(c: ml_collections.ConfigDict) -> None:
  """config.outer: the outer step, streaming, and what crosses the wire."""
  c.outer = ml_collections.ConfigDict()
  c.outer.lr = 0.7  # Outer SGD learning rate (DiLoCo paper: 0.7).
  c.outer.momentum = 0.9  # Outer momentum (DiLoCo paper: 0.9); 0 is plain SGD.
  c.outer.nesterov = True  # Nesterov momentum (as in the paper).
  c.outer.max_skipped_rounds = 3  # Rounds in a row with a NaN/Inf Δ before the job stops.
  # Streaming DiLoCo (mode 'streaming'; docs/algorithms.md §5):
  c.outer.fragments = 1  # P: fragments of the params, each synced every H steps, staggered.
  c.outer.fragment_layout = "strided"  # Block l in fragment l mod P, or 'sequential'.
  c.outer.overlap_steps = 0  # τ: inner steps between sending a fragment's Δ and applying it.
  c.outer.merge_alpha = 0.0  # α: replicas keep α of their own fragment, take 1 − α of θᵍ.
  # On the wire (every DiLoCo mode but 'eager' for robust aggregation):
  c.outer.compression = "none"  # Δ across hosts: 'none', 'bf16', 'int8', '4bit', '2bit' or 'topk'.
  c.outer.topk_fraction = 0.01  # 'topk', 'chunk_topk': fraction of Δ's entries sent (largest).
  c.outer.topk_chunk = 4096  # 'chunk_topk': entries per chunk (<= 65536), each keeps its top k.
  c.outer.topk_value_bits = 2  # 'chunk_topk': bits per kept value: 2, 4 (sign + magnitude) or 32.
  c.outer.error_feedback = True  # Lossy formats: carry what was not sent into the next sync.
  c.outer.error_feedback_decay = 1.0  # β: the carried residual is scaled by β (SparseLoCo: 0.95).
  c.outer.aggregation = "mean"  # Over the K replicas: 'mean', 'trimmed_mean' or 'median'.
  c.outer.trim = 0.2  # 'trimmed_mean': fraction of the K values dropped at each end.


def _mesh(c: ml_collections.ConfigDict) -> None:
  """config.mesh: how replicas and their state lie on this host's devices."""
  # How the inner step uses this host's devices (docs/layout.md): mesh.replicas x mesh.fsdp
  # must divide the local devices; the rest are data-parallel within a replica.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.replicas = 1  # Device groups training replicas side by side (1: one after another).
  c.mesh.fsdp = 1  # Devices a replica's params and AdamW state are sharded over (1: copies).


def _checkpoint(c: ml_collections.ConfigDict) -> None:
  """config.checkpoint: when and how many."""
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 1  # Rounds between checkpoints; 0: only at preemption and the end.
  c.checkpoint.keep = 3  # Newest checkpoints kept in workdir/checkpoints.
  c.checkpoint.timeout = 900  # Seconds a save may take (every host's part) before the run stops.


def _reporting(c: ml_collections.ConfigDict) -> None:
  """config.log and config.profile: W&B and traces."""
  c.log = ml_collections.ConfigDict()
  c.log.wandb_project = ""  # W&B project to log each round to (extra [wandb]); "": off.
  c.log.wandb_mode = "offline"  # offline (files in workdir/wandb, for `wandb sync`) or online.

  c.profile = ml_collections.ConfigDict()
  c.profile.start_round = 0  # First round traced by jax.profiler into workdir/profile; 0: none.
  c.profile.num_rounds = 2  # Rounds the trace covers.


def _hosts(c: ml_collections.ConfigDict) -> None:
  """Several hosts: unequal speeds, silent peers."""
  # Hosts of unequal speed (docs: multi-host; the update rule: docs/algorithms.md §9):
  c.balance = "fixed"  # 'fixed': every host H steps a round; 'speed': steps by host speed.
  c.balance_every = 4  # 'speed': rounds between decisions, each from that window's timings.
  c.balance_tolerance = 0.1  # 'speed': hosts within it of the slowest train H; steps move by more.
  c.balance_max_factor = 4  # 'speed': no host trains more than this many times H per round.
  c.wire_timeout = 60  # Several hosts: seconds an op waits on a silent peer still in the epoch.


# In the order the fields are declared: `field_docs` reads them in it, and
# `--print_config` and the reference page list them so.
_SECTIONS = (_run, _model, _data, _inner, _outer, _mesh, _checkpoint, _reporting, _hosts)


# Fields a resumed run may change; every other field must equal the checkpoint's, since it
# changes the math (a resumed run is bit-identical to one never interrupted).
# The device layout (`mesh.*`) may change too: the state is saved whole, so it resumes with
# the same numbers, though later steps then add up in another order (float32 rounding).
RESUMABLE_CHANGES = ("config.eval_every", "config.eval_batches", "config.debug_checks",
                     "config.anchor_check_every", "config.model.attention",
                     "config.model.init_from",
                     "config.checkpoint.every", "config.checkpoint.keep",
                     "config.checkpoint.timeout",
                     "config.outer.max_skipped_rounds",
                     "config.wire_timeout", "config.mesh.replicas", "config.mesh.fsdp",
                     "config.log.wandb_project", "config.log.wandb_mode",
                     "config.profile.start_round", "config.profile.num_rounds")




def flatten(c: ml_collections.ConfigDict, prefix: str = "config") -> dict[str, Any]:
  """{"config.a.b": value} for every leaf field."""
  out = {}
  for key, value in c.items():
    name = f"{prefix}.{key}"
    out.update(flatten(value, name) if isinstance(value, ml_collections.ConfigDict)
               else {name: value})
  return out


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a checkpoint recorded, with the fields added to the schema since it was
  written at their defaults: the behaviour of the version that wrote it (a run started
  before `model.family` existed trained the gpt family, and its head had a bias where
  `use_bias` was set)."""
  def merge(into: ml_collections.ConfigDict, values: dict) -> None:
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(into.get(key), ml_collections.ConfigDict):
        merge(into[key], value)
      else:
        into[key] = value
  config = get_default_config()
  saved = dict(saved)
  saved.pop("elastic", None)  # before 0.2: live membership was a switch of the config
  if "wire_timeout" in saved:  # before 0.2: the wire's timeout had the switch's name
    saved.setdefault("wire_timeout", saved.pop("wire_timeout"))
  merge(config, saved)
  model = saved.get("model", {})
  if "head_bias" not in model and model.get("family", "gpt") == "gpt":
    # before head_bias: the gpt head had a bias with use_bias, LayerNorms flax's epsilon
    config.model.head_bias = model.get("use_bias", True)
    config.model.norm_eps = 1e-6
  return config


def known_names() -> set[str]:
  """Every field of get_default_config() and every group of fields ("config.outer")."""
  fields = flatten(get_default_config())
  return {*fields, *(n.rsplit(".", k)[0] for n in fields for k in range(1, n.count(".")))}


def unknown_field(name: str) -> str:
  """'config.x.y: unknown field; did you mean config.x.z?'."""
  close = difflib.get_close_matches(name, sorted(known_names()), n=1)
  return f"{name}: unknown field" + (f"; did you mean {close[0]}?" if close else "")


def field_docs() -> dict[str, tuple[str, tuple[str, ...]]]:
  """{"config.a.b": (doc, notes)} for every field set in `get_default_config()`: doc is
  the comment at the end of the line that sets it, notes the comment lines just above it
  (a section's heading). Read from the source, so the comments stay the only copy."""
  source = "\n".join(textwrap.dedent(inspect.getsource(f)) for f in _SECTIONS)
  docs: dict[str, tuple[str, tuple[str, ...]]] = {}
  code: list[tokenize.TokenInfo] = []
  trailing, notes = "", []
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip("#").strip()
      if code:
        trailing = text
      else:
        notes.append(text)
    elif tok.type == tokenize.NEWLINE:  # the end of a statement
      name = _assigned_field(code)
      if name:
        docs[name] = (trailing, tuple(notes))
        notes = []
      code, trailing = [], ""
    elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
      code.append(tok)
  leaves = flatten(get_default_config())
  return {name: doc for name, doc in docs.items() if name in leaves}  # not `c.model = ...`


def _assigned_field(code: list[tokenize.TokenInfo]) -> str | None:
  """"config.a.b" if the statement is `c.a.b = ...`, else None."""
  words = [t.string for t in code]
  if "=" not in words or words[0] != "c":
    return None
  target = words[:words.index("=")]
  if len(target) < 3 or target[1::2] != ["."] * (len(target) // 2):
    return None
  return "config" + "".join(target[1:])


def format_config(config: ml_collections.ConfigDict) -> str:
  """Every field of `config`, one per line, `config.a.b = value  # its doc`, with the
  default after the doc where the value differs from it."""
  docs, defaults = field_docs(), flatten(get_default_config())
  values = flatten(config)
  width = min(max(len(f"{n} = {v!r}") for n, v in values.items()), 56)
  lines = []
  # In the order of get_default_config() (flatten's is alphabetical), so notes head their
  # sections; fields it does not declare (which `validate` rejects) come last.
  for name in [*(n for n in docs if n in values), *(n for n in values if n not in docs)]:
    value = values[name]
    doc, notes = docs.get(name, ("not a field of get_default_config()", ()))
    lines.extend(f"# {note}" for note in notes)
    if name in defaults and value != defaults[name]:
      doc += f" (default: {defaults[name]!r})"
    lines.append(f"{name} = {value!r}".ljust(width) + f"  # {doc}")
  return "\n".join(lines)

