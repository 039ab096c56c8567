"""Where each round's record goes: workdir/metrics.jsonl, TensorBoard events, and W&B.

metrics.jsonl holds every record whole (the run's history; a resumed run continues it).
TensorBoard (workdir/tensorboard) and W&B (config.log.wandb_project; workdir/wandb) get
its numbers under grouped tags (`TAGS`: train/loss, eval/loss, comm/bytes_sent, ...),
with tokens seen as the x axis. Only host 0 writes.

clu's metric writers were considered: their TensorBoard writer needs TensorFlow (or
PyTorch) installed, and a resume needs TensorBoard's purge of the rounds trained again,
which tensorboardX's writer has.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any
from typing import Mapping

import numpy as np

from diloco_jax import errors
from diloco_jax.runtime import imports

# The group of each record field, for the tags `group/name` (the group's prefix dropped
# from the name: outer_d2h -> outer/d2h). A field named nowhere goes to `other/`.
GROUPS = {
    "train": ("train_loss", "train_bpb"),
    "eval": ("eval_loss", "eval_bpb", "floor"),
    "throughput": ("tokens_per_sec", "flops_per_sec", "mfu", "round_time"),
    "outer": ("outer_time", "outer_d2h", "outer_mean", "outer_update", "outer_h2d",
              "outer_wait", "delta_norm", "delta_cos", "param_spread", "skipped",
              "skipped_rounds"),
    "comm": ("bytes_sent", "bytes_peak", "collective_time", "overlap", "overlap_steps",
             "fragments_synced"),
    "hosts": ("replicas", "live_hosts", "anchor_hash_time", "anchor_check_time", "hosts_steps",
              "hosts_tokens", "hosts_busy", "hosts_idle"),
    "checkpoint": ("checkpoint_blocking",),
    "memory": ("device_peak_bytes",),
    "progress": ("elapsed", "eta"),
}
TAGS = {field: f"{group}/{field.removeprefix(group + '_')}"
        for group, fields in GROUPS.items() for field in fields}
# Record fields that are not plotted: the x axis and position, wall-clock time, flags.
NOT_PLOTTED = ("round", "tokens", "inner_step", "time", "resumed")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
  """The record's numbers by tag; a per-replica list (delta_norm) as one tag per replica."""
  out = {}
  for key, value in record.items():
    if key in NOT_PLOTTED or isinstance(value, (bool, str)):
      continue
    tag = TAGS.get(key, f"other/{key}")
    if isinstance(value, (int, float)):
      out[tag] = float(value)
    elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
      per = "host" if key.startswith("hosts_") else "replica"  # hosts/steps/host_1
      out.update({f"{tag}/{per}_{m}": float(v) for m, v in enumerate(value)})
  return out


class MetricsError(errors.DilocoError, RuntimeError):
  """metrics.jsonl cannot be continued; the message names the file and the line."""


def read_records(path: str) -> tuple[list[dict[str, Any]], bool]:
  """The records of a metrics.jsonl, and whether its last line was torn (a write cut
  short by a crash or a full disk: dropped). Any other bad line is a MetricsError."""
  with open(path, "rb") as f:
    lines = f.read().decode(errors="replace").split("\n")
  records, torn = [], False
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict) or not isinstance(record.get("round"), int):
        raise ValueError("not a round's record")
    except ValueError as e:
      if i == last:
        torn = True
        continue
      raise MetricsError(f"{path}, line {i + 1}: {e}: {line[:80]!r}. Fix or remove that line "
                         "(the records are this run's history) and run again") from None
    records.append(record)
  return records, torn


class MetricsWriter:
  """Appends one JSON record per round to workdir/metrics.jsonl and writes its numbers to
  TensorBoard (and W&B with `wandb`: config.log's fields and the run's config).

  A run continues the file: the records of rounds before `first_round` are kept (the
  rounds the checkpoint holds), later ones are dropped, since they are trained and logged
  again, and TensorBoard is told to purge its events from `purge_step` on (W&B cannot
  purge: its charts show those rounds twice). Without `enabled` (hosts other than 0)
  nothing is written."""

  def __init__(self, workdir: str, enabled: bool = True, first_round: int | None = None,
               purge_step: int | None = None, wandb: Mapping[str, Any] | None = None):
    self.workdir, self.wanted, self.wandb = workdir, enabled, wandb
    self.enabled = False  # in memory only until `begin` (a Trainer used without `run`)
    self.records: list[dict[str, Any]] = []
    if first_round is not None:
      self.begin(first_round, purge_step)

  def begin(self, first_round: int, purge_step: int | None = None) -> None:
    """Continues the workdir's files from `first_round` (what a resume knows only once it
    has read the checkpoint), writing if the writer was made `enabled`."""
    enabled = self.enabled = self.wanted
    workdir, wandb = self.workdir, self.wandb
    path, self.records = os.path.join(workdir, "metrics.jsonl"), []
    if os.path.exists(path):
      records, torn = read_records(path)
      self.records = [r for r in records if r["round"] < first_round]
      dropped = len(records) - len(self.records)
      if enabled and (torn or dropped):
        print(f"WARNING: {path}: "
              + ("a torn last line (a write cut short) removed" if torn else "")
              + ("; " if torn and dropped else "")
              + (f"{dropped} record(s) of rounds >= {first_round} removed (the checkpoint "
                 "does not hold them: they are trained and logged again)" if dropped else ""),
              file=sys.stderr, flush=True)
        with open(path + ".tmp", "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in self.records)
        os.replace(path + ".tmp", path)
    if not enabled:
      return
    with imports.without("torch"):  # tensorboardX's, only to accept torch tensors
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._jsonl = open(path, "a")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge_step)
    self._wandb = WandbWriter(workdir, **wandb) if wandb and wandb.get("project") else None

  def write(self, record: Mapping[str, Any]) -> None:
    record = {k: _plain(v) for k, v in record.items()}
    self.records.append(record)
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    numbers = scalars(record)
    for tag, value in numbers.items():
      self._tb.add_scalar(tag, value, global_step=record["tokens"])
    if self._wandb is not None:
      self._wandb.write(numbers, record["tokens"])

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()
      if self._wandb is not None:
        self._wandb.close()


class WandbWriter:
  """A W&B run in workdir/wandb. `mode` "offline" (the default) writes files only, which
  `wandb sync workdir/wandb/offline-run-*` uploads later; "online" logs as it trains.
  The run's id is kept in workdir/wandb/run_id, so a resumed run continues the same run."""

  def __init__(self, workdir: str, *, project: str, mode: str, config: Mapping[str, Any]):
    import wandb  # an optional extra: pip install 'diloco_jax[wandb]' (checked at start)
    directory = os.path.join(workdir, "wandb")
    os.makedirs(directory, exist_ok=True)
    id_path = os.path.join(directory, "run_id")
    if os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
      with open(id_path, "w") as f:
        f.write(run_id + "\n")
    # console "off": W&B would otherwise wrap stdout and stderr to copy the output.
    self._run = wandb.init(project=project, mode=mode, dir=workdir, id=run_id,
                           resume="allow", name=os.path.basename(os.path.abspath(workdir)),
                           config=dict(config),
                           settings=wandb.Settings(console="off", silent=True))
    self._run.define_metric("tokens")
    self._run.define_metric("*", step_metric="tokens")

  def write(self, numbers: Mapping[str, float], tokens: int) -> None:
    self._run.log({**numbers, "tokens": tokens})

  def close(self) -> None:
    self._run.finish()


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)):
    return v.item()
  return v
