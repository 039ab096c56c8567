"""How fast a preempted run is back to training: resumed with and without the compilation cache.

  python -m bench.restart [--config=peer] [--repeats=3]
  python -m bench.restart --smoke  # seconds: configs/tiny.py's model shrunk, 1 repeat

A user's restart, timed (`python -m diloco_jax.train`, one host, as the README's first
command runs it; configs/peer.py's 3.3M-param GPT on the standard library's bytes, or
--config=tiny):
  1. a fresh run of 2 rounds is preempted (SIGTERM as soon as it has compiled its inner
     step, i.e. once run.json is written): it trains round 1, writes a checkpoint, exits;
  2. that workdir is saved, and run again with the same command, which resumes at round
     2 and finishes: once with the compilation cache the first run filled (the default,
     workdir/compilation_cache) and once with `--compilation_cache=none`. The two take
     turns, --repeats times, each on the saved workdir put back in its place.
Per run: start-to-first-step, from starting the process to the inner step being ready
(run.json is written right after it is compiled or read from the cache, before the first
round), the whole resumed run (start to exit: restore, round 2 with the outer step's and
the eval's compiles, the final checkpoint), and how many programs a resume with the
cache still compiled (new files in the cache). Medians over the repeats; writes
bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness
from bench import peer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE_FLAGS = ["--config.inner_steps=2", "--config.model.num_layers=1",
               "--config.model.d_model=32", "--config.model.mlp_dim=64",
               "--config.model.num_heads=2", "--config.inner.warmup_steps=1"]


def flags(args) -> list[str]:
  if args.config == "peer":
    data = peer.stdlib_dir()
    atexit.register(shutil.rmtree, data, ignore_errors=True)
    config = ["--config=configs/peer.py", f"--config.data.path={data}"]
  else:
    config = ["--config=configs/tiny.py"]
  return [*config, "--config.num_rounds=2", "--config.checkpoint.every=0",
          *(SMOKE_FLAGS if args.smoke else [])]


def train(workdir: str, train_flags: list[str], extra: tuple[str, ...] = (),
          preempt: bool = False) -> dict:
  """One trainer process from start to exit: its start-to-first-step and wall time.
  `preempt`: SIGTERM once run.json is written (the trainer's preemption: it finishes
  the round, writes a checkpoint and exits 0)."""
  run_json = os.path.join(workdir, "run.json")
  if os.path.exists(run_json):
    os.remove(run_json)  # a resume writes its own
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # it would win over --compilation_cache
  cmd = [sys.executable, "-m", "diloco_jax.train", f"--workdir={workdir}", *train_flags,
         *extra]
  with tempfile.TemporaryFile("w+") as log:
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    first_step = None
    while proc.poll() is None:
      if first_step is None and os.path.exists(run_json):
        first_step = os.path.getmtime(run_json) - t0
        if preempt:
          proc.send_signal(signal.SIGTERM)
      time.sleep(0.01)
    wall = time.time() - t0
    log.seek(0)
    output = log.read()
  if proc.returncode != 0 or first_step is None:
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
  if preempt and "preempted" not in output:
    raise RuntimeError(f"the run was not preempted after round 1:\n{output[-3000:]}")
  if not preempt and "resumed from checkpoint" not in output:
    raise RuntimeError(f"the run did not resume:\n{output[-3000:]}")
  return {"start_to_first_step_s": first_step, "wall_s": wall}


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", choices=("peer", "tiny"), default="peer",
                      help="configs/peer.py on the standard library's bytes, or configs/tiny.py")
  parser.add_argument("--repeats", type=int, default=3, help="resumes of each kind")
  args = harness.parse_args(parser, "restart", dict(config="tiny", repeats=1))
  train_flags = flags(args)
  root = tempfile.mkdtemp(prefix="bench_restart_")
  try:
    workdir, saved = os.path.join(root, "run"), os.path.join(root, "preempted")
    fresh = train(workdir, train_flags, preempt=True)
    cache = os.path.join(workdir, "compilation_cache")
    cached = set(os.listdir(cache))
    if not cached:
      raise RuntimeError(f"the first run left nothing in {cache}")
    shutil.copytree(workdir, saved)
    print(f"fresh run: start to first step {fresh['start_to_first_step_s']:.2f} s "
          f"(compiling), preempted after round 1", flush=True)
    runs = {"cache": [], "no_cache": []}
    for i in range(args.repeats):
      for kind in runs:
        # The preempted workdir again, at its own path: the cache's keys name the cache's
        # directory (XLA's own caches live under it), so a copy elsewhere would miss.
        shutil.rmtree(workdir)
        shutil.copytree(saved, workdir)
        extra = ("--compilation_cache=none",) if kind == "no_cache" else ()
        if extra:
          shutil.rmtree(cache)
        runs[kind].append(train(workdir, train_flags, extra))
        if not extra:  # what the resumed run did not find in the cache
          runs[kind][-1]["compiled_anew"] = len(set(os.listdir(cache)) - cached)
        print(f"resume {i + 1}/{args.repeats} {kind}: start to first step "
              f"{runs[kind][-1]['start_to_first_step_s']:.2f} s, whole run "
              f"{runs[kind][-1]['wall_s']:.2f} s", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  median = {kind: {key: statistics.median(r[key] for r in rs)
                   for key in ("start_to_first_step_s", "wall_s")} for kind, rs in runs.items()}
  result = {"config": args.config, "repeats": args.repeats, "smoke": args.smoke,
            "fresh": fresh, "median": median, "runs": runs, **harness.provenance("restart")}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n| resumed run (median of {args.repeats}) | start to first step (s) | "
        f"whole run (s) |\n|---|---|---|")
  for kind, label in (("no_cache", "without the cache (`--compilation_cache=none`)"),
                      ("cache", "with the cache (default)")):
    print(f"| {label} | {median[kind]['start_to_first_step_s']:.2f} | "
          f"{median[kind]['wall_s']:.2f} |")
  print(f"(a fresh run's start to first step: {fresh['start_to_first_step_s']:.2f} s; "
        f"programs the resumed runs compiled anew despite the cache: "
        f"{max(r['compiled_anew'] for r in runs['cache'])})")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
