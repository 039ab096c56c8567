"""Calibrates and validates diloco_jax.plan on runs measured in network namespaces.

  sudo python -m bench.plan --measure   # the runs (bench/wan.py, ~45 min), then the fit
  python -m bench.plan                  # the fit and validation from the measured files
  python -m bench.plan --smoke          # the fit on the committed files, into a temp dir

The measured runs are bench/wan.py's (configs/tiny.py's model and data, one replica per
host, `tc tbf`-shaped veths, each host pinned to a core, or with 3 hosts an equal CPU
quota), in GRID: 7 settings of hosts
and bandwidth, each with the compute-only reference `none` measured before and after
several modes, formats and H, written to
bench/results/plan_wan_h<hosts>_<rate>.json. The first two settings calibrate the
planner's constants (planning/model.py's `Constants`): least squares of the sync runs'
extra time over the reference (overhead, 1 / link efficiency, codec time per entry), then
the async modes' own time per round, from the eager runs. The other five are held out: their
round time and compute utilization are predicted from the constants and their own
reference's step time, and compared with what was measured (within 15% is the aim).
The outer step's host time per param comes from bench/results/outer_step.json (25M-param
model, 2 hosts). Writes bench/results/plan_fit.json: the constants (which
diloco_jax/planning/calibration.py must equal), every run's prediction and error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import subprocess
import sys

import numpy as np

from bench import harness
from bench import wan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROUNDS = 16
# (hosts, Mbit/s, runs); the first CALIBRATE settings fit the constants, the rest validate.
# Only 2-host settings calibrate. 3 hosts on this machine's 2 cores each get an equal CPU
# quota (bench/cpushare.py): pinned, two would share one core and take turns, one's wait
# on the link the other's compute (4-bit sync then measured faster than the compute-only
# reference, 18.7% off the prediction at 16 Mbit/s).
GRID = [(2, 8, "none,sync,eager,sync-4bit,sync-h50,none"),
        (2, 32, "none,sync,eager,sync-int8,streaming-p2,none"),
        (2, 16, "none,sync,eager,sync-int8,sync-2bit,eager-h50,none"),
        (2, 4, "none,sync,eager,sync-4bit,streaming-p2,none"),
        (3, 8, "none,sync,eager,sync-h50,none"),
        (3, 16, "none,sync,eager,sync-4bit,none"),
        (3, 12, "none,sync-int8,delayed,sync-4bit,none")]
CALIBRATE = 2
TOLERANCE = 0.15
# Each host on its own core (3 hosts: hosts 0 and 2 share one, in the reference too), and
# one eval after the last round only: the runs evaluate on host 0, the reference's one-host
# jobs on every host, which on shared cores would slow the reference alone.
MEASURE_FLAGS = ("--pin_cores", "--eval_every=1000")


def measured_name(hosts: int, rate: float) -> str:
  return f"plan_wan_h{hosts}_{rate:g}"


def measure(directory: str) -> None:
  """Every GRID setting through bench/wan.py (root: namespaces and tc)."""
  for hosts, rate, modes in GRID:
    # relative to the repository where it is inside: the command is recorded with the file
    out = os.path.relpath(os.path.join(directory, measured_name(hosts, rate) + ".json"), REPO)
    subprocess.run([sys.executable, "-m", "bench.wan", f"--rounds={ROUNDS}", f"--hosts={hosts}",
                    f"--rate_mbit={rate}", f"--modes={modes}", f"--out={out}",
                    *MEASURE_FLAGS], cwd=REPO, check=True)


def tiny_params() -> int:
  from diloco_jax import plan  # pylint: disable=import-outside-toplevel
  config = runpy.run_path(os.path.join(REPO, "configs", "tiny.py"))["get_config"]()
  return plan.num_params(config)


def outer_s_per_param(results: str) -> float:
  """The outer step's host time per param: copies to and from the host and the update,
  for the biggest model bench/outer_step.py measured on 2 hosts."""
  with open(os.path.join(results, "outer_step.json")) as f:
    rows = [r for r in json.load(f)["rows"] if r["hosts"] == 2]
  r = max(rows, key=lambda r: r["params_millions"])
  return (r["outer_d2h"] + r["outer_update"] + r["outer_h2d"]) / (r["params_millions"] * 1e6)


@dataclasses.dataclass
class Run:
  """One measured run and the setting that predicts it."""
  file: str
  name: str
  setting: object  # planning.model.Setting
  round_s: float
  utilization: float
  # the compute-only reference's seconds per round (H = 25), before and after the runs
  reference_rounds_s: tuple[float, ...]

  @property
  def reference_s(self) -> float:
    return float(np.mean(self.reference_rounds_s))


def runs_of(path: str, num_params: int, round_overhead: float = 0.0) -> list[Run]:
  """The measured runs of one bench/wan.py file, each with its Setting; the step time is
  that of the file's own compute-only reference, less `round_overhead` per round."""
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  with open(path) as f:
    d = json.load(f)
  rows = {r["mode"]: r for r in d["rows"]}
  references = reference_rounds(d)
  step = (np.mean(references) - round_overhead) / 25
  out = []
  for name, r in rows.items():
    if name == "none":
      continue
    mode, extra, h = wan.RUNS[name]
    flags = dict(f.partition("=")[::2] for f in extra)
    rounds = d["rounds"] * 25 // h
    s = model.Setting(
        num_params=num_params, hosts=d["hosts"], step_time=(step,), up_mbit=d["rate_mbit"],
        down_mbit=d["rate_mbit"], mode=mode, inner_steps=h,
        compression=flags.get("--config.outer.compression", "none"),
        fragments=int(flags.get("--config.outer.fragments", 1)),
        overlap_steps=int(flags.get("--config.outer.overlap_steps", 0)), num_rounds=rounds)
    out.append(Run(os.path.basename(path), name, s, r["wall_s"] / (rounds - 1),
                   r["compute_utilization"], references))
  return out


