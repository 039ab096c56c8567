"""What every bench shares: the `--smoke` and `--out` flags (not a bench itself).

`--smoke` runs the bench's own code end to end on tiny sizes, in seconds: the sizes come
from `smoke_defaults`, which replace the flags' defaults (a flag given on the command line
still wins). A smoke run writes its JSON to `--out`, by default into a new temporary
directory, and never into bench/results/, and compiles each program once across its
trainers and processes (a JAX compilation cache: see `compilation_cache`).
tests/test_bench.py runs every bench this way.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")


def parse_args(parser: argparse.ArgumentParser, name: str, smoke_defaults: dict,
               argv: list[str] | None = None) -> argparse.Namespace:
  """Adds --smoke and --out to `parser` and parses; `args.out` is always set on return."""
  parser.add_argument(
      "--smoke", action="store_true",
      help="a run of seconds through the same code on tiny sizes, for tests (defaults "
           + ", ".join(f"--{k}={v}" for k, v in smoke_defaults.items())
           + "); writes to --out or a temporary directory, never bench/results/")
  parser.add_argument("--out", default=None,
                      help=f"JSON output (default: bench/results/{name}.json; with --smoke, "
                           "a file in a new temporary directory)")
  first, _ = parser.parse_known_args(argv)
  if first.smoke:
    parser.set_defaults(**smoke_defaults)
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = (os.path.join(tempfile.mkdtemp(prefix=f"bench_{name}_smoke_"), f"{name}.json")
                if args.smoke else os.path.join(RESULTS, f"{name}.json"))
  elif args.smoke and os.path.realpath(args.out).startswith(os.path.realpath(RESULTS) + os.sep):
    parser.error("--smoke never writes into bench/results/: give another --out")
  if args.smoke:
    compilation_cache()
  return args


def compilation_cache() -> None:
  """JAX's persistent compilation cache for this process (if it has imported jax; before
  its first compile) and the processes it starts (through the environment): in
  JAX_COMPILATION_CACHE_DIR if set, else in a temporary directory removed at exit. Smoke
  runs are mostly compilation, often of the same programs in several trainers (poison.py's
  runs, overhead.py's loops, wan.py's modes): with the cache, each is compiled once."""
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    path = tempfile.mkdtemp(prefix="bench_jax_cache_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  jax = sys.modules.get("jax")
  if jax is not None:  # it read the environment when imported
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

