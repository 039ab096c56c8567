"""The figures a run and the benches draw: the loss plot of a run (`plot_losses`) and the
labels, grid and legend every figure shares (`save_figure`). matplotlib is imported inside,
so that a start never pays for it."""

from __future__ import annotations

from typing import Any
from typing import Mapping


def plot_losses(records: list[Mapping[str, Any]], path: str, *, floor: float | None,
                unigram: float | None, title: str = "") -> None:
  """Train and eval loss against tokens seen, with the loss floor and unigram loss drawn;
  records with bits per byte (prepared data) add a right axis in bits per byte of the
  train split and the last figures to the legend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  tokens = [r["tokens"] for r in records]
  last = {s: next((f", last {r[s + '_bpb']:.3f} bpb" for r in reversed(records)
                   if s + "_bpb" in r), "") for s in ("train", "eval")}
  ax.plot(tokens, [r["train_loss"] for r in records],
          label=f"train (mean over replicas){last['train']}")
  evals = [(r["tokens"], r["eval_loss"]) for r in records if "eval_loss" in r]
  if evals:
    ax.plot(*zip(*evals), "o-", markersize=3, label=f"eval (anchor){last['eval']}")
  scaled = next((r for r in records if r.get("train_bpb")), None)
  if scaled is not None:  # nats/token -> bits/byte is a fixed factor for the train split
    k = scaled["train_loss"] / scaled["train_bpb"]
    ax.secondary_yaxis("right", functions=(lambda x: x / k, lambda y: y * k)).set_ylabel(
        "bits per byte (train split)")
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
