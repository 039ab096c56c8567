"""Figures of live membership: hosts that leave a running job (bench/leave.py), and sync on
the epoch wire beside sync on gloo through slow links (bench/wan.py's live runs)."""

from __future__ import annotations

from bench.figures.results import Results


def leave(results: Results) -> dict:
  d = results("leave")
  rows = []
  for r in d["rows"]:
    full, left = r["uninterrupted"], r["with_kills"]
    rows.append([r["mode"], f"{full['final_eval_loss']:.4f}", f"{left['final_eval_loss']:.4f}",
                 f"{r['loss_ratio']:.3f}", " → ".join(str(k) for k in dict.fromkeys(
                     left["replicas"])),
                 ", ".join(f"{s:.1f}" for s in left["seconds_to_next_round"])])
  kills = d["rows"][0]["with_kills"]["kills"]
  return {**d, "table": rows,
          "kills": ", ".join(f"host {h} after round {r}" for r, h in kills.items())}


def wan_live(results: Results) -> dict:
  """Per rate, sync on gloo against sync-live (the epoch wire) and sync-live-mac (with a
  join token): each run's tokens/s (the mean where a run was listed twice) and the ratio."""
  rows, ratios = [], []
  for rate in (0, 8, 32):  # 0: unshaped veths, this machine's own speed
    d = results(f"wan_live_{rate}")
    speed: dict[str, list[float]] = {}
    for r in d["rows"]:
      speed.setdefault(r["mode"], []).append(r["tokens_per_sec"])
    mean = {mode: sum(v) / len(v) for mode, v in speed.items()}
    for mode in ("sync-live", "sync-live-mac"):
      ratio = mean[mode] / mean["sync"]
      ratios.append(ratio)
      rows.append([f"{d['rate_mbit']:g}" if d["rate_mbit"] else "unshaped", mode, f"{mean['sync']:,.0f}", f"{mean[mode]:,.0f}",
                   f"{ratio:.2f}", len(speed[mode])])
  return {"table": rows, "lowest": min(ratios)}
