"""How right the ETA on the progress line is: printed against the true time left.

  python -m bench.eta [--config=configs/tiny.py] [--preempt_after=12]
  python -m bench.eta --smoke  # seconds: 6 rounds of 5 steps, preempted after round 3

Runs the job twice from an empty workdir, as a user would (`python -m diloco_jax.train`):
once to the end, and once preempted (SIGTERM once round `preempt_after`'s line is out)
and run again, which resumes. For every round a process trains after its first (whose
compilation the ETA leaves out), the ETA in its record is compared with the time that
was actually left: from the end of that round (the record's `time`) to the moment the
final line (`final eval loss ...`) was printed. Reports, per run, the worst and the
median of |ETA / left − 1| over its rounds but the last (whose line, `ETA 0s`, comes with
the final line: its error is reported in seconds), and writes bench/results/eta.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE_FLAGS = ["--config.num_rounds=6", "--config.inner_steps=5",
               "--config.inner.warmup_steps=1"]


def train(workdir: str, args: argparse.Namespace, stop_after: int | None = None) -> dict:
  """One trainer process; returns when its output lines arrived, and when it printed its
  final line (None: preempted). `stop_after`: SIGTERM once that round's line is out."""
  cmd = [sys.executable, "-m", "diloco_jax.train", f"--config={args.config}",
         f"--workdir={workdir}", *(SMOKE_FLAGS if args.smoke else [])]
  env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines, end = [], None
  for line in proc.stdout:
    lines.append(line.rstrip("\n"))
    if line.startswith("final eval loss"):
      end = time.time()
    if stop_after is not None and line.startswith("round ") and \
        int(line.split()[1].split("/")[0]) == stop_after:
      proc.send_signal(signal.SIGTERM)  # the trainer's preemption: checkpoint, exit 0
      stop_after = None
  if proc.wait() != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(lines[-30:]))
  return {"end": end, "lines": lines}


def errors(records: list[dict], end: float) -> list[dict]:
  """Each record with an ETA, beside the time actually left after its round."""
  rows = []
  for r in records:
    if "eta" in r and "time" in r:
      left = end - r["time"]
      rows.append({"round": r["round"], "eta": r["eta"], "left": left,
                   "error": r["eta"] / left - 1 if left > 0 else float("nan")})
  return rows


def summary(name: str, rows: list[dict]) -> dict:
  """The errors of every round but the last, whose line (ETA 0s) comes with the final
  line: a fraction of nothing left says nothing; its error in seconds is reported."""
  errs = [abs(r["error"]) for r in rows[:-1]] or [float("nan")]
  return {"run": name, "rounds": [r["round"] for r in rows], "rows": rows,
          "max_abs_error": max(errs), "median_abs_error": statistics.median(errs),
          "last_round_error_s": rows[-1]["eta"] - rows[-1]["left"]}


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--preempt_after", type=int, default=12,
                      help="the round after whose line the second run is preempted")
  args = harness.parse_args(parser, "eta", dict(preempt_after=3))
  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    fresh = os.path.join(tmp, "fresh")
    done = train(fresh, args)
    records = [json.loads(line) for line in open(os.path.join(fresh, "metrics.jsonl"))]
    runs.append(summary("fresh", errors(records, done["end"])))

    resumed = os.path.join(tmp, "resumed")
    train(resumed, args, stop_after=args.preempt_after)
    before = {json.loads(line)["round"] for line in open(os.path.join(resumed, "metrics.jsonl"))}
    done = train(resumed, args)
    records = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    later = [r for r in records if r["round"] > max(before)]  # the resumed process's rounds
    runs.append(summary(f"resumed after round {max(before)}", errors(later, done["end"])))

  result = {"config": args.config, "smoke": args.smoke, "runs": runs,
            "cpu_count": os.cpu_count(), **harness.provenance("eta")}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print("| run | rounds | worst |ETA/left - 1| | median | last round's ETA - left |\n"
        "|---|---|---|---|---|")
  for run in runs:
    judged = run["rounds"][:-1] or run["rounds"]
    print(f"| {run['run']} | {judged[0]}-{judged[-1]} | "
          f"{100 * run['max_abs_error']:.1f}% | {100 * run['median_abs_error']:.1f}% | "
          f"{run['last_round_error_s']:+.2f} s |")
  for run in runs:
    print(f"\n{run['run']}: round, ETA s, left s, error")
    print("  " + "; ".join(f"{r['round']}: {r['eta']:.1f}/{r['left']:.1f} {100 * r['error']:+.0f}%"
                           for r in run["rows"]))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