def reference_rounds(d: dict) -> tuple[float, ...]:
  """The compute-only reference's seconds per round (H = 25; round 1 excluded), for each
  of its runs (measured before and after the others; their mean is used)."""
  return tuple(r["wall_s"] / (d["rounds"] - 1) for r in d["rows"] if r["mode"] == "none")


def fit(runs: list[Run], outer: float):
  """Constants from the calibration runs. The blocking modes' round time is linear in them:

    round - (H / 25) x reference round - outer x N
        = f x (1 - H / 25) + overhead x P + (W / B) / efficiency + codec x N (compressed)

  (the reference's round holds 25 steps and one f); least squares gives f, the overhead,
  the efficiency and the codec time. The async modes' round is max(C, T_x + codec x N)
  plus those constants plus their own cost per round, which is then the eager runs' mean
  time beyond the rest (least squares of a constant)."""
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  blocking = [r for r in runs if r.setting.mode in ("sync", "streaming")]
  a, y = [], []
  for r in blocking:
    s = r.setting
    coded = s.num_params if s.compression != "none" else 0
    a.append([1 - s.inner_steps / 25, s.fragments,
              model.bytes_per_host(s) / (s.up_mbit * 1e6 / 8), coded])
    y.append(r.round_s - s.inner_steps / 25 * r.reference_s - outer * s.num_params)
  (f, overhead, inverse_efficiency, codec), *_ = np.linalg.lstsq(np.array(a), np.array(y),
                                                                 rcond=None)
  base = model.Constants(round_overhead_s=float(max(f, 0.0)),
                         overhead_s=float(max(overhead, 0.0)),
                         link_efficiency=float(1 / max(inverse_efficiency, 1e-3)),
                         codec_s_per_entry=float(max(codec, 0.0)), async_overhead_s=0.0,
                         outer_s_per_param=outer)
  beyond = [r.round_s - model.predict(with_step(r, base), base).round_s
            for r in runs if r.setting.mode in ("eager", "delayed")]
  return dataclasses.replace(base, async_overhead_s=float(max(np.mean(beyond), 0.0))
                             if beyond else 0.0)


def with_step(r: Run, c) -> object:
  """r's setting with the step time of its reference less the fitted per-round work."""
  return dataclasses.replace(r.setting, step_time=((r.reference_s - c.round_overhead_s) / 25,))


def rounded(c):
  """The constants to 3 significant figures, as calibration.py holds them."""
  return dataclasses.replace(c, **{f.name: float(f"{getattr(c, f.name):.3g}")
                                   for f in dataclasses.fields(c)})


