"""Figures of training on one machine: DiLoCo against plain training, the outer step,
checkpoints, model families, memory per device and the data pipeline."""

from __future__ import annotations

import os

from bench.figures.markdown import mb
from bench.figures.markdown import num
from bench.figures.results import Results

GIB = 2 ** 30


def overhead(results: Results) -> dict:
  return results("overhead")


def overhead_peer(results: Results) -> dict:
  d = results("overhead_peer")
  # The loops took turns, so round i of each ran at nearly the same moment.
  per_round = [x / y for x, y in zip(d["samples"]["diloco"], d["samples"]["plain"])]
  return {**d, "per_round": (min(per_round), max(per_round))}


OUTER_PARTS = ("outer_d2h", "outer_mean", "outer_update", "outer_h2d", "outer_time",
               "anchor_hash_time", "anchor_check_time")


def outer_step(results: Results) -> dict:
  d = results("outer_step")
  rows = [[r["model"], f"{r['params_millions']:.2f}M", r["hosts"],
           *(f"{1e3 * r[k]:.1f}" for k in OUTER_PARTS),
           f"{100 * r['check_share_of_round']:.3f}", mb(r["bytes_sent_per_round"])]
          for r in d["rows"]]
  return {**d, "table": rows, "worst": max(d["rows"], key=lambda r: r["check_share_of_round"])}


def wire(results: Results) -> dict:
  """The epoch wire's sum against gloo's (bench/wire.py): on loopback one row per size,
  then through each shaped link (speed, and bytes per host against the planner's)."""
  d = results("wire")
  rows = []
  for r in d["rows"]:
    s, c = r["seconds"], r["cpu_seconds"]
    rows.append([f"{r['size']:,}", f"{r['mb']:g}", f"{1e3 * s['gloo']:.1f}",
                 f"{1e3 * s['wire']:.1f}", f"{1e3 * s['wire_hmac']:.1f}",
                 f"{r['ratio_gloo_over_wire']:.2f}", f"{r['ratio_gloo_over_wire_hmac']:.2f}",
                 " / ".join(f"{1e3 * c[k]:.1f}" for k in ("gloo", "wire", "wire_hmac"))])
  speed, sent = [], []
  for link in d["links"]:
    for r in link["rows"]:
      s, m, v = r["seconds"], r["payload_mbit_per_s"], r["veth_bytes_per_host"]
      where = [f"{link['rate_mbit']:g}", f"{r['size']:,}", f"{r['mb']:g}"]
      speed.append([*where, f"{s['gloo']:.2f}", f"{s['wire']:.2f}", f"{s['wire_hmac']:.2f}",
                    f"{r['ratio_gloo_over_wire']:.2f}", f"{r['ratio_gloo_over_wire_hmac']:.2f}",
                    " / ".join(f"{m[k]:.1f}" for k in ("gloo", "wire", "wire_hmac"))])
      sent.append([*where, f"{r['planner_bytes_per_host']:,.0f}",
                   f"{r['payload_bytes_per_host']:,}",
                   f"{r['framed_bytes_per_host']['wire_hmac']:,}",
                   *(f"{v[k]:,}" for k in ("gloo", "wire", "wire_hmac"))])
  every = d["rows"] + [r for link in d["links"] for r in link["rows"]]
  same = all(all(r["same_bits_as_gloo"].values()) for r in every)
  planner = all(r["payload_bytes_per_host"] == r["planner_bytes_per_host"] for r in every)
  fill = {side: [r["payload_mbit_per_s"][k] / link["rate_mbit"] for link in d["links"]
                 for r in link["rows"] for k in keys]
          for side, keys in (("wire", ("wire", "wire_hmac")), ("gloo", ("gloo",)))}
  return {**d, "table": rows, "same_bits": same, "planner_bytes": planner,
          "link_speed": speed, "link_bytes": sent,
          "fill": {side: (min(v), max(v)) for side, v in fill.items()}}


def checkpoint(results: Results) -> dict:
  d = results("checkpoint")
  seconds = [r["seconds"] for r in d["rounds"]]
  return {**d, "clean_rounds": sum(not r["write_behind"] for r in d["rounds"]),
          "full_saves": sum(s["full"] is not None for s in d["saves"]),
          "exact": d["anchor_bit_exact"] and d["state_bit_exact"],
          "rounds_s": (min(seconds), max(seconds))}


def models(results: Results) -> dict:
  d = results("models")
  rows = [[r["family"], num(r["params"]), num(r["mlp_dim"]),
           f"{r['flops_per_token'] / 1e6:.1f}", num(r["tokens_per_sec"]),
           f"{r['flops_per_sec'] / 1e9:.1f}"] for r in d["rows"]]
  return {**d, "table": rows, "by": {r["family"]: r for r in d["rows"]}}


