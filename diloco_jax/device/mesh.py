"""The host's devices: the local mesh the inner step runs on, how state and batches are
laid out on it, and whether a run fits in their memory.

The local mesh has three named axes over this host's devices, outermost first:

  replica  `config.mesh.replicas` device groups; the host's R replicas are split over them
           (R / groups per group, run one after another within a group)
  data     the rest of the devices: a replica's batch is split over them too
  fsdp     `config.mesh.fsdp` devices over which a replica's params and AdamW state are
           sharded; its batch is split over them as well (FSDP, ZeRO-3 style)

`Layout` gives every leaf its `NamedSharding` by one rule on its shape: a leaf of a
replica's params or optimizer state is split over `fsdp` along its largest dimension
that `fsdp` divides (the first such if several are as large), and replicated over
`data` and where no dimension divides; a leaf of all R replicas ([R, ...]) is also split
over `replica` along R. Batches [R, B, L+1] split R over `replica` and B over
(`data`, `fsdp`). `mesh.replicas = mesh.fsdp = 1` is a 1-D data-parallel mesh: every
device holds every replica.

`check_memory` refuses, before anything is allocated, a config whose estimate
(`model.memory_estimate` for the mode's `MemoryProfile`) exceeds what the devices or the
host have, with the figures.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import errors
from diloco_jax import units
from diloco_jax.algo import state as state_lib
from diloco_jax.models import family
from diloco_jax.models import model as model_lib
from diloco_jax.runtime.hostmem import host_memory_available

REPLICA_AXIS, DATA_AXIS, FSDP_AXIS = "replica", "data", "fsdp"


def local_mesh(replicas: int = 1, fsdp: int = 1) -> Mesh:
  """A mesh over this host's devices only (inner steps never cross hosts), shaped
  [replicas, data, fsdp]: the devices of one FSDP group are neighbours in
  `jax.local_devices()` order."""
  devices = np.array(jax.local_devices())
  if devices.size % (replicas * fsdp):
    raise errors.ConfigError(
        f"config.mesh: replicas x fsdp = {replicas} x {fsdp} must divide the "
        f"{devices.size} local devices")
  return Mesh(devices.reshape(replicas, devices.size // (replicas * fsdp), fsdp),
              (REPLICA_AXIS, DATA_AXIS, FSDP_AXIS))


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
_broadcast = jax.jit(state_lib.broadcast_to_replicas, static_argnums=1)


def sharded_dim(shape: tuple[int, ...], fsdp: int) -> int | None:
  """The dimension of a leaf split over `fsdp` devices: its largest that `fsdp` divides
  (the first of equals), or None (replicated: fsdp = 1, a scalar, no dimension divides)."""
  fits = [d for d in range(len(shape)) if fsdp > 1 and shape[d] % fsdp == 0]
  return max(fits, key=lambda d: (shape[d], -d)) if fits else None


class Layout:
  """The shardings of the inner step's state and batches on a local mesh (the module
  docstring has the rule)."""

  def __init__(self, mesh: Mesh):
    self.mesh = mesh
    self.groups, self.fsdp = mesh.shape[REPLICA_AXIS], mesh.shape[FSDP_AXIS]
    self._replica = REPLICA_AXIS if self.groups > 1 else None
    self.batch = NamedSharding(mesh, P(self._replica, (DATA_AXIS, FSDP_AXIS)))  # [R, B, L+1]
    self.eval_batch = NamedSharding(mesh, P(None, (DATA_AXIS, FSDP_AXIS)))  # [E, B, L+1]
    self.per_replica = NamedSharding(mesh, P(self._replica))  # [R]: a loss per replica
    self.replicated = NamedSharding(mesh, P())

  def spec(self, shape: tuple[int, ...]) -> tuple[str | None, ...]:
    """The partition of one replica's leaf of this shape: `fsdp` on `sharded_dim`."""
    dim = sharded_dim(shape, self.fsdp)
    return tuple(FSDP_AXIS if d == dim else None for d in range(len(shape)))

  def params(self, tree: Any) -> Any:
    """Shardings for one replica's params (or anything shaped like them: the anchor)."""
    return jax.tree.map(lambda x: NamedSharding(self.mesh, P(*self.spec(np.shape(x)))), tree)

  def replicas(self, tree: Any) -> Any:
    """Shardings for a tree of all R replicas' leaves, [R, ...] each."""
    return jax.tree.map(lambda x: NamedSharding(
        self.mesh, P(self._replica, *self.spec(np.shape(x)[1:]))), tree)

  def put(self, tree: Any, per_replica: bool = False) -> Any:
    """A private copy of one replica's params (`per_replica`: all R replicas' leaves) on
    the mesh, as the inner step holds them: each device receives only its shards. Private:
    the outer state it comes from must survive the inner step's donation."""
    shardings = (self.replicas if per_replica else self.params)(tree)
    if self.mesh.devices.size > 1 and self.mesh.devices.flat[0].platform == "cpu":
      # device_put(may_alias=False) to several devices still aliases the shard on the
      # source device (jax 0.10.2, measured): a jitted copy is the private copy.
      tree = _copy(tree)
    return jax.device_put(tree, shardings, may_alias=False)

  def broadcast(self, params: Any, num_replicas: int) -> Any:
    """[R, ...] copies of params `put` on the mesh, sharded as the replicas are (with
    replica groups, each group keeps its own replicas' rows: no data moves)."""
    return self.hold(_broadcast(params, num_replicas))

  def hold(self, tree: Any) -> Any:
    """All R replicas' leaves [R, ...] resharded as the inner step holds them (a no-op
    where they already are)."""
    return jax.device_put(tree, self.replicas(tree))

  def describe(self) -> dict:
    """How the inner step uses the host's devices (run.json's "layout")."""
    sharded = (f"sharded over '{FSDP_AXIS}' ({self.fsdp} devices) along each leaf's "
               f"largest dimension {self.fsdp} divides, else replicated" if self.fsdp > 1
               else "replicated on every device of a replica's group")
    return {"mesh": dict(self.mesh.shape),
            "replicas": (f"split over '{REPLICA_AXIS}' ({self.groups} device groups), one "
                         f"after another within a group" if self.groups > 1 else
                         "one after another, on every device"),
            "params_and_optimizer_state": sharded,
            "batch": f"split over ('{DATA_AXIS}', '{FSDP_AXIS}')"}


