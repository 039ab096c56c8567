"""Figures of training over a slow link (bench/wan.py): the modes, compression and
fragments, and SparseLoCo's bytes on the veth."""

from __future__ import annotations

import statistics

from bench.figures.markdown import bold
from bench.figures.markdown import change
from bench.figures.markdown import mb
from bench.figures.markdown import num
from bench.figures.markdown import pct
from bench.figures.markdown import span
from bench.figures.results import Results
from bench.figures.results import Runs
from bench.figures.results import hidden
from bench.figures.results import kept
from bench.figures.results import withdrawals


def on_wire(row: dict) -> float:
  """Bytes per host on the veth, the hosts' mean."""
  return statistics.mean(row.get("bytes_per_host") or [0])


def wire_mb(row: dict) -> str:
  return f"{on_wire(row) / 1e6:.1f}" if on_wire(row) else "0"


def wan(results: Results) -> dict:
  d = results("wan")
  rows = [[r["mode"], f"{r['outer_lr']:g}, {r['outer_momentum']:g}", f"{r['wall_s']:.1f}",
           bold(f"{r['compute_utilization']:.2f}", r["mode"] in ("sync", "eager")),
           pct(r["idle_fraction"]), num(r["tokens_per_sec"]), wire_mb(r),
           f"{r['comm_s_per_round']:.2f}" if "comm_s_per_round" in r else "–",
           f"{r['final_eval_loss']:.4f}"] for r in d["rows"]]
  by = {r["mode"]: r for r in d["rows"]}
  return {**d, "table": rows, "by": by,
          "sync_mb_per_round": by["sync"]["bytes_per_host_counted"] / d["rounds"] / 1e6,
          "ddp_bytes_over_sync": on_wire(by["ddp"]) / on_wire(by["sync"])}


WIRE_RUNS = {  # mode -> (label, the run its loss is compared with)
    "none": ("none (reference)", None),
    "sync": ("sync (H=25)", None),
    "sync-int8": ("sync, int8", "sync"),
    "sync-4bit": ("sync, 4bit", "sync"),
    "sync-2bit": ("sync, 2bit + error feedback", "sync"),
    "sync-bf16": ("sync, bf16", "sync"),
    "sync-topk": ("sync, top-k 5% + error feedback", "sync"),
    "sync-h20": ("sync (H=20)", None),
    "streaming-p2": ("streaming P=2, τ=0, α=0 (H=20)", "sync-h20"),
    "streaming-p2-4bit-overlap": ("streaming P=2, τ=5, α=0.5, 4bit (H=20)", "sync-h20"),
}


def wire_label(mode: str) -> str:
  return WIRE_RUNS.get(mode, (mode, None))[0]


def wan_wire(results: Results) -> dict:
  d = results("wan_wire")
  shown_rows = kept(d["rows"])
  by = Runs(results, "wan_wire", d["rows"], "mode")

  def cell(r: dict, figure: str, text: str) -> str:
    return "–" if hidden(r, figure) else text

  rows = []
  for r in shown_rows:
    ref = WIRE_RUNS.get(r["mode"], (r["mode"], None))[1]
    vs = "" if ref is None else change(r["final_eval_loss"] / by[ref]["final_eval_loss"], 2)
    rows.append([wire_label(r["mode"]), cell(r, "wall_s", f"{r['wall_s']:.1f}"),
                 cell(r, "compute_utilization", f"{r['compute_utilization']:.2f}"),
                 cell(r, "idle_fraction", pct(r["idle_fraction"])),
                 cell(r, "bytes_per_host", wire_mb(r)),
                 cell(r, "peak_bytes_per_sync", mb(r["peak_bytes_per_sync"])
                      if "peak_bytes_per_sync" in r else "–"),
                 cell(r, "final_eval_loss", f"{r['final_eval_loss']:.4f}"),
                 vs + (" vs H=20" if vs and ref == "sync-h20" else "")])
  sync, int8, q4 = by["sync"], by["sync-int8"], by["sync-4bit"]
  return {**d, "table": rows, "by": by,
          "withdrawn": withdrawals(results, "wan_wire", d["rows"], "mode", wire_label),
          # int8's and 4-bit's loss against uncompressed sync's, the worse of the two
          "worst_compressed": max(abs(r["final_eval_loss"] / sync["final_eval_loss"] - 1)
                                  for r in (int8, q4)),
          "int8_cut": on_wire(sync) / on_wire(int8), "q4_cut": on_wire(sync) / on_wire(q4),
          "int8_on_wire": on_wire(int8)}


