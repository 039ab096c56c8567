"""Figures of the planner (bench/plan.py, python -m diloco_jax.plan): its constants, its
predictions against measured runs, and its answers at scale."""

from __future__ import annotations

import re

from bench.figures.markdown import bold
from bench.figures.markdown import pct
from bench.figures.results import Results


def plan(results: Results) -> dict:
  d = results("plan_fit")
  measured = [results(name[:-len(".json")]) for name in d["measured_files"]]
  held = [r for r in d["rows"] if r["held_out"]]

  def error(r: dict) -> float:  # the larger of a run's two errors
    return max(abs(r["round_error"]), abs(r["utilization_error"]))

  def err(x: float) -> str:
    return bold(f"{100 * x:+.1f}%", abs(x) > d["tolerance"])

  # Each setting measured its compute-only reference before and after its runs: how far
  # apart the two are is the machine's own drift during the setting.
  drift = {r["file"]: max(r["reference_rounds_s"]) / min(r["reference_rounds_s"]) - 1
           for r in d["rows"]}
  outside = [{**r, "before": r["reference_rounds_s"][0], "after": r["reference_rounds_s"][-1],
              "drift": drift[r["file"]]} for r in held if error(r) > d["tolerance"]]
  rows = [[r["run"], r["hosts"], f"{r['rate_mbit']:g}", r["inner_steps"],
           f"{r['measured_round_s']:.2f}", f"{r['predicted_round_s']:.2f}",
           err(r["round_error"]), f"{r['measured_utilization']:.2f}",
           f"{r['predicted_utilization']:.2f}", err(r["utilization_error"]),
           "held out" if r["held_out"] else "fit"] for r in d["rows"]]
  scale = d["at_scale"]
  grid = {(r["model"], r["hosts"], r["mbit"]): r for r in scale["rows"]}
  keys = list(scale["rows"][0]["utilization"])
  scale_rows = [[r["model"], r["hosts"], f"{r['mbit'] / 1e3:g}", f"{r['step_s']:.2f}",
                 *(pct(r["utilization"][k]) for k in keys), choice(r)]
                for r in scale["rows"]]
  table6 = [[pct(t["target"], 0), f"{t['paper_gbit']:g}", gbit(t["ours_gbit_float32"]),
             gbit(t["ours_gbit_bf16"])] for t in scale["table6"]]
  ratios = [t["ours_gbit_float32"] / t["paper_gbit"] for t in scale["table6"]
            if t["ours_gbit_float32"]]
  big = grid[("10B", 64, 100.0)]
  # bench/cpushare.py's description: "every host 0.60 of a core (cgroup CPU quota), ..."
  shares = sorted({re.search(r"([0-9.]+) of a core", m["placement"]).group(1)
                   for m in measured if "quota" in m.get("placement", "")})
  return {**d, "fitted": len(d["rows"]) - len(held), "held": len(held),
          "quota": " or ".join(shares) or "none",
          "worst": max(held, key=error), "outside": outside,
          "drift": (min(drift.values()), max(drift.values())),
          # the calibration runs' link rates, from their names: plan_wan_h2_8.json -> 8
          "calibration_mbit": [f.split("_")[-1][:-len(".json")] for f in d["calibration_files"]],
          "commands": [m["command"] for m in measured], "table": rows,
          "assumptions": scale["assumptions"], "keys": keys, "scale_table": scale_rows,
          "models": list(dict.fromkeys(r["model"] for r in scale["rows"])),
          "big": {**big, "choice": choice(big)}, "ten_b_8": grid[("10B", 8, 1000.0)],
          "table6": table6, "ratios": (min(ratios), max(ratios)),
          "intellect": {k: gbit(v) for k, v in scale["intellect1"].items()}}


def choice(r: dict) -> str:
  """The planner's recommended setting for a row at scale, and its utilization."""
  x = r["recommended"]
  return (f"{x['mode']}, {x['compression']}, H={x['inner_steps']} "
          f"({pct(x['utilization'])}{'' if x['reaches'] else ': none reaches the target'})")


def gbit(x: float | None) -> str:
  return "unreachable" if x is None else f"{x:.2f}"
