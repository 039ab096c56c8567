"""What every bench shares, and the tests with them (not a bench itself).

Benches run from the repository's root as modules, `python -m bench.NAME` (bench/ is a
package: the root is on the path with -m, so no bench patches sys.path); bench/gpu_check.py
also runs by its path, in an install of the package alone, and imports this module either way.

Flags: `--smoke` runs the bench's own code end to end on tiny sizes, in seconds: the sizes
come from `smoke_defaults`, which replace the flags' defaults (a flag given on the command
line still wins). A smoke run writes its JSON to `--out`, by default into a new temporary
directory, and never into bench/results/, and compiles each program once across its
trainers and processes (a JAX compilation cache: see `compilation_cache`).
tests/test_bench_*.py run every bench this way.

Results files: `provenance` is what every one says about where it came from (the command,
the date, the machine), which bench/report.py prints on docs/performance.md. The machine is
described by its cores and CPU model unless DILOCO_BENCH_MACHINE names it in words (e.g.
"2-core CPU development machine (shared)").

Ports and processes: free localhost ports, the children of a process, whether one is alive,
the wait for one to die, and a host's trainer below a launcher, read from /proc. The tests
that start hosts use these too (tests/multihost.py): a bench runs without the suite, and
this module imports neither jax nor diloco_jax (bench/hosts.py's hosts must not).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import tempfile
import time

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


def provenance(script: str, argv: list[str] | None = None,
               accelerator: str | None = None) -> dict:
  """`command`, `date` and `machine` for a results file: bench/report.py refuses a file
  without them, so the page never shows a figure it cannot say the origin of. `script` is
  the bench's name (bench/NAME.py), `argv` its arguments (default: this process's)."""
  argv = sys.argv[1:] if argv is None else argv
  return {"command": shlex.join(["python", *invocation(script), *argv]),
          "date": datetime.date.today().isoformat(), "machine": machine(accelerator)}


def invocation(script: str) -> list[str]:
  """How bench `script` was started: `-m bench.NAME`, or its path where this process runs
  it as a script (bench/gpu_check.py, in an install without the repository on the path)."""
  main = sys.modules.get("__main__")
  if main is not None and getattr(main, "__spec__", None) is None and os.path.basename(
      getattr(main, "__file__", "")) == f"{script}.py":
    return [f"bench/{script}.py"]
  return ["-m", f"bench.{script}"]


def host_dir(workdir, host: int = 0):
  """Where host `host` of a job of several hosts keeps its records and checkpoints when
  they share `workdir` (WORKDIR/host<i>); `workdir` itself for one host (or a ddp job)."""
  path = os.path.join(workdir, f"host{host}")
  return type(workdir)(path) if os.path.isdir(path) else workdir


def write(path: str, result: dict, indent: int = 1) -> None:
  """Writes a bench's results file (JSON) at `path`, making its directory."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=indent)


def machine(accelerator: str | None = None) -> str:
  """This machine in a line: DILOCO_BENCH_MACHINE or its cores and CPU model, then the
  accelerator the bench ran on (if any) and jax's version. The version is read from the
  package's metadata: a bench that runs its work in child processes never imports jax."""
  where = (os.environ.get("DILOCO_BENCH_MACHINE")
           or f"{os.cpu_count()}-core CPU ({cpu_model()})")
  try:
    jax = f"jax {importlib.metadata.version('jax')}"
  except importlib.metadata.PackageNotFoundError:
    jax = "jax not installed"
  return ", ".join([where, *([accelerator] if accelerator else []), jax])


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:  # not Linux
    pass
  return platform.machine() or "unknown"


def free_ports(n: int) -> list[int]:
  """`n` distinct localhost ports that were free a moment ago (all bound at once, so no two
  are the same; another process may still take one before its user binds it)."""
  socks = [socket.socket() for _ in range(n)]
  try:
    for s in socks:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def free_port() -> int:
  return free_ports(1)[0]


def stat(pid: int | str) -> list[str] | None:
  """The fields of /proc/PID/stat after the command's name (state, ppid, ...); None if gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None


def children(pid: int) -> list[int]:
  """PIDs of the live processes whose parent is `pid`."""
  return [int(e) for e in os.listdir("/proc")
          if e.isdigit() and (fields := stat(e)) and int(fields[1]) == pid]


def alive(pid: int) -> bool:
  """Whether process `pid` still runs (not gone, not a zombie whose files are closed)."""
  fields = stat(pid)
  return fields is not None and fields[0] != "Z"


def wait_dead(pid: int, timeout: float = 30.0) -> None:
  """Until process `pid` is gone or a zombie (its files are no longer written)."""
  deadline = time.monotonic() + timeout
  while alive(pid) and time.monotonic() < deadline:
    time.sleep(0.05)


def trainer(pid: int | str) -> tuple[int, list[str]] | None:
  """(host id, command line) of process `pid` if it is a trainer started with --host_id
  (as launch/local.py starts each host), else None (gone, or another process)."""
  try:
    with open(f"/proc/{pid}/cmdline") as f:
      cmd = f.read().split("\0")
  except OSError:
    return None
  if "diloco_jax.train" not in cmd:
    return None
  host = next((a.split("=", 1)[1] for a in cmd if a.startswith("--host_id=")), "")
  return (int(host), cmd) if host.isdigit() else None


def host_pids(launcher: int) -> dict[int, int]:
  """Host id -> pid of the trainers that process `launcher` has started so far."""
  return {found[0]: pid for pid in children(launcher) if (found := trainer(pid))}


def host_pid(root: int, host: int) -> int | None:
  """The trainer process of `host` below process `root` (a launcher), or None."""
  for pid in os.listdir("/proc"):
    if pid.isdigit() and (found := trainer(pid)) and found[0] == host and descends(
        int(pid), root):
      return int(pid)
  return None


def descends(pid: int, ancestor: int) -> bool:
  """Whether `ancestor` is `pid` or one of its parents, grandparents, ..."""
  while pid > 1:
    if pid == ancestor:
      return True
    fields = stat(pid)
    if fields is None:
      return False
    pid = int(fields[1])
  return False