SPARSELOCO_RUNS = {  # mode -> (label, the float32 sync run of the same model)
    "sync": ("tiny: sync, float32", "sync"),
    "sync-2bit": ("tiny: sync, 2bit + error feedback", "sync"),
    "sparseloco": ("tiny: configs/sparseloco.py's wire and outer step", "sync"),
    "sync-small_text": ("small_text: sync, float32", "sync-small_text"),
    "sparseloco-small_text": ("`configs/sparseloco.py`", "sync-small_text"),
}


def wan_sparseloco(results: Results) -> dict:
  d = results("wan_sparseloco")
  by = {r["mode"]: r for r in d["rows"]}
  rows = []
  for r in d["rows"]:
    label, ref = SPARSELOCO_RUNS.get(r["mode"], (r["mode"], None))
    counted, veth = r["bytes_per_host_counted"], r["bytes_per_host"]
    base = by[ref] if ref else None
    rows.append([label, f"{mb(counted)} MB" + share(counted, base and
                                                     base["bytes_per_host_counted"]),
                 f"{span(veth, mb)} MB" + share(veth, base and min(base["bytes_per_host"])),
                 f"{r['final_eval_loss']:.3f}"])
  own, f32, tiny = by["sparseloco-small_text"], by["sync-small_text"], by["sparseloco"]
  # sparseloco's veth bytes on its own model, the hosts' range, as shares of float32 sync's
  veth = [x / min(f32["bytes_per_host"]) for x in (min(own["bytes_per_host"]),
                                                  max(own["bytes_per_host"]))]
  return {**d, "table": rows, "veth_share": veth,
          "counted_share": own["bytes_per_host_counted"] / f32["bytes_per_host_counted"],
          # what the veth carries besides the payload: headers, the coordination service
          "extra_bytes": statistics.mean(tiny["bytes_per_host"]) - tiny["bytes_per_host_counted"]}


def share(x, of) -> str:
  """' (3.6%)', or ' (9.6–10.0%)' for a range; nothing for the reference itself."""
  if not of or x == of or (isinstance(x, list) and min(x) == of):
    return ""
  return f" ({span(x, lambda v: f'{100 * v / of:.1f}')}%)"


def peer_wan(results: Results) -> dict:
  """Per rate, every setting of both systems over the same link: tokens/s per replica, the
  share of the round spent waiting on the link, bytes, eval loss at equal wall time and
  against torchft's fastest setting; and per rate the diloco_jax setting that leads."""
  d = results("peer_wan")
  rows, leads = [], []
  for rate, r in d["rates"].items():
    for name, row in r["rows"].items():
      vs = row.get("vs_torchft_best")
      eq = row["eval_loss_at_equal_wall"]
      rows.append([rate, d["settings"][name][0], name,
                   f"{row['tokens_per_sec_per_replica']:,.0f}",
                   f"{100 * row['wait_share']:.0f}%",
                   "–" if row["mb_per_host"] is None else f"{row['mb_per_host']:.1f}",
                   "–" if eq is None else f"{eq:.4f}", f"{row['final_eval_loss']:.4f}",
                   f"{vs['tokens_per_sec']:.2f}" if vs else "–",
                   f"{vs['eval_loss_at_equal_wall']:.3f}"
                   if vs and vs["eval_loss_at_equal_wall"] else "–"])
    ours = {n: row for n, row in r["rows"].items() if "vs_torchft_best" in row}
    if ours:
      fastest = max(ours, key=lambda n: ours[n]["tokens_per_sec_per_replica"])
      best_loss = min(ours, key=lambda n: ours[n]["eval_loss_at_equal_wall"] or float("inf"))
      leads.append({"rate": rate, "torchft_best": r["torchft_best"],
                    "equal_wall_s":
                    r["equal_wall_s"], "fastest": fastest,
                    "fastest_ratio": ours[fastest]["vs_torchft_best"]["tokens_per_sec"],
                    "fastest_loss": ours[fastest]["vs_torchft_best"]["eval_loss_at_equal_wall"],
                    "best_loss": best_loss,
                    "best_loss_ratio": ours[best_loss]["vs_torchft_best"]["tokens_per_sec"],
                    "best_loss_loss":
                        ours[best_loss]["vs_torchft_best"]["eval_loss_at_equal_wall"]})
  return {**d, "table": rows, "leads": leads}
