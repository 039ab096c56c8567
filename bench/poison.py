"""One poisoned replica against each aggregation: final eval loss, mean vs robust.

  python bench/poison.py [--rounds=16] [--out=bench/results/poison.json]

configs/tiny.py's model and data with K = 5 replicas on one host. Replica 4's
pseudo-gradient is replaced at every outer step by
  scaled  Δ × 1e6,
  noise   Gaussian noise with 100× the standard deviation of its Δ (fresh each time),
  nan     NaN everywhere,
and the run is repeated with `outer.aggregation` = mean, trimmed_mean (trim 0.2: one
value dropped at each end of the 5) and median, next to an unpoisoned run. The NaN
run with `mean` skips every outer step (the trainer refuses a non-finite mean; here
`outer.max_skipped_rounds` is set past the end so that it runs to completion). Prints a
table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from diloco_jax import outer  # noqa: E402
from diloco_jax import trainer  # noqa: E402

ATTACKS = ("none", "scaled", "noise", "nan")
AGGREGATIONS = ("mean", "trimmed_mean", "median")
BAD = 4  # the poisoned replica


def poison(attack: str):
  """`OuterStep.pseudo_gradients` with replica BAD's Δ replaced per `attack`."""
  original = outer.OuterStep.pseudo_gradients
  key = [jax.random.key(1)]

  def bad(d):
    if attack == "scaled":
      return d * 1e6
    if attack == "nan":
      return jnp.full_like(d, jnp.nan)
    key[0], sub = jax.random.split(key[0])
    return 100 * jnp.std(d) * jax.random.normal(sub, d.shape, d.dtype)

  def pseudo_gradients(self, start, local_R):
    deltas = original(self, start, local_R)
    return jax.tree.map(lambda d: d.at[BAD].set(bad(d[BAD])), deltas)

  return pseudo_gradients


def tiny_config(rounds: int, aggregation: str):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(REPO, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.num_rounds, config.replicas_per_host = rounds, 5
  config.eval_every = rounds
  config.outer.aggregation = aggregation
  config.outer.max_skipped_rounds = rounds + 1
  config.checkpoint.every = 0
  return config


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=16)
  parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "poison.json"))
  args = parser.parse_args()
  rows = []
  original = outer.OuterStep.pseudo_gradients
  for attack in ATTACKS:
    for aggregation in AGGREGATIONS:
      outer.OuterStep.pseudo_gradients = original if attack == "none" else poison(attack)
      with tempfile.TemporaryDirectory() as workdir:
        result = trainer.train_and_evaluate(tiny_config(args.rounds, aggregation), workdir)
      skipped = sum(r.get("skipped", 0) for r in result.records)
      rows.append({"attack": attack, "aggregation": aggregation,
                   "final_eval_loss": float(result.records[-1]["eval_loss"]),
                   "skipped_rounds": skipped})
      print(rows[-1], flush=True)
  outer.OuterStep.pseudo_gradients = original
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"rounds": args.rounds, "replicas": 5, "poisoned_replica": BAD, "rows": rows},
              f, indent=2)
  print(f"\nK = 5, replica {BAD} poisoned, {args.rounds} rounds x H = 25 (configs/tiny.py)\n"
        f"| attack | {' | '.join(AGGREGATIONS)} |\n|---|---|---|---|")
  for attack in ATTACKS:
    cells = []
    for r in rows:
      if r["attack"] == attack:
        loss = r["final_eval_loss"]
        cells.append(f"{loss:.4f}" + (f" ({r['skipped_rounds']} skipped)"
                                      if r["skipped_rounds"] else ""))
    print(f"| {attack} | {' | '.join(cells)} |")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