# Dense bf16 peak FLOP/s per device, from the vendors' data sheets (without sparsity), by a
# substring of `device.device_kind`; the first match wins (PCIe before the SXM default).
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12))


def peak_flops(device: jax.Device) -> float | None:
  """The device's dense bf16 peak FLOP/s, or None where the table has none (CPUs): MFU is
  then not reported, only FLOP/s. MFU is against the bf16 peak whatever model.dtype is
  (the usual convention: a float32 run shows how far it is from what bf16 would allow)."""
  kind = getattr(device, "device_kind", "")
  return next((peak for name, peak in PEAK_BF16_FLOPS if name in kind), None)


def device_memory_limit() -> int | None:
  """Bytes one local accelerator can allocate, None where the devices share host memory
  (CPU) or the platform does not say. Initialises the backend (after `distributed`)."""
  stats = jax.local_devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def peak_bytes(devices) -> int | None:
  """The most bytes any of `devices` has held at once so far (the allocator's peak, from
  `memory_stats()`), None where the platform does not say (CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  return max(peaks) if peaks and None not in peaks else None


class MemoryProfile(NamedTuple):
  """What a mode holds of the model's size, in copies of its params (its driver's
  `memory_profile`; this layer knows no modes).

  Attributes:
    param_sets: sets of params and AdamW moments on every local device.
    grad_copies: gradients alive at once in an inner step (without accumulation's
      running sum, which `check_memory` adds).
    host_copies: copies of the params in host memory (the outer state, Δ and what it is
      computed from).
  """
  param_sets: int
  grad_copies: int
  host_copies: int


def memory_needs(config: ml_collections.ConfigDict, vocab_size: int, num_local_devices: int,
                 profile: MemoryProfile) -> tuple[dict[str, int], dict[str, int]]:
  """({part: bytes} on every local device, {part: bytes} in host memory) of a run of
  `config` on this many local devices: `model.memory_estimate` for the mode's `profile`
  and this layout, and the synthetic source's tables."""
  accum, groups, fsdp = config.grad_accum_steps, config.mesh.replicas, config.mesh.fsdp
  cfg = family.ModelConfig.from_config(config.model, vocab_size)
  device, host = model_lib.memory_estimate(
      cfg, param_sets=profile.param_sets, fsdp=fsdp,
      grad_copies=profile.grad_copies + (accum > 1), host_copies=profile.host_copies,
      micro_batch=max(config.batch_size * groups // (accum * num_local_devices), 1))
  d = config.data
  if d.source == "synthetic":  # the chain's tables (probs, cdf, sort scratch) and samples
    host["data"] = (4 * 8 * d.vocab_size ** d.markov_order * d.vocab_size
                    + 4 * (d.num_sequences + d.num_eval_sequences) * (cfg.seq_len + 1))
  return device, host


def check_memory(config: ml_collections.ConfigDict, vocab_size: int,
                 num_local_devices: int, profile: MemoryProfile) -> None:
  """Raises a ConfigError, with the figures, if the run cannot fit in memory: the estimate
  (`memory_needs`) against `device_memory_limit()` per accelerator and
  `host_memory_available()`; with CPU devices, everything against the host's. Call it
  after `validate` and `cluster.initialize`, before anything is allocated."""
  groups, fsdp, sets = config.mesh.replicas, config.mesh.fsdp, profile.param_sets
  device, host = memory_needs(config, vocab_size, num_local_devices, profile)
  cfg = family.ModelConfig.from_config(config.model, vocab_size)
  n = model_lib.num_params_of(cfg)
  embed = (1 if cfg.tie_embeddings else 2) * vocab_size * cfg.d_model
  # The model's own vocabulary when it has one (a pretrained model's), else the data's.
  vocab = "config.model.vocab_size" if config.model.get("vocab_size") else "config.data.vocab_size"
  model = ["config.model", *([vocab] if embed > n / 2 else [])]
  layout = ["config.mesh.fsdp"] if fsdp < num_local_devices // groups else []
  causes = {"state": [*model, *(["config.replicas_per_host"] if sets > 1 else []), *layout],
            "step": [*model, *layout], "outer": [*model, "config.replicas_per_host"],
            "activations": ["config.model", "config.batch_size / config.grad_accum_steps"],
            "logits": [vocab, "config.batch_size / config.grad_accum_steps"],
            "data": ["config.data.vocab_size / markov_order", "config.data.num_sequences"]}
  figures = (f"{n:,} params ({embed / n:.0%} in the embedding and head, vocab_size "
             f"{vocab_size:,} x d_model {cfg.d_model}); per device: state "
             f"{units.format_bytes(device['state'])} ({sets} x params + 2 AdamW moments, float32"
             f"{f', sharded {fsdp} ways' if fsdp > 1 else ''}), step "
             f"{units.format_bytes(device['step'])} (gradients, update, eval copy), "
             f"activations {units.format_bytes(device['activations'])}, logits "
             f"{units.format_bytes(device['logits'])}; host: "
             + ", ".join(f"{k} {units.format_bytes(v)}" for k, v in host.items()))

  def error(parts: dict[str, int], needs: str, available: str) -> str:
    # Named first: the fields behind the parts that make up most of the need.
    big = [k for k, v in parts.items() if v >= max(parts.values()) / 3]
    fields = list(dict.fromkeys(f for k in big for f in causes[k]))
    return f"{' / '.join(fields)}: needs about {needs}, more than the {available}: {figures}"

  per_device, on_host = sum(device.values()), sum(host.values())
  device_limit, host_available = device_memory_limit(), host_memory_available()
  if device_limit is None:  # CPU devices: their memory is the host's
    need = per_device * num_local_devices + on_host
    if need > host_available:
      raise errors.ConfigError(error(
          {**{k: v * num_local_devices for k, v in device.items()}, **host},
          f"{units.format_bytes(need)} of memory ({num_local_devices} CPU "
          f"device{'s' * (num_local_devices > 1)} x {units.format_bytes(per_device)} + host "
          f"{units.format_bytes(on_host)})", f"{units.format_bytes(host_available)} available"))
    return
  problems = []
  if per_device > device_limit:
    problems.append(error(device, f"{units.format_bytes(per_device)} per device",
                          f"{units.format_bytes(device_limit)} a device has"))
  if on_host > host_available:
    problems.append(error(host, f"{units.format_bytes(on_host)} of host memory",
                          f"{units.format_bytes(host_available)} available"))
  if problems:
    raise errors.ConfigError("\n".join(problems))
