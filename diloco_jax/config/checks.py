"""`validate(config, ...)`: runs before anything is compiled and rejects every bad value with
a `ConfigError` that names the field and the values it accepts (`mesh.check_memory` adds
whether the model and replicas fit in memory).

What a mode allows is its driver's to say: the rules that depend on the mode read the
traits of config.mode's driver (`modes.base.Driver`), and the modes an error lists are the
registry's that have the trait. So this layer sits above `modes`.
"""

from __future__ import annotations

import importlib.util
import math
import os

import ml_collections

from diloco_jax.config.schema import ATTENTIONS
from diloco_jax.config.schema import BALANCES
from diloco_jax.config.schema import COMPUTE_DTYPES
from diloco_jax.config.schema import DATA_SOURCES
from diloco_jax.config.schema import INNER_OPTIMIZERS
from diloco_jax.config.schema import MODEL_FAMILIES
from diloco_jax.config.schema import REMAT
from diloco_jax.config.schema import SHARDINGS
from diloco_jax.config.schema import TOKEN_DTYPES
from diloco_jax.config.schema import WANDB_MODES
from diloco_jax.config.schema import flatten
from diloco_jax.config.schema import get_default_config
from diloco_jax.config.schema import unknown_field
from diloco_jax.errors import ConfigError
from diloco_jax.modes.names import MODES


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(config: ml_collections.ConfigDict, *, num_local_devices: int = 1,
             num_hosts: int = 1) -> None:
  """Raises one ConfigError listing every invalid field, before anything compiles."""
  values = _typed_values(config)  # the range checks below assume the right types
  errors: list[str] = []

  def check(name: str, ok: bool, rule: str) -> None:
    if not ok:
      errors.append(f"{name} = {values[name]!r}: {rule}")

  c = config
  check("config.mode", c.mode in MODES, f"must be one of {MODES}")
  mode = _driver(c.mode)
  # In this order, the order of the error lines (a section's checks may read another's).
  _check_counts(c, check)
  _check_layout(c, check, mode, num_local_devices)
  _check_model(c, check, errors)
  _check_data(c, check)
  _check_optimizers(c, check)
  _check_checkpoint(c, check)
  _check_streaming(c, check, mode)
  _check_reporting(c, check)
  _check_wire(c, check, mode, num_replicas=num_hosts * c.replicas_per_host)
  _check_balance(c, check, mode)
  check("config.wire_timeout", c.wire_timeout >= 1, "must be >= 1")
  if errors:
    raise ConfigError("\n".join(errors))


def _typed_values(config: ml_collections.ConfigDict) -> dict:
  """{"config.a.b": value} of every field; a ConfigError, sorted, for every unknown,
  missing or mistyped one."""
  errors: list[str] = []
  values = flatten(config)
  schema = flatten(get_default_config())
  for name in values.keys() - schema.keys():
    errors.append(unknown_field(name))
  for name in schema.keys() - values.keys():
    errors.append(f"{name}: missing (every field of get_default_config() is required)")
  for name, default in schema.items():
    if name not in values:
      continue
    v = values[name]
    ok = (isinstance(v, bool) if isinstance(default, bool) else
          isinstance(v, int) and not isinstance(v, bool) if isinstance(default, int) else
          _is_number(v) if isinstance(default, float) else isinstance(v, type(default)))
    if not ok:
      errors.append(f"{name} = {v!r}: must be a finite {type(default).__name__}")
  if errors:
    raise ConfigError("\n".join(sorted(errors)))
  return values


def _check_counts(c: ml_collections.ConfigDict, check) -> None:
  """The run's and the model's sizes, which the later checks divide by."""
  check("config.num_rounds", c.num_rounds >= 0, "must be >= 0 (0: the initial model only)")
  for key in ("inner_steps", "replicas_per_host", "batch_size",
              "grad_accum_steps", "eval_every", "eval_batches"):
    check(f"config.{key}", c[key] >= 1, "must be >= 1")
  check("config.anchor_check_every", c.anchor_check_every >= 0, "must be >= 0 (0: off)")
  for key in ("num_layers", "d_model", "num_heads", "mlp_dim", "seq_len"):
    check(f"config.model.{key}", c.model[key] >= 1, "must be >= 1")


