"""One poisoned replica against each aggregation: final eval loss, mean vs robust.

  python -m bench.poison [--rounds=16] [--inner_steps=25] [--out=bench/results/poison.json]
  python -m bench.poison --smoke  # seconds: 4 runs (every attack, every aggregation), 2 x 2 steps

configs/tiny.py's model and data with K = 5 replicas on one host. Through the trainer's
`pseudo_gradient_hook`, replica 4's pseudo-gradient is replaced at every outer step by
  scaled  Δ × 1e6,
  noise   Gaussian noise with 100× the standard deviation of its Δ (fresh each time),
  nan     NaN everywhere,
and the run is repeated with `outer.aggregation` = mean, trimmed_mean (trim 0.2: one
value dropped at each end of the 5) and median, next to an unpoisoned run. The NaN
run with `mean` skips every outer step (the trainer refuses a non-finite mean; here
`outer.max_skipped_rounds` is set past the end so that it runs to completion). Prints a
table and writes it as JSON. `--runs` picks attack:aggregation pairs instead of all 12;
--smoke runs 4 of them (each attack once, each aggregation at least once), 2 rounds of
H = 2 with 2 sequences per step on a one-block model, and writes to --out or a temporary
directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from bench import harness
from diloco_jax.loop import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ATTACKS = ("none", "scaled", "noise", "nan")
AGGREGATIONS = ("mean", "trimmed_mean", "median")
BAD = 4  # the poisoned replica
SMOKE_RUNS = "none:mean,scaled:median,noise:trimmed_mean,nan:mean"


def poison(attack: str):
  """A `pseudo_gradient_hook` (modes/base.py) that replaces replica BAD's Δ per `attack`."""
  key = [jax.random.key(1)]

  def bad(d, sub):
    if attack == "scaled":
      return d * 1e6
    if attack == "nan":
      return jnp.full_like(d, jnp.nan)
    return 100 * jnp.std(d) * jax.random.normal(sub, d.shape, d.dtype)

  @jax.jit  # one program for the whole tree, not a dozen small ones per leaf
  def replace(deltas, k):
    def one(d):
      nonlocal k
      k, sub = jax.random.split(k)  # noise: a fresh key per leaf, per outer step
      return d.at[BAD].set(bad(d[BAD], sub))
    return jax.tree.map(one, deltas), k

  def hook(deltas_R, *, round_: int, fragment: int):
    del round_, fragment  # every outer step, every fragment
    deltas_R, key[0] = replace(deltas_R, key[0])
    return deltas_R

  return hook


def tiny_config(args, aggregation: str):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(REPO, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  rounds = args.rounds
  config.num_rounds, config.replicas_per_host = rounds, 5
  config.inner_steps = args.inner_steps
  if args.smoke:
    config.batch_size, config.eval_batches, config.model.num_layers = 2, 1, 1
  config.inner.warmup_steps = min(config.inner.warmup_steps, rounds * config.inner_steps - 1)
  config.eval_every = rounds
  config.outer.aggregation = aggregation
  config.outer.max_skipped_rounds = rounds + 1
  config.checkpoint.every = 0
  return config


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rounds", type=int, default=16)
  parser.add_argument("--inner_steps", type=int, default=25, help="H")
  parser.add_argument("--runs", default=None,
                      help="attack:aggregation pairs, comma-separated (default: all 12)")
  args = harness.parse_args(parser, "poison",
                           dict(rounds=2, inner_steps=2, runs=SMOKE_RUNS))
  runs = ([tuple(run.split(":")) for run in args.runs.split(",")] if args.runs
          else [(a, g) for a in ATTACKS for g in AGGREGATIONS])
  unknown = [run for run in runs if run[0] not in ATTACKS or run[-1] not in AGGREGATIONS]
  if unknown:
    parser.error(f"--runs: unknown {unknown}: attacks {ATTACKS}, aggregations {AGGREGATIONS}")
  rows = []
  for attack, aggregation in runs:
    with tempfile.TemporaryDirectory() as workdir:
      result = trainer.train_and_evaluate(
          tiny_config(args, aggregation), workdir,
          pseudo_gradient_hook=None if attack == "none" else poison(attack))
    skipped = sum(r.get("skipped", 0) for r in result.records)
    rows.append({"attack": attack, "aggregation": aggregation,
                 "final_eval_loss": float(result.records[-1]["eval_loss"]),
                 "skipped_rounds": skipped})
    print(rows[-1], flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"rounds": args.rounds, "inner_steps": args.inner_steps, "replicas": 5,
               "poisoned_replica": BAD, "rows": rows, "smoke": args.smoke,
               **harness.provenance("poison")}, f, indent=2)
  print(f"\nK = 5, replica {BAD} poisoned, {args.rounds} rounds x H = {args.inner_steps} "
        f"(configs/tiny.py{', smoke sizes' if args.smoke else ''})\n"
        f"| attack | {' | '.join(AGGREGATIONS)} |\n|---|---|---|---|")
  for attack in ATTACKS:
    cells = []
    for aggregation in AGGREGATIONS:
      r = next((r for r in rows if (r["attack"], r["aggregation"]) == (attack, aggregation)),
               None)
      cells.append("-" if r is None else f"{r['final_eval_loss']:.4f}" + (
          f" ({r['skipped_rounds']} skipped)" if r["skipped_rounds"] else ""))
    if any(cell != "-" for cell in cells):
      print(f"| {attack} | {' | '.join(cells)} |")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
