"""Every bench's command line: each bench/ script that is not a helper is a bench, with
`--help` and a smoke run in the suite; bench/gpu_check.py also runs by its path without the
repository on the path; and the benches' own helpers where a smoke run cannot reach them.
"""

import argparse
import fnmatch
import glob
import os
import re
import subprocess
import sys

import pytest

from tests import benches
from tests import test_bench_faults
from tests import test_bench_speed
from tests.benches import BENCHES
from tests.benches import HELPERS
from tests.benches import REPO
from tests.benches import run_bench


def test_every_bench_is_tested():
  scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "bench", "*.py"))}
  assert {s for s in scripts if not s.startswith("_")} - HELPERS == set(BENCHES)
  # and each one's smoke run is checked, in one file or the other
  assert set(test_bench_speed.CHECKS) | set(test_bench_faults.CHECKS) == set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_help(name):
  code, out = run_bench(name, "--help")
  assert code == 0, out[-5000:]
  assert "usage:" in out and "--smoke" in out and "--out" in out


def test_gpu_check_runs_by_its_path_in_an_install_of_the_package_alone():
  """docs/devices.md: `python bench/gpu_check.py` in a fresh venv of `pip install -e .`,
  where the repository's root is not on the path (an install puts diloco_jax there, not
  bench/); and `python -m bench.gpu_check` as every other bench runs."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  code, out = run_bench("gpu_check", "--help", env={**env, "JAX_PLATFORMS": "cpu"})
  assert code == 0 and "--smoke" in out, out[-5000:]
  done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--help"], cwd=REPO,
                        capture_output=True, text=True, timeout=benches.TIMEOUT_S)
  assert done.returncode == 0 and "--smoke" in done.stdout, done.stderr[-5000:]


def test_the_readme_lists_every_bench_and_results_file():
  """bench/README.md's table: a row per bench, every results file under one (`*` stands
  for several), and each page section it links an anchor of docs/performance.md."""
  with open(os.path.join(REPO, "bench", "README.md"), encoding="utf-8") as f:
    table = {cells[0][2:]: cells for line in f if line.startswith("| ")
             and len(cells := line.rstrip("\n").split(" | ")) == 5}
  assert set(BENCHES) <= set(table), sorted(set(BENCHES) - set(table))
  named = re.findall(r"`([\w*]+\.json)`", " ".join(row[3] for row in table.values()))
  files = [os.path.basename(p)
           for p in glob.glob(os.path.join(REPO, "bench", "results", "*.json"))]
  unlisted = [f for f in files if not any(fnmatch.fnmatch(f, n) for n in named)]
  assert not unlisted, unlisted
  with open(os.path.join(REPO, "docs", "performance.md"), encoding="utf-8") as f:
    slugs = {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", line.lstrip("#")).strip().lower())
             for line in f if line.startswith("#")}
  anchors = re.findall(r"performance\.md#([\w-]+)", " ".join(row[4] for row in table.values()))
  assert anchors and set(anchors) <= slugs, sorted(set(anchors) - slugs)


def test_peer_torch_model_gives_diloco_jax_logits():
  """bench/peer.py's check before it times anything, run for real (test_smoke's peer run
  has no torchft venv and skips it): diloco_jax's initial params at --smoke's shapes,
  loaded into bench/_peer_torch.py's torch model, give diloco_jax's logits up to float32
  rounding. The torch of the [hf] extra stands in for the venv: --check needs no torchft."""
  pytest.importorskip("torch", reason="torch comes with the [hf] extra")
  from bench import peer  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(config=peer.peer_config.get_config(), **peer.SMOKE)
  check = peer.check_same_model(args, sys.executable)  # raises past 1e-4
  # Measured 9e-8 on logits up to 0.5; a LayerNorm eps of 1e-6 against 1e-5 gives 3e-3.
  assert check["max_abs_logit_diff"] <= 1e-5 and check["max_abs_logit"] > 0.1, check


def test_hosts_beyond_the_cores_get_an_equal_cpu_quota_not_a_shared_core():
  """bench/cpushare.py: with hosts <= cores each is pinned to its own core; with more, each
  command runs in a cgroup of its own whose CFS quota is 0.9 x cores / hosts of a core
  (a process started so is in it, and the cgroups are gone afterwards)."""
  from bench import cpushare  # pylint: disable=import-outside-toplevel
  cores = len(os.sched_getaffinity(0))
  few = cpushare.Placement(cores, pin=True)
  assert few.command(cores - 1, ["x"])[:2] == ["taskset", "-c"] and not few.quota
  assert cpushare.Placement(cores + 1, pin=False).command(0, ["x"]) == ["x"]
  if os.geteuid() != 0 or not (os.path.isdir(cpushare.V1) or os.path.isfile(
      os.path.join(cpushare.V2, "cgroup.controllers"))):
    pytest.skip("a CPU quota needs root and the cgroup cpu controller")
  with cpushare.Placement(cores + 1, pin=True, tag="djtest") as many:
    assert many.share == pytest.approx(0.9 * cores / (cores + 1))
    done = subprocess.run(many.command(1, ["cat", "/proc/self/cgroup"]), capture_output=True,
                          text=True, check=True)
    assert many.groups[1] in done.stdout
    paths = [many._path(i) for i in range(cores + 1)]  # pylint: disable=protected-access
    quota = os.path.join(paths[1], "cpu.cfs_quota_us" if os.path.isdir(cpushare.V1)
                         else "cpu.max")
    with open(quota) as f:
      assert int(f.read().split()[0]) == int(many.share * cpushare.PERIOD_US)
  assert not any(os.path.exists(p) for p in paths)


def test_quality_variant_replaces_the_methods_own_flag():
  """bench/quality.py --variant=NAME=eager:--config.outer.momentum=0.5: the variant's
  momentum replaces eager's in place (the JSON's `overrides` lists each key once)."""
  from bench import quality
  assert quality.override(["--config.mode=eager", "--config.outer.momentum=0.3"],
                          ["--config.outer.momentum=0.5", "--config.outer.lr=1.0"]) == [
      "--config.mode=eager", "--config.outer.momentum=0.5", "--config.outer.lr=1.0"]
  assert quality.override([], ["--config.outer.lr=2.0"]) == ["--config.outer.lr=2.0"]
