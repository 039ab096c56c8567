"""Helpers for the tests that run the benches (tests/test_bench_*.py): each bench's command
line, a run of it with a deadline, and a `--smoke` run's common checks.

A smoke run is the bench's own code (the trainer, the launcher, the JSON and the table) on
tiny sizes, in seconds; it must exit 0, write the JSON keys a full run writes (to the
--out given here) and leave bench/results/ alone. When a change to the trainer breaks a
bench, these tests say so.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = ("chaos", "churn", "checkpoint", "data", "eta", "gpu_check", "hosts", "inner_step",
           "leave", "linkdrop", "memory", "models",
           "outer_step", "overhead", "peer", "peer_wan", "plan", "poison", "quality", "restart",
           "sizes", "startup", "stragglers", "wan", "wire")
HELPERS = {"cpushare", "harness", "jobs", "netns", "report"}  # bench/ modules that are not
# benches (as _*.py): the benches' helpers, and report.py, which renders their results as
# docs/performance.md
MULTIHOST = {"chaos", "sizes", "churn", "gpu_check", "hosts", "leave",
             "linkdrop", "outer_step", "peer", "peer_wan", "quality", "stragglers",
             "wan", "wire"}
TIMEOUT_S = 300  # a smoke run takes seconds to tens of seconds on 2 busy CPU cores


def invocation(name: str) -> list[str]:
  """A bench's command after `python`: `-m bench.NAME` from the repository's root, but
  bench/gpu_check.py by its path, as docs/devices.md runs it in an install of the package."""
  return ["bench/gpu_check.py"] if name == "gpu_check" else ["-m", f"bench.{name}"]


def smoke_params(names) -> list:
  """`names` as test parameters, those that start host processes marked multihost."""
  return [pytest.param(n, marks=pytest.mark.multihost) if n in MULTIHOST else n
          for n in names]


def has(d: dict, keys: set) -> None:
  assert keys <= set(d), f"missing {sorted(keys - set(d))}"


def run_bench(name: str, *flags: str, env: dict | None = None) -> tuple[int, str]:
  """Runs bench NAME in its own process group, all of which a timeout kills."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env
  proc = subprocess.Popen([sys.executable, *invocation(name), *flags],
                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"bench/{name}.py {' '.join(flags)}: no exit in {TIMEOUT_S} s:\n{out[-5000:]}")
  return proc.returncode, out


def results_digest() -> dict[str, str]:
  return {path: hashlib.sha256(open(path, "rb").read()).hexdigest()
          for path in sorted(glob.glob(os.path.join(REPO, "bench", "results", "*")))}


def smoke(name: str, tmp_path) -> tuple[dict, str]:
  """Runs bench NAME with --smoke; (its results file's JSON, the file's path), once the run
  exited 0 and the file says it is a smoke run and where it came from."""
  out = str(tmp_path / "x.json")
  # peer: diloco_jax's side only, whatever this machine has installed (torchft needs torch).
  extra = [f"--venv={tmp_path / 'no_venv'}"] if name in ("peer", "peer_wan") else []
  if name == "wan":  # NAME@base: a checkout's trainer (here this one's) beside this one
    extra = [f"--baseline={REPO}", "--modes=none,sync,sync-live-mac,sync@base"]
  code, log = run_bench(name, "--smoke", f"--out={out}", *extra)
  assert code == 0, log[-5000:]
  with open(out) as f:
    result = json.load(f)
  assert result["smoke"] is True
  # Where the figures came from, which bench/report.py prints beside them.
  has(result, {"command", "date", "machine"})
  assert result["command"].startswith(
      " ".join(["python", *invocation(name), "--smoke", "--out="]))
  return result, out