# The at-scale table's assumptions: hosts of 8 H100s (989 TFLOP/s bf16 dense each) at 40%
# MFU, 0.5M tokens per inner step per host, 100 ms round trips; the fitted constants, but
# no per-round work besides the sync (f = 0) and a GPU host's outer step: the params to
# and from the host over PCIe at 25 GB/s each way and the update at 10 GB/s of host memory
# traffic, 0.5 ns per param (this machine's CPU-only copies take 14 times that).
SCALE = dict(device_tflops=989.0, devices_per_host=8, mfu=0.4, tokens_per_step=0.5e6,
             rtt_ms=100.0, outer_s_per_param=5e-10)
SCALE_MODELS = {"1B": 1e9, "10B": 1e10}
SCALE_HOSTS = (8, 16, 32, 64)
SCALE_MBIT = (100.0, 1000.0, 10000.0)
# Fixed settings beside the sweep's choice: plain DiLoCo, INTELLECT-1's wire, async 4-bit.
SCALE_SETTINGS = (("sync", "none", 100), ("sync", "int8", 100), ("eager", "4bit", 100))
SWEEP_H = (100, 250, 500, 1000)
SWEEP_FORMATS = ("none", "bf16", "int8", "4bit", "2bit", "chunk_topk")
SWEEP_MODES = ("sync", "streaming", "eager")
TARGET = 0.9
PAPER_TABLE6 = {0.5: 1.4, 0.8: 6.2, 0.9: 13.3, 0.95: 23.3}  # arXiv 2503.09799: 10B, H=100


def scale_step(n: float) -> float:
  return 6 * n * SCALE["tokens_per_step"] / (SCALE["devices_per_host"] * SCALE["device_tflops"]
                                             * 1e12 * SCALE["mfu"])


