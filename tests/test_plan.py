"""The planner: its bytes per host are the wire code's own count for every format, its
round times follow the formula of planning/model.py, its constants are those bench/plan.py
fitted, and the command prints its table, sweeps, and refuses bad input in one line."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from diloco_jax.algo import compress
from diloco_jax.planning import calibration
from diloco_jax.planning import model
from diloco_jax.wire import collective

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = model.Constants(round_overhead_s=0.3, overhead_s=0.05, link_efficiency=0.9,
                    codec_s_per_entry=1e-8, async_overhead_s=0.1, outer_s_per_param=7e-9)


def _sent(fmt: str, n: int, r: int, size: int, **options) -> int:
  """What collective.reduce_encoded counts for one host of `n`, `r` rows of `size`
  entries: the collectives are stand-ins that return every host's copy of this one's."""
  rows = np.random.default_rng(0).standard_normal((r, size)).astype(np.float32)
  _, sent, _ = collective.reduce_encoded(
      rows, fmt, collective.sum_rows, num_hosts=n,
      all_to_all=lambda v: v, allgather=lambda v: np.stack([v] * n), **options)
  return sent


@pytest.mark.parametrize("n,r", [(2, 1), (3, 2), (5, 1)])
def test_bytes_per_host_are_the_wires_count(n, r):
  size = n * 16 * 4096  # whole blocks and chunks in every host's share
  options = dict(topk_fraction=0.02, topk_chunk=4096, topk_value_bits=2)
  for fmt in compress.FORMATS[1:]:
    s = model.Setting(num_params=size, hosts=n, step_time=(0.1,), up_mbit=10, down_mbit=10,
                      compression=fmt, replicas_per_host=r, **options)
    extra = ({"topk_fraction": 0.02, "topk_chunk": 4096, "value_bits": 2}
             if fmt == "chunk_topk" else {"topk_fraction": 0.02} if fmt == "topk" else {})
    assert model.bytes_per_host(s) == pytest.approx(_sent(fmt, n, r, size, **extra),
                                                    rel=1e-9), fmt
  none = model.Setting(num_params=size, hosts=n, step_time=(0.1,), up_mbit=10, down_mbit=10)
  assert model.bytes_per_host(none) == 2 * (n - 1) / n * 4 * size  # a ring all-reduce


def test_round_times_follow_the_formula():
  base = model.Setting(num_params=10**6, hosts=4, step_time=(0.02,), up_mbit=80,
                       down_mbit=100, rtt_ms=10, inner_steps=50, num_rounds=10)
  w = 2 * 3 / 4 * 4e6
  sync_s = C.overhead_s + w / (0.9 * 10e6) + 3 * 0.01 + C.outer_s_per_param * 1e6
  p = model.predict(base, C)
  assert p.round_s == pytest.approx(1.0 + 0.3 + sync_s)
  assert p.utilization == pytest.approx(1.3 / p.round_s) and p.wall_s == 10 * p.round_s
  eager = model.predict(dataclasses.replace(base, mode="eager"), C)
  hidden = w / (0.9 * 10e6) + 3 * 0.01  # less than the inner phase: all hidden
  after = 0.3 + C.overhead_s + C.async_overhead_s + C.outer_s_per_param * 1e6
  assert hidden < 1.0 and eager.round_s == pytest.approx(1.0 + after)
  slow = dataclasses.replace(base, mode="eager", up_mbit=1, down_mbit=1)
  assert model.predict(slow, C).round_s == pytest.approx(after + w / (0.9 * 125e3) + 0.03)
  streaming = dataclasses.replace(base, mode="streaming", fragments=2, overlap_steps=5)
  part = C.overhead_s + w / 2 / (0.9 * 10e6) + 0.03 + C.outer_s_per_param * 5e5
  assert model.predict(streaming, C).round_s == pytest.approx(
      1.3 + 2 * max(0.0, part - 5 * 0.02))
  # unequal speeds: 'fixed' waits for the slowest host, 'speed' gives the fast more steps
  mixed = dataclasses.replace(base, hosts=2, step_time=(0.01, 0.03))
  assert model.host_steps(mixed) == (50, 50)
  assert model.host_steps(dataclasses.replace(mixed, balance="speed")) == (150, 50)
  fixed = model.predict(mixed, C)
  speed = model.predict(dataclasses.replace(mixed, balance="speed"), C)
  assert fixed.compute_s == speed.compute_s == 1.5 and speed.utilization > fixed.utilization


def test_constants_are_the_fit_in_bench_results():
  with open(os.path.join(REPO, "bench", "results", "plan_fit.json")) as f:
    fitted = json.load(f)["constants"]
  assert dataclasses.asdict(calibration.CONSTANTS) == fitted


def _plan(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "diloco_jax.plan", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


def test_command_table_sweep_and_bad_input(tmp_path):
  assert _plan("--help").returncode == 0
  smoke = _plan("--smoke")  # what the docs' smoke of a sweep runs: a table, a plot, JSON
  assert smoke.returncode == 0 and "recommended for 4 hosts" in smoke.stdout, smoke.stderr
  result = _plan("--config=configs/tiny.py", "--step_time=0.06", "--bandwidth_mbit=8")
  assert result.returncode == 0, result.stderr
  assert "| 2 hosts, sync, H=25, none |" in result.stdout and "| 0.425 |" in result.stdout
  out = tmp_path / "plan.json"
  result = _plan("--config=configs/tiny.py", "--step_time=0.06", "--bandwidth_mbit=8",
                 "--hosts=2,16", "--sweep", "--sweep_inner_steps=25,400",
                 "--sweep_formats=none,2bit", "--sweep_modes=sync,eager", f"--json={out}",
                 f"--png={tmp_path / 'plan.png'}")
  assert result.returncode == 0, result.stderr
  plan = json.loads(out.read_text())
  assert len(plan["rows"]) == 2 * 2 * 2 * 2 and (tmp_path / "plan.png").stat().st_size
  for hosts, choice in plan["recommendation"].items():
    assert f"recommended for {hosts} hosts at 90% utilization" in result.stdout
    utilizations = [r["prediction"]["utilization"] for r in plan["rows"]
                    if r["setting"]["hosts"] == int(hosts)]
    if choice["reaches"]:
      assert choice["prediction"]["utilization"] >= 0.9
    else:  # the closest
      assert choice["prediction"]["utilization"] == max(utilizations) < 0.9
  for args, message in [
      (["--bandwidth_mbit=-5"], "bandwidth -5/-5 Mbit/s: must be > 0"),
      (["--bandwidth_mbit=8", "--config.inner_steps=0"], "inner_steps (H) = 0: must be >= 1"),
      (["--bandwidth_mbit=8", "--config.mode=ddp", "--config.outer.compression=4bit"],
       "compression = '4bit': mode 'ddp' sums float32 gradients"),
      (["--bandwidth_mbit=8", "--step_time=0.1,0.2,0.3"],
       "step_time: 3 values for 2 hosts (give 1 or 2)"),
      ([], "the link: give --bandwidth_mbit (or --up_mbit and --down_mbit)")]:
    result = _plan("--config=configs/tiny.py", "--step_time=0.06", *args)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [message], (
        args, result.stderr)