def _check_layout(c: ml_collections.ConfigDict, check, mode, num_local_devices: int) -> None:
  """config.mesh and the batch: the device groups and the micro-batches fit the devices."""
  mesh = c.mesh
  for key in ("replicas", "fsdp"):
    check(f"config.mesh.{key}", mesh[key] >= 1, "must be >= 1")
  group = num_local_devices  # the devices one replica's batch is split over
  if mesh.replicas >= 1 and mesh.fsdp >= 1:
    check("config.mesh.fsdp", num_local_devices % (mesh.replicas * mesh.fsdp) == 0,
          f"mesh.replicas x mesh.fsdp = {mesh.replicas} x {mesh.fsdp} must divide the "
          f"{num_local_devices} local device(s)")
    check("config.mesh.replicas", c.replicas_per_host % mesh.replicas == 0,
          f"must divide config.replicas_per_host = {c.replicas_per_host} (each device group "
          f"trains the same number of replicas)")
    check("config.mesh.replicas", mesh.replicas == 1 or not (mode and mode.per_step),
          f"must be 1 in mode {c.mode!r} (one set of params; use mesh.fsdp to shard it)")
    group = max(num_local_devices // mesh.replicas, 1)
  if c.batch_size >= 1 and c.grad_accum_steps >= 1:
    split = c.grad_accum_steps * group
    check("config.batch_size", c.batch_size % split == 0,
          f"must be divisible by grad_accum_steps ({c.grad_accum_steps}) x a replica's "
          f"devices ({group}: local devices / mesh.replicas) = {split}, so every device "
          f"gets whole micro-batches")


def _check_model(c: ml_collections.ConfigDict, check, errors: list[str]) -> None:
  """config.model beyond its sizes: its shape, family and tables."""
  m, d = c.model, c.data
  if m.num_heads >= 1:
    check("config.model.d_model", m.d_model % m.num_heads == 0,
          f"must be divisible by config.model.num_heads = {m.num_heads}")
  check("config.model.dtype", m.dtype in COMPUTE_DTYPES, f"must be one of {COMPUTE_DTYPES}")
  _check_model_family(m, check, errors)
  check("config.model.vocab_size", m.vocab_size == 0 or m.vocab_size >= d.vocab_size,
        f"smaller than the data's vocabulary, config.data.vocab_size = {d.vocab_size}: "
        f"its tokens >= {m.vocab_size} have no embedding (0: the data's)")
  check("config.model.max_positions", m.max_positions == 0 or m.max_positions >= m.seq_len,
        f"smaller than config.model.seq_len = {m.seq_len}: the model takes no longer "
        "sequences (0: seq_len)")


def _check_data(c: ml_collections.ConfigDict, check) -> None:
  """config.data: the source, and what that source needs."""
  d = c.data
  check("config.data.source", d.source in DATA_SOURCES, f"must be one of {DATA_SOURCES}")
  check("config.data.sharding", d.sharding in SHARDINGS, f"must be one of {SHARDINGS}")
  check("config.data.sharding", d.sharding == "iid" or d.source == "synthetic",
        "'non_iid' is only available for config.data.source = 'synthetic'")
  check("config.data.vocab_size", d.vocab_size >= 2, "must be >= 2")
  check("config.data.eval_fraction", 0 < d.eval_fraction < 1, "must be in (0, 1)")
  if d.source == "text":
    check("config.data.vocab_size", d.vocab_size == 256, "must be 256 for byte-level text")
    check("config.data.path", bool(d.path) and os.path.exists(d.path),
          "must be an existing file or directory of text")
  elif d.source == "tokens":
    check("config.data.path", bool(d.path) and os.path.isfile(d.path),
          "must be an existing flat token file")
    check("config.data.token_dtype", d.token_dtype in TOKEN_DTYPES,
          f"must be one of {TOKEN_DTYPES}")
    if d.token_dtype == "uint16":
      check("config.data.vocab_size", d.vocab_size <= 65536, "must be <= 65536 for uint16")
  elif d.source == "prepared":
    # Only set: data/prepared.py says what is wrong with the directory (missing, interrupted, ...).
    check("config.data.path", bool(d.path),
          "must be a directory written by python -m diloco_jax.prepare")
  elif d.source == "synthetic":
    _check_synthetic(c, check)


def _check_synthetic(c: ml_collections.ConfigDict, check) -> None:
  """config.data of the synthetic source: a chain small enough, sequences enough."""
  d = c.data
  check("config.data.markov_order", d.markov_order >= 1, "must be >= 1")
  check("config.data.branching", 1 <= d.branching <= d.vocab_size,
        f"must be in [1, config.data.vocab_size = {d.vocab_size}]")
  if d.markov_order >= 1 and d.vocab_size >= 2:
    check("config.data.markov_order", d.vocab_size ** d.markov_order <= 2 ** 20,
          f"vocab_size ** markov_order = {d.vocab_size}**{d.markov_order} contexts; "
          "must be <= 2**20")
  check("config.data.num_sequences", d.num_sequences >= c.replicas_per_host * c.batch_size,
        f"must be >= replicas_per_host x batch_size = {c.replicas_per_host * c.batch_size}")
  check("config.data.num_eval_sequences",
        d.num_eval_sequences >= c.eval_batches * c.batch_size,
        f"must be >= eval_batches x batch_size = {c.eval_batches * c.batch_size}")


def _check_optimizers(c: ml_collections.ConfigDict, check) -> None:
  """config.inner (the replicas' optimizer and its schedule) and the outer step's own."""
  i, o = c.inner, c.outer
  total = c.num_rounds * c.inner_steps
  check("config.inner.lr", i.lr > 0, "must be > 0")
  check("config.inner.warmup_steps", 0 <= i.warmup_steps < total or total == 0,
        f"must be in [0, num_rounds x inner_steps = {total})")
  check("config.inner.final_lr_fraction", 0 <= i.final_lr_fraction <= 1, "must be in [0, 1]")
  check("config.inner.weight_decay", i.weight_decay >= 0, "must be >= 0")
  check("config.inner.b1", 0 <= i.b1 < 1, "must be in [0, 1)")
  check("config.inner.b2", 0 <= i.b2 < 1, "must be in [0, 1)")
  check("config.inner.eps", i.eps > 0, "must be > 0")
  check("config.inner.clip_norm", i.clip_norm >= 0, "must be >= 0 (0 turns clipping off)")
  check("config.inner.optimizer", i.optimizer in INNER_OPTIMIZERS,
        f"must be one of {INNER_OPTIMIZERS}")
  check("config.inner.muon_lr", i.muon_lr > 0, "must be > 0")
  check("config.inner.muon_momentum", 0 <= i.muon_momentum < 1, "must be in [0, 1)")
  check("config.inner.muon_ns_steps", i.muon_ns_steps >= 1, "must be >= 1")
  check("config.outer.lr", o.lr > 0, "must be > 0")
  check("config.outer.momentum", 0 <= o.momentum < 1, "must be in [0, 1)")
  check("config.outer.max_skipped_rounds", o.max_skipped_rounds >= 1, "must be >= 1")


def _check_checkpoint(c: ml_collections.ConfigDict, check) -> None:
  check("config.checkpoint.every", c.checkpoint.every >= 0,
        "must be >= 0 (0: checkpoints only at preemption and at the end)")
  check("config.checkpoint.keep", c.checkpoint.keep >= 1, "must be >= 1")
  check("config.checkpoint.timeout", c.checkpoint.timeout >= 1, "must be >= 1")


def _driver(mode: str):
  """The driver class of `mode`, whose traits say what the mode allows (None: no mode of
  that name, which config.mode's own check reports)."""
  # Here, not at the top: the drivers import jax, which `--help` and `--print_config` do
  # not need.
  from diloco_jax.modes import registry  # pylint: disable=import-outside-toplevel
  return registry.DRIVERS.get(mode)


def _modes(where, last: str = "or", quoted: bool = True) -> str:
  """The modes whose driver `where` holds true of, as an error lists them."""
  from diloco_jax.modes import registry  # pylint: disable=import-outside-toplevel
  return registry.listed(registry.names(where), last, quoted)


def _check_balance(c: ml_collections.ConfigDict, check, mode) -> None:
  check("config.balance", c.balance in BALANCES,
        f"must be one of {BALANCES} ('window', a wall-clock window per round, is not "
        f"built: its steps could not be replayed on resume)")
  if c.balance == "speed":
    check("config.balance", not mode or mode.carries_pace,
          f"'speed' needs mode {_modes(lambda d: d.carries_pace)} (not {c.mode!r}): "
          + (mode.carries_pace.why if mode else ""))
    check("config.balance", c.outer.aggregation == "mean",
          f"'speed' weights the mean by tokens; outer.aggregation = "
          f"{c.outer.aggregation!r} has no token-weighted form")
  check("config.balance_every", c.balance_every >= 1, "must be >= 1")
  check("config.balance_tolerance", 0 <= c.balance_tolerance < 1, "must be in [0, 1)")
  check("config.balance_max_factor", c.balance_max_factor >= 1, "must be >= 1")


def _check_reporting(c: ml_collections.ConfigDict, check) -> None:
  check("config.log.wandb_mode", c.log.wandb_mode in WANDB_MODES,
        f"must be one of {WANDB_MODES}")
  check("config.log.wandb_project", not c.log.wandb_project
        or importlib.util.find_spec("wandb") is not None,
        "is set, but the wandb package is not installed: pip install 'diloco_jax[wandb]'")
  check("config.profile.start_round", 0 <= c.profile.start_round <= c.num_rounds,
        f"must be in [0, num_rounds = {c.num_rounds}] (0: no profile)")
  check("config.profile.num_rounds", c.profile.num_rounds >= 1, "must be >= 1")


def _check_model_family(m: ml_collections.ConfigDict, check, errors: list[str]) -> None:
  check("config.model.family", m.family in MODEL_FAMILIES, f"must be one of {MODEL_FAMILIES}")
  check("config.model.remat", m.remat in REMAT, f"must be one of {REMAT}")
  check("config.model.attention", m.attention in ATTENTIONS, f"must be one of {ATTENTIONS}")
  check("config.model.rope_base", m.rope_base > 0, "must be > 0")
  check("config.model.norm_eps", m.norm_eps > 0, "must be > 0")
  check("config.model.num_kv_heads", m.num_kv_heads >= 0, "must be >= 0 (0: num_heads)")
  if m.module:
    # Here, not at the top: models import jax, which `--print_config` does not need.
    from diloco_jax.models import family  # pylint: disable=import-outside-toplevel
    try:
      family.import_factory(m.module)
    except family.ModuleError as e:
      errors.append(str(e))
    return
  defaults = get_default_config().model
  if m.family == "gpt":
    for key in ("num_kv_heads", "rope_base", "norm_eps"):
      check(f"config.model.{key}", m[key] == defaults[key],
            f"applies to config.model.family = 'llama' only; leave it at {defaults[key]}")
  elif m.family == "llama" and m.num_heads >= 1 and m.d_model % m.num_heads == 0:
    check("config.model.d_model", m.d_model // m.num_heads % 2 == 0,
          f"/ config.model.num_heads = {m.d_model // m.num_heads} must be even (rotary "
          "embeddings turn pairs of a head's dimensions)")
    if m.num_kv_heads >= 1:
      check("config.model.num_kv_heads", m.num_heads % m.num_kv_heads == 0,
            f"must divide config.model.num_heads = {m.num_heads}")


def _check_streaming(c: ml_collections.ConfigDict, check, mode) -> None:
  # Here, not at the top: algo imports jax, which `--help` and `--print_config` do not need.
  from diloco_jax.algo import fragments  # pylint: disable=import-outside-toplevel
  o = c.outer
  if not (mode and mode.fragments):
    for key, default in (("fragments", 1), ("overlap_steps", 0), ("merge_alpha", 0.0)):
      check(f"config.outer.{key}", o[key] == default,
            f"applies to config.mode = {_modes(lambda d: d.fragments)} only (mode is "
            f"{c.mode!r}); leave it at {default}")
    return
  check("config.outer.fragment_layout", o.fragment_layout in fragments.LAYOUTS,
        f"must be one of {fragments.LAYOUTS}")
  check("config.outer.fragments", 1 <= o.fragments <= c.model.num_layers,
        f"must be in [1, config.model.num_layers = {c.model.num_layers}] (fragments are "
        "made of whole transformer blocks)")
  check("config.outer.merge_alpha", 0 <= o.merge_alpha < 1, "must be in [0, 1)")
  if o.fragments >= 1 and c.inner_steps >= 1:
    check("config.inner_steps", c.inner_steps % o.fragments == 0,
          f"must be divisible by config.outer.fragments = {o.fragments} (fragment p syncs "
          "H/P steps after fragment p − 1)")
    check("config.outer.overlap_steps", 0 <= o.overlap_steps < c.inner_steps // o.fragments,
          f"must be in [0, inner_steps / fragments = {c.inner_steps // o.fragments}): one "
          "fragment in flight at a time")


def _check_wire(c: ml_collections.ConfigDict, check, mode, num_replicas: int) -> None:
  from diloco_jax.algo import aggregate  # pylint: disable=import-outside-toplevel
  from diloco_jax.algo import compress  # pylint: disable=import-outside-toplevel
  o = c.outer
  check("config.outer.compression", o.compression in compress.FORMATS,
        f"must be one of {compress.FORMATS}")
  check("config.outer.topk_fraction", 0 < o.topk_fraction <= 1, "must be in (0, 1]")
  check("config.outer.topk_chunk", 1 <= o.topk_chunk <= 65536,
        "must be in [1, 65536] (offsets in a chunk cross the wire as uint16)")
  check("config.outer.topk_value_bits", o.topk_value_bits in compress.VALUE_BITS,
        f"must be one of {compress.VALUE_BITS}")
  check("config.outer.error_feedback_decay", 0 <= o.error_feedback_decay <= 1,
        "must be in [0, 1]")
  check("config.outer.error_feedback_decay",
        o.error_feedback_decay == 1 or (o.error_feedback and o.compression != "none"),
        "decays the error-feedback accumulator: needs config.outer.error_feedback and a "
        "lossy config.outer.compression")
  check("config.outer.trim", 0 <= o.trim < 0.5, "must be in [0, 0.5)")
  if o.aggregation not in aggregate.AGGREGATIONS:
    check("config.outer.aggregation", False, f"must be one of {aggregate.AGGREGATIONS}")
  elif 0 <= o.trim < 0.5:
    try:
      aggregate.check(o.aggregation, num_replicas, o.trim)
    except ValueError as e:
      check("config.outer.aggregation", False, f"{e} (K = hosts x replicas_per_host)")
  wire = o.compression != "none" or o.aggregation != "mean"
  if wire and mode and mode.per_step:
    check("config.outer.compression" if o.compression != "none" else "config.outer.aggregation",
          False, f"applies to the DiLoCo modes "
          f"({_modes(lambda d: d.per_step, 'and', quoted=False)} sums plain gradients)")
  check("config.outer.aggregation", o.aggregation == "mean" or not (mode and mode.needs_mean),
        f"{c.mode} mode needs the mean ({mode.needs_mean.why if mode else ''})")
