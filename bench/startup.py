"""Where a cold start's seconds go: from a new process to the trainer's first round.

  python -m bench.startup [--reps=3]
  python -m bench.startup --smoke   # 1 rep on a one-block width-32 model

Each phase is a process of its own, timed from its start (median of --reps):

  interpreter    `python -c pass`
  imports        `import jax, flax.linen, optax, orbax.checkpoint, grain, ml_collections`,
                 less the interpreter
  jax start      the same and `jax.devices()` (the CPU backend), less the imports
  trainer        `python -m diloco_jax.train` on configs/tiny.py, 1 host, 1 round: the
                 seconds to its start-up line (`host 0/1: ...`, after the data, the model's
                 init and its compiled inner step), to round 1's line (the round's steps,
                 the outer step's and the eval's first compiles) and to its exit;
                 fresh (an empty compilation cache) and cached (the same cache again, the
                 way a host that restarts with its workdir finds it), each with a workdir of
                 its own (no checkpoint to resume);
  re-exec        cached again with GLIBC_TUNABLES=glibc.malloc.hugetlb=0, which skips the
                 trainer's re-exec of the interpreter for huge pages: the difference is what
                 that re-exec costs.

How long a host that restarts takes until it trains with the others is bench/churn.py's
"whole again". Writes bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORTS = "import jax, flax.linen, optax, orbax.checkpoint, grain, ml_collections"
SMOKE_FLAGS = ["--config.model.num_layers=1", "--config.model.d_model=32",
               "--config.model.mlp_dim=64", "--config.model.num_heads=2"]
MARKS = {"startup_line": "host 0/1:", "round_line": "round 1/"}


def timed(cmd: list[str]) -> float:
  t = time.monotonic()
  subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
  return time.monotonic() - t


def trainer(workdir: str, cache: str, flags: list[str], env: dict[str, str]) -> dict:
  """One trainer run (`env` added to this process's environment, less any compilation
  cache it names): seconds from its start to each of MARKS's lines and to its exit."""
  cmd = [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", f"--compilation_cache={cache}", "--config.num_rounds=1",
         "--config.inner.warmup_steps=0", *flags]
  base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  t = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**base, "JAX_PLATFORMS": "cpu", **env})
  seen, lines = {}, []
  for line in proc.stdout:
    lines.append(line)
    for key, mark in MARKS.items():
      if mark in line and key not in seen:
        seen[key] = time.monotonic() - t
  if proc.wait() != 0 or len(seen) < len(MARKS):
    raise RuntimeError("the trainer failed or printed no start-up or round line:\n"
                       + "".join(lines[-30:]))
  return {**seen, "exit": time.monotonic() - t}


def one_rep(root: str, flags: list[str]) -> dict:
  """Every phase once."""
  py = sys.executable
  rep = {"interpreter": timed([py, "-c", "pass"]),
         "imports": timed([py, "-c", IMPORTS]),
         "jax_devices": timed([py, "-c", IMPORTS + "; jax.devices()"])}
  cache = tempfile.mkdtemp(dir=root, prefix="cache_")
  runs = {"fresh": {}, "cached": {},
          "cached_no_reexec": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}}
  for name, env in runs.items():
    rep[name] = trainer(tempfile.mkdtemp(dir=root, prefix=f"{name}_"), cache, flags, env)
  return rep


def phases(reps: list[dict]) -> dict:
  """The medians, and each phase as the difference of the runs that tell it apart."""
  def med(f):
    return statistics.median(f(r) for r in reps)
  out = {"interpreter": med(lambda r: r["interpreter"]),
         "imports": med(lambda r: r["imports"] - r["interpreter"]),
         "jax_start": med(lambda r: r["jax_devices"] - r["imports"]),
         "reexec": med(lambda r: r["cached"]["exit"] - r["cached_no_reexec"]["exit"])}
  for run in ("fresh", "cached", "cached_no_reexec"):
    for key in (*MARKS, "exit"):
      out[f"{run}_{key}"] = med(lambda r, run=run, key=key: r[run][key])
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reps", type=int, default=3, help="repetitions of every phase")
  args = harness.parse_args(parser, "startup", dict(reps=1), argv)
  if args.reps < 1:
    parser.error(f"--reps={args.reps}: must be >= 1")
  flags = SMOKE_FLAGS if args.smoke else []
  root = tempfile.mkdtemp(prefix="bench_startup_")
  try:
    reps = []
    for i in range(args.reps):
      reps.append(one_rep(root, flags))
      print(f"rep {i + 1}/{args.reps}: fresh {reps[-1]['fresh']['exit']:.1f} s, cached "
            f"{reps[-1]['cached']['exit']:.1f} s", flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  result = {"smoke": args.smoke, "reps": reps, "phases": phases(reps),
            "config": {"config": "configs/tiny.py", "hosts": 1, "rounds": 1,
                       "flags": flags}, "cpu_count": os.cpu_count()}
  result.update(harness.provenance("startup", argv))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  p = result["phases"]
  print(f"interpreter {p['interpreter']:.2f} s, imports {p['imports']:.2f} s, jax start "
        f"{p['jax_start']:.2f} s; trainer to round 1: fresh {p['fresh_round_line']:.2f} s, "
        f"cached {p['cached_round_line']:.2f} s; huge-page re-exec {p['reexec']:.2f} s")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
