"""What every checkpoint store shares: the `Store` protocol the loop uses, the `Snapshot` a
round boundary is saved as, the error a store raises, the checks made before writing or
using a checkpoint, and the JSON rows a data iterator's state is kept in.

The stores: `shared_dir.SharedDirStore` (one workdir every host shares, orbax) and
`per_host.PerHostStore` (a workdir per host, each host's own disk, safetensors).

One policy for a checkpoint that cannot be read, in both stores:
  - the run resumes from the newest checkpoint that every host which needs one can read
    (per host: or heals a host without one from a peer, checkpoints/recovery.py);
  - a checkpoint some host cannot read is named on that host in one line (its path and
    why: a sha256 mismatch, a file cut short, orbax's error) and never used;
  - once the run has resumed from another, an unreadable checkpoint is moved to
    workdir/checkpoints_unreadable/<round>-<time>/ with a line saying where (a shared
    workdir: by host 0; per host: by each host that could not read it);
  - when none can be read, the run is refused with one line, on this attempt and every
    later one, and everything stays where it is;
  - nothing is deleted: `--restart_from_scratch` moves the old run aside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
import uuid
from typing import Any
from typing import Callable
from typing import Protocol

import jax
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax import units

CHECKPOINTS = "checkpoints"
UNREADABLE = "checkpoints_unreadable"
JSON_BYTES = 4096  # Room for one data iterator's state, JSON-encoded.


class CheckpointError(errors.DilocoError, RuntimeError):
  """A checkpoint cannot be written or used; the message says which and why."""
  prefix = "Checkpoint error"


@dataclasses.dataclass
class Snapshot:
  """Everything needed to continue after round `round`, bit for bit (checkpoints are
  taken at round boundaries only).

  Attributes:
    round: the last round whose outer step is in `shared`.
    shared: pytree identical on every host (written once).
    own: pytree of this host's state (one row per host on disk).
    meta: JSON-serializable description (round, config, world, versions).
    missing: on restore, the hosts of this run that have no row of their own in it (a
      new, wiped or returning host, or more hosts than wrote it): they restart their
      replicas from the anchor. The same on every host.
    model: the trained params, in a finished run's last checkpoint (what `sample` and
      `export` read: eager's is the mean of every host's replicas, which no one host's
      files hold); None otherwise. Written by the per-host store alone.
  """
  round: int
  shared: Any
  own: Any
  meta: dict[str, Any]
  missing: tuple[int, ...] = ()
  model: Any = None


@dataclasses.dataclass(frozen=True)
class Recovered:
  """What a per-host restore did (checkpoints/recovery.py), for the start-up lines and
  run.json: the round, the host whose shared state was taken, the hosts healed, and the
  bytes and seconds the heal took."""
  round: int
  source: int
  healed: tuple[int, ...]
  bytes: int = 0
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class SavePolicy:
  """When the round loop saves: every `every` rounds (config.checkpoint.every; 0: never),
  and after the round a preemption stops at. The last round is saved by the end of the
  run (`last=True`), never here."""
  every: int
  last_round: int

  def due(self, r: int, preempted: bool) -> bool:
    return r < self.last_round and (preempted or bool(self.every and r % self.every == 0))


class Store(Protocol):
  """A checkpoint store, as the round loop uses it (the policy for an unreadable
  checkpoint: the module docstring).

  Attributes:
    directory: workdir/checkpoints, this host's view of it.
    write_seconds: how long the last save that finished took on disk (None: none yet).
    recovered: what `restore` did to heal hosts (per host; None: no heal, and always on
      a shared workdir, where every host reads the checkpoint itself).
  """
  directory: str
  write_seconds: float | None
  recovered: Recovered | None

  def save(self, snapshot: Snapshot, last: bool = False,
           after: threading.Event | None = None) -> float:
    """Starts writing `snapshot` in the background; returns the seconds the caller was
    blocked. `last`: nothing will change its arrays any more (no private copy). `after`:
    nothing reaches the disk before it is set (the caller's round record first)."""

  def wait(self) -> None:
    """Until the saves started are complete on disk; raises if one failed."""

  def close(self) -> None:
    """Finishes the save in flight and lets go of the directory."""

  def restore(self, like: Callable[[dict], Snapshot],
              check_meta: Callable[[dict], None]) -> Snapshot | None:
    """The snapshot to resume from, agreed by every host; None when there is no
    checkpoint. `like(meta)`: the structure, shapes and dtypes to read into;
    `check_meta(meta)` raises a CheckpointError when the checkpoint does not fit this run
    (a refusal, not an unreadable checkpoint). Every host calls it at the same time."""


def move_aside(workdir: str, path: str, r: int) -> str:
  """Moves the unreadable checkpoint of round r at `path` to
  workdir/checkpoints_unreadable/ (kept for inspection, out of the stores' listings);
  returns where it went."""
  target = os.path.join(workdir, UNREADABLE, f"{r}-{int(time.time())}")
  if os.path.exists(target):  # the same round set aside twice in a second
    target += f"-{uuid.uuid4().hex[:6]}"
  os.makedirs(os.path.dirname(target), exist_ok=True)
  shutil.move(path, target)
  return target


def encode_json(items: list[Any]) -> np.ndarray:
  """[len(items), JSON_BYTES] uint8: each item as JSON, zero-padded (a fixed shape, so
  the same array layout on every host)."""
  out = np.zeros((len(items), JSON_BYTES), np.uint8)
  for i, item in enumerate(items):
    raw = json.dumps(item).encode()
    if len(raw) > JSON_BYTES:
      raise CheckpointError(f"a data iterator's state is {len(raw)} bytes of JSON, more "
                            f"than the {JSON_BYTES} bytes reserved for it")
    out[i, :len(raw)] = np.frombuffer(raw, np.uint8)
  return out


def decode_json(rows: np.ndarray) -> list[Any]:
  return [json.loads(bytes(row).rstrip(b"\0")) for row in np.asarray(rows)]


def check_writable(workdir: str) -> None:
  """Fails at start, not at the first checkpoint, when `workdir` cannot be written."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_test_{uuid.uuid4().hex}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(f"--workdir={workdir} is not a writable directory: {e}") from e


def check_compatible(meta: dict, config, *, num_hosts: int, replicas_per_host: int,
                     where: str) -> None:
  """Refuses a checkpoint written with another number of replicas per host, or with a
  config whose math differs. Another number of hosts is allowed (loop/trainer.py)."""
  if meta["replicas_per_host"] != replicas_per_host:
    raise CheckpointError(
        f"{where} was written by {meta['num_hosts']} host(s) x {meta['replicas_per_host']} "
        f"replica(s); this run has {num_hosts} x {replicas_per_host}. A run resumes with "
        f"the replicas per host that wrote it (each replica's inner state and data iterator "
        f"belong to one host): restart with --config.replicas_per_host="
        f"{meta['replicas_per_host']}, or use a new --workdir")
  before = config_lib.flatten(config_lib.from_saved(meta["config"]))
  now = config_lib.flatten(config)
  changed = sorted(k for k in before.keys() | now.keys()
                   if k not in config_lib.RESUMABLE_CHANGES and before.get(k) != now.get(k))
  if changed:
    lines = "".join(f"\n  {k}: checkpoint {before.get(k)!r}, now {now.get(k)!r}" for k in changed)
    flags = " ".join(f"--{k}={before[k]}" for k in changed  # those a flag can give back
                     if isinstance(before.get(k), (bool, int, float, str)))
    raise CheckpointError(
        f"the config differs from {where} in fields that change the math:{lines}\nRun with "
        f"the checkpoint's values to resume{f' ({flags})' if flags else ''}, or use a new "
        f"--workdir. Fields a resumed run may change: {', '.join(config_lib.RESUMABLE_CHANGES)}")


def check_space(directory: str, r: int, needed: int) -> None:
  """Refuses a save of `needed` bytes the filesystem cannot hold, before it is written."""
  free = shutil.disk_usage(directory).free
  if free < needed + needed // 10:
    raise CheckpointError(
        f"checkpoint {r} needs about {units.format_bytes(needed)} in {directory}, "
        f"which has {units.format_bytes(free)} free: not written. The checkpoints before "
        f"it are intact; free some space and run the same command to continue")


def to_host(tree: Any, private: bool) -> Any:
  """The tree in host memory: a private copy (`private`: the live arrays are donated by
  the next step), else the arrays themselves where they already are in host memory (a
  CPU jax.Array is read in place; a GPU one is copied, as it must be)."""
  if private:
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)
  return jax.tree.map(np.asarray, tree)


def last_epoch(workdir: str | None, host: int) -> int:
  """The highest epoch number host `host` saw in its run, as its newest checkpoint in
  `workdir` (its own, or WORKDIR/host<i> of a shared one) says; 0 where none says."""
  for directory in ([os.path.join(workdir, f"host{host}"), workdir] if workdir else []):
    checkpoints = os.path.join(directory, CHECKPOINTS)
    try:
      newest = max(int(n) for n in os.listdir(checkpoints) if n.isdigit())
      with open(os.path.join(checkpoints, str(newest), "meta.json")) as f:
        number = json.load(f).get("epoch")
      return number if isinstance(number, int) and 0 <= number < 1 << 62 else 0
    except (OSError, ValueError, AttributeError):
      continue
  return 0