def at_scale(constants) -> dict:
  """The planner's predictions for 1B and 10B models on 8-64 hosts of 8 H100s at 0.1-10
  Gbit/s, and the bandwidth it says a 10B model at H = 100 needs for the utilizations of
  the scaling-law paper's Table 6."""
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  c = dataclasses.replace(constants, round_overhead_s=0.0,
                          outer_s_per_param=SCALE["outer_s_per_param"])
  rows = []
  for label, n in SCALE_MODELS.items():
    step = scale_step(n)
    for hosts in SCALE_HOSTS:
      for mbit in SCALE_MBIT:
        base = model.Setting(num_params=int(n), hosts=hosts, step_time=(step,), up_mbit=mbit,
                             down_mbit=mbit, rtt_ms=SCALE["rtt_ms"])
        fixed = {f"{m}/{f}/H{h}": model.predict(dataclasses.replace(
            base, mode=m, compression=f, inner_steps=h), c).utilization
                 for m, f, h in SCALE_SETTINGS}
        tried = [dataclasses.replace(base, mode=m, compression=f, inner_steps=h,
                                     fragments=2 if m == "streaming" else 1)
                 for m in SWEEP_MODES for f in SWEEP_FORMATS for h in SWEEP_H]
        s, p, reaches = model.recommend([(s, model.predict(s, c)) for s in tried], TARGET)
        rows.append({"model": label, "params": n, "hosts": hosts, "mbit": mbit,
                     "step_s": step, "utilization": fixed, "recommended": {
                         "mode": s.mode, "compression": s.compression,
                         "inner_steps": s.inner_steps, "reaches": reaches,
                         "utilization": p.utilization, "bytes_per_host": p.bytes_per_host}})

  def needed(target: float, fmt: str, hosts: int = 8) -> float | None:
    """Gbit/s at which sync at H = 100 on `hosts` hosts reaches `target` (bisection; None:
    not even at 10 Tbit/s, where the outer step alone keeps it below)."""
    def util(mbit: float) -> float:
      return model.predict(model.Setting(
          num_params=int(1e10), hosts=hosts, step_time=(scale_step(1e10),), up_mbit=mbit,
          down_mbit=mbit, rtt_ms=SCALE["rtt_ms"], inner_steps=100, compression=fmt),
          c).utilization
    lo, hi = 1.0, 1e10
    if util(hi) < target:
      return None
    for _ in range(100):
      mid = (lo * hi) ** 0.5
      lo, hi = (lo, mid) if util(mid) >= target else (mid, hi)
    return hi / 1e3

  table6 = [{"target": t, "paper_gbit": g, "ours_gbit_float32": needed(t, "none"),
             "ours_gbit_bf16": needed(t, "bf16")} for t, g in PAPER_TABLE6.items()]
  return {"assumptions": {**SCALE, "round_overhead_s": 0.0, "target": TARGET,
                          "sweep": {"inner_steps": SWEEP_H, "formats": SWEEP_FORMATS,
                                    "modes": SWEEP_MODES}},
          "rows": rows, "table6": table6,
          # INTELLECT-1's 83-96% (10B, H = 100, int8, up to 14 nodes): the bandwidth each needs
          "intellect1": {str(t): needed(t, "int8", hosts=14) for t in (0.83, 0.96)}}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--measure", action="store_true", help="run GRID first (root)")
  parser.add_argument("--results", default=harness.RESULTS,
                      help="where the measured files are (and --measure writes them)")
  args = harness.parse_args(parser, "plan_fit", {}, argv)
  if args.measure:
    if args.smoke or os.geteuid() != 0:
      sys.exit("--measure needs root (network namespaces, tc) and no --smoke")
    measure(args.results)
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  n, outer = tiny_params(), outer_s_per_param(args.results)
  files = [os.path.join(args.results, measured_name(h, r) + ".json") for h, r, _ in GRID]
  missing = [f for f in files if not os.path.exists(f)]
  if missing:
    sys.exit(f"missing {missing[0]}: run sudo python -m bench.plan --measure")
  groups = [runs_of(f, n) for f in files]
  calibration = [r for g in groups[:CALIBRATE] for r in g]
  constants = rounded(fit(calibration, outer))
  rows = []
  for i, group in enumerate(groups):
    for r in group:
      p = model.predict(with_step(r, constants), constants)
      # The reference's time for this run's round: its steps and one round's own work
      # (bench/wan.py's utilization is that over whole runs, which for H != 25 leaves
      # out a different number of steps with round 1).
      reference = (r.setting.inner_steps / 25 * (r.reference_s - constants.round_overhead_s)
                   + constants.round_overhead_s)
      measured = reference / r.round_s
      rows.append({"file": r.file, "run": r.name, "held_out": i >= CALIBRATE,
                   "hosts": r.setting.hosts, "rate_mbit": r.setting.up_mbit,
                   "inner_steps": r.setting.inner_steps, "mode": r.setting.mode,
                   "reference_round_s": r.reference_s,
                   "reference_rounds_s": list(r.reference_rounds_s),
                   "compression": r.setting.compression,
                   "measured_round_s": r.round_s, "predicted_round_s": p.round_s,
                   "round_error": p.round_s / r.round_s - 1,
                   "measured_utilization": measured, "wan_utilization": r.utilization,
                   "predicted_utilization": p.utilization,
                   "utilization_error": p.utilization / measured - 1,
                   "bytes_per_host": p.bytes_per_host})
  held = [r for r in rows if r["held_out"]]
  within = [r for r in held if max(abs(r["round_error"]), abs(r["utilization_error"]))
            <= TOLERANCE]
  result = {"constants": dataclasses.asdict(constants), "num_params": n, "rows": rows,
            "at_scale": at_scale(constants),
            "calibration_files": [os.path.basename(f) for f in files[:CALIBRATE]],
            "tolerance": TOLERANCE, "held_out": len(held), "held_out_within": len(within),
            "measured_files": [os.path.basename(f) for f in files], "smoke": args.smoke,
            **harness.provenance("plan")}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"constants: {dataclasses.asdict(constants)}")
  print("| run | hosts | Mbit/s | round s (measured, predicted, error) | compute util. "
        "(measured, predicted, error) | held out |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['run']} | {r['hosts']} | {r['rate_mbit']:g} | {r['measured_round_s']:.3f}, "
          f"{r['predicted_round_s']:.3f}, {100 * r['round_error']:+.1f}% | "
          f"{r['measured_utilization']:.3f}, {r['predicted_utilization']:.3f}, "
          f"{100 * r['utilization_error']:+.1f}% | {'yes' if r['held_out'] else ''} |")
  print(f"held out within {100 * TOLERANCE:g}%: {len(within)} of {len(held)}; wrote {args.out}")


if __name__ == "__main__":
  main()
