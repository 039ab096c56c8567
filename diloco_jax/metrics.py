"""What a run reports: the per-round line, a progress bar, metrics.jsonl, TensorBoard, a plot.

Only host 0 writes files (`enabled=False` elsewhere). Values arrive here already on the
host: the trainer reads device values one round late so logging never stalls the devices.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping

import numpy as np


def format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_count(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}"


def round_line(r: Mapping[str, Any], num_rounds: int, total_steps: int) -> str:
  """The one line printed per round (README: "Reading the progress line")."""
  width = len(str(num_rounds))
  parts = [f"round {r['round']:>{width}}/{num_rounds}",
           f"step {r['inner_step']:>{len(str(total_steps))}}/{total_steps}",
           f"train {r['train_loss']:.4f}"]
  if "eval_loss" in r:
    floor = f" (floor {r['floor']:.4f})" if r.get("floor") is not None else ""
    parts.append(f"eval {r['eval_loss']:.4f}{floor}")
  if "replicas" in r:  # elastic mode: the replicas in this round's mean
    parts.append(f"{int(r['replicas'])} replicas")
  parts += [f"{format_count(r['tokens_per_sec'])} tok/s",
            f"outer {1e3 * r['outer_time']:.0f} ms"]
  if "collective_time" in r:  # how long the cross-host sum took, and how much of it the
    # next inner phase hid (async modes; 0% in sync, which waits for all of it)
    parts.append(f"comm {1e3 * r['collective_time']:.0f} ms ({100 * r['overlap']:.0f}% hidden)")
  if r.get("bytes_sent"):
    parts.append(f"sent {format_count(r['bytes_sent'])}B")
  if "anchor_hash" in r:  # debug_checks: the same on every host, or the run has stopped
    parts.append(f"anchor {r['anchor_hash'][:8]} on all hosts")
  parts.append(f"ETA {format_duration(r['eta'])}")
  return " | ".join(parts)


class ProgressBar:
  """A one-line bar of inner steps, redrawn in place; silent when stdout is not a terminal."""

  def __init__(self, total: int, enabled: bool = True, stream=None):
    self.stream = stream or sys.stdout
    self.total = total
    self.enabled = enabled and self.stream.isatty()
    self._last = 0.0

  def update(self, step: int, note: str = "") -> None:
    now = time.monotonic()
    if not self.enabled or (now - self._last < 0.1 and step < self.total):
      return
    self._last = now
    filled = int(30 * step / self.total)
    self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} {note}")
    self.stream.flush()

  def clear(self) -> None:
    if self.enabled:
      self.stream.write("\r\033[K")
      self.stream.flush()


class MetricsWriter:
  """Appends one JSON record per round to workdir/metrics.jsonl and mirrors the scalars
  to TensorBoard event files in workdir/tensorboard, with tokens seen as the x axis."""

  def __init__(self, workdir: str, enabled: bool = True, resume_before: int | None = None):
    """`resume_before`: a resumed run keeps the records of earlier rounds (later ones are
    trained again); None starts the file afresh."""
    self.enabled = enabled
    self.records: list[dict[str, Any]] = []
    path = os.path.join(workdir, "metrics.jsonl")
    if resume_before is not None and os.path.exists(path):
      with open(path) as f:
        self.records = [r for r in map(json.loads, filter(str.strip, f))
                        if r["round"] < resume_before]
    if not enabled:
      return
    from tensorboardX import SummaryWriter  # Imported on host 0 only.
    self._jsonl = open(path, "w")
    for record in self.records:
      self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, record: Mapping[str, Any]) -> None:
    record = {k: _plain(v) for k, v in record.items()}
    self.records.append(record)
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in record.items():
      if isinstance(value, (int, float)) and key not in ("round", "tokens"):
        self._tb.add_scalar(key, value, global_step=record["tokens"])

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray)):
    return v.item()
  return v


def plot_losses(records: list[Mapping[str, Any]], path: str, *, floor: float | None,
                unigram: float | None, title: str = "") -> None:
  """Train and eval loss against tokens seen, with the loss floor and unigram loss drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  tokens = [r["tokens"] for r in records]
  ax.plot(tokens, [r["train_loss"] for r in records], label="train (mean over replicas)")
  evals = [(r["tokens"], r["eval_loss"]) for r in records if "eval_loss" in r]
  if evals:
    ax.plot(*zip(*evals), "o-", markersize=3, label="eval (anchor)")
  if floor is not None:
    ax.axhline(floor, color="k", linestyle="--", label=f"floor (true model) {floor:.3f}")
  if unigram is not None:
    ax.axhline(unigram, color="gray", linestyle=":", label=f"best unigram {unigram:.3f}")
  save_figure(fig, ax, path, xlabel="tokens seen (all replicas)",
              ylabel="loss (nats/token)", title=title)


def save_figure(fig, ax, path: str, *, xlabel: str, ylabel: str, title: str) -> None:
  """Labels, grid and legend, then writes the figure to `path` and closes it."""
  import matplotlib.pyplot as plt
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