def memory(results: Results) -> dict:
  d = results("memory")
  rows = [[f"{config_name(r['config'])} ({count(r['params'])})", layout(r),
           r["sequences_per_device"], f"{r['memory_per_device_bytes'] / GIB:.1f} GiB",
           f"{r['estimate_bytes'] / GIB:.1f} GiB",
           f"{r['memory_per_device_bytes'] / r['estimate_bytes']:.1f}",
           "yes" if r["memory_per_device_bytes"] <= 80e9 else "no"] for r in d["rows"]]
  return {**d, "table": rows, "state": state_per_device(d["rows"])}


def config_name(path: str) -> str:
  return os.path.basename(path)[:-len(".py")]


def layout(row: dict) -> str:
  return f"{row['replicas']} × {row['fsdp']}"


def count(params: int) -> str:
  return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def state_per_device(rows: list[dict]) -> list[dict]:
  """Per config: the state (params and AdamW moments) per device under the layout that
  shards it most (`lo`) and the one that shards it least (`hi`), in GiB."""
  out = []
  for config in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == config]
    lo = min(mine, key=lambda r: r["estimate"]["state"])
    hi = max(mine, key=lambda r: r["estimate"]["state"])
    out.append({"config": config_name(config),
                "lo": lo["estimate"]["state"] / GIB, "lo_layout": layout(lo),
                "hi": hi["estimate"]["state"] / GIB, "hi_layout": layout(hi)})
  return out


def data(results: Results) -> dict:
  d = results("data")
  rows = [[p["tokenizer"] + (f" (BPE of {p['vocab_size']:,}, trained first)"
                             if p["tokenizer"] == "train" else ""),
           f"{p['text_mb']:.1f}", f"{p['mb_per_sec']:.2f}", f"{p['tokenize_mb_per_sec']:.2f}",
           num(p["tokens"]), p["workers"]] for p in d["prepare"]]
  return {**d, "table": rows}


def inner_step(results: Results) -> dict:
  """One inner step on one core in both systems: the matmul peak per size, the step's time
  and share of the peak, the components timed alone, and each system's longest ops."""
  d = results("inner_step")
  peak = [[j["n"], f"{j['best_flops_per_sec'] / 1e9:.1f}", f"{t['best_flops_per_sec'] / 1e9:.1f}"]
          for j, t in zip(d["peak"]["diloco_jax"]["sizes"], d["peak"]["torch"]["sizes"])]
  j, t = d["step"]["diloco_jax"], d["step"]["torch"]
  step = [["time, median (ms)", f"{1e3 * j['median_s']:.1f}", f"{1e3 * t['median_s']:.1f}"],
          ["GFLOP/s (the count above)", f"{j['flops_per_sec'] / 1e9:.1f}",
           f"{t['flops_per_sec'] / 1e9:.1f}"],
          ["share of the core's matmul peak", f"{100 * j['share_of_peak']:.1f}%",
           f"{100 * t['share_of_peak']:.1f}%"],
          ["share of its own system's matmul peak", f"{100 * j['share_of_own_peak']:.1f}%",
           f"{100 * t['share_of_own_peak']:.1f}%"]]
  parts = [[c["label"], f"{c['jax_ms']:.2f}", f"{c['torch_ms']:.2f}", f"{c['ratio']:.2f}",
            f"{c['jax_in_step_ms']:.2f}"] for c in d["components"]]
  jax_ops = [[o["op_name"].split("/", 1)[-1], o["component"], f"{o['ms']:.2f}",
              f"{100 * o['share']:.1f}%"] for o in d["profile"]["diloco_jax"]["top"][:6]]
  torch_ops = [[o["op"], f"{o['self_ms']:.2f}", int(o["calls"]), f"{100 * o['share']:.1f}%"]
               for o in d["profile"]["torch"]["top"][:6]]
  return {**d, "peak_table": peak, "step_table": step, "parts_table": parts,
          "jax_ops": jax_ops, "torch_ops": torch_ops,
          "step_ratio": t["median_s"] / j["median_s"]}


def gpu_check(results: Results) -> dict:
  """bench/gpu_check.py's attention part on a GPU: each kernel's step time and XLA's
  temporaries per sequence length, and cuDNN's speed-up over the XLA formulation."""
  d = results("gpu_check")
  rows = [r for r in d["parts"]["e"]["rows"] if "step_s" in r]
  by = {(r["length"], r["attention"]): r for r in rows}
  table = [[r["length"], r["attention"], f"{1e3 * r['step_s']:.1f}",
            f"{r['temp_bytes'] / 2 ** 20:,.0f}",
            f"{r['max_logit_diff_vs_xla']:.1e}" if "max_logit_diff_vs_xla" in r else "—"]
           for r in rows]
  speedup = {n: by[n, "xla"]["step_s"] / by[n, "cudnn"]["step_s"]
             for n in sorted({r["length"] for r in rows}) if (n, "cudnn") in by}
  return {**d, "attention_table": table, "cudnn_speedup": speedup}
