"""What one sync outer step costs across hosts on localhost, part by part.

  python -m bench.outer_step [--hosts=2,4] [--models=tiny,25m] [--rounds=6] [--out=...]
  python -m bench.outer_step --smoke  # seconds: tiny (one block) on 2 hosts, 2 rounds

For each model and number of hosts, runs the real trainer with `launch/local.py` (one
replica per host, one CPU device each, H=2 so the run is mostly outer steps) and reads
host 0's metrics.jsonl: the median over rounds 2..R of the device→host copy, the mean
(Δ, this host's sum, the cross-host sum over gloo/TCP and the division by K), the outer
optimizer update, the host→device copy, and the bytes this host sent per round (ring
all-reduce: 2(n−1)/n of the payload), and the check that the outer state is the same on
every host (hash + the coordination store; run every round here), also as a share of a
round of H=50 inner steps at the default anchor_check_every=10 (from the measured inner
step, outer step and check times). Prints a table, writes bench/results/outer_step.json
(--smoke: --out, or a file in a temporary directory).
On one machine the "network" is loopback: this measures the software path, not a WAN
(bench/wan.py shapes bandwidth for that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    # configs/tiny.py's model.
    "tiny": [],
    # ≈25M params: 8 blocks of width 512 (12·512²·8 = 25.2M in the blocks).
    "25m": ["--config.model.num_layers=8", "--config.model.d_model=512",
            "--config.model.num_heads=8", "--config.model.mlp_dim=2048",
            "--config.batch_size=2", "--config.eval_batches=1"],
}
PARTS = ("outer_d2h", "outer_mean", "outer_update", "outer_h2d", "outer_time",
         "anchor_hash_time", "anchor_check_time")
INNER_STEPS = 2  # per round here: the run is mostly outer steps
H, CHECK_EVERY = 50, 10  # a round and the check's period the share is reported for
# --smoke: after the model's flags, fewer sequences per step and for the eval, one block.
SMOKE_FLAGS = ["--config.batch_size=2", "--config.eval_batches=1", "--config.model.num_layers=1"]


def run(model: str, hosts: int, rounds: int, extra: tuple[str, ...] = ()) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), f"--hosts={hosts}", "--",
           "--config=configs/tiny.py", f"--workdir={workdir}", "--config.replicas_per_host=1",
           f"--config.num_rounds={rounds}", f"--config.inner_steps={INNER_STEPS}",
           "--config.anchor_check_every=1",
           # No saves but the last: a save's commit runs on the dispatch thread, and with
           # rounds this short it would delay the next round's sum (measured: 10 -> 500 ms).
           "--config.checkpoint.every=0",
           "--config.inner.warmup_steps=1", f"--config.eval_every={10 ** 6}", *MODELS[model],
           *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
      raise RuntimeError(f"{model} on {hosts} hosts failed:\n{proc.stdout[-3000:]}")
    with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f][1:]  # round 1 compiles
  params = next(line for line in proc.stdout.splitlines() if "M params" in line)
  row = {"model": model, "hosts": hosts,
         "params_millions": float(params.split(": ")[1].split("M params")[0]),
         "bytes_sent_per_round": statistics.median(r["bytes_sent"] for r in records)}
  row.update({part: statistics.median(r.get(part, 0.0) for r in records) for part in PARTS})
  step = statistics.median((r["round_time"] - r["outer_time"] - r.get("anchor_check_time", 0))
                           / INNER_STEPS for r in records)
  row["inner_step_time"] = step
  row["check_share_of_round"] = row["anchor_check_time"] / (
      CHECK_EVERY * (H * step + row["outer_time"]))
  return row


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", default="2,4", help="numbers of hosts, comma-separated")
  parser.add_argument("--models", default="tiny,25m", help=f"from {', '.join(MODELS)}")
  parser.add_argument("--rounds", type=int, default=6, help="rounds, the first untimed")
  args = harness.parse_args(parser, "outer_step", dict(hosts="2", models="tiny", rounds=2))
  rows = []
  for model in args.models.split(","):
    for hosts in map(int, args.hosts.split(",")):
      rows.append(run(model, hosts, args.rounds, tuple(SMOKE_FLAGS) if args.smoke else ()))
      print(f"done: {model} on {hosts} hosts", flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"rows": rows, "rounds_timed": args.rounds - 1, "smoke": args.smoke,
               **harness.provenance("outer_step")}, f, indent=2)
  print("\n| model | params | hosts | d2h ms | mean ms | update ms | h2d ms | outer ms "
        f"| hash ms | check ms | check, % of a round (H={H}, every {CHECK_EVERY}) "
        "| MB sent/host/round |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['model']} | {r['params_millions']:.2f}M | {r['hosts']} | "
          + " | ".join(f"{1e3 * r[p]:.1f}" for p in PARTS)
          + f" | {100 * r['check_share_of_round']:.3f} | {r['bytes_sent_per_round'] / 1e6:.2f} |")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
