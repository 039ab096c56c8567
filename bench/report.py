"""The performance page, docs/performance.md, rendered from bench/results/*.json.

  python bench/report.py          # the page's Markdown, on stdout
  python bench/report.py --write  # writes it to docs/performance.md
  python bench/report.py --check  # exit 1 if docs/performance.md is not what it would write

Every figure on the page is read from a results file, and every ratio or share beside it
(DiLoCo / plain, % above sync, a target met or missed) is computed here from those
figures: only the words around them are typed by hand, so the page cannot drift from the
results. Each results file must say where it came from (`command`, `date`, `machine`:
bench/_smoke.py's `provenance` writes them); a file without them, or one that no section
renders, stops the report with an error naming the file. After a bench writes new
results, run --write: tests/test_performance_page.py fails while the page is stale. The
page has tables only; the benches' plots stay beside their JSON in bench/results/.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
PAGE = os.path.join(REPO, "docs", "performance.md")
PROVENANCE = ("command", "date", "machine")
GIB = 2 ** 30


class ResultsError(Exception):
  """A results file the page cannot be made from; the message names the file."""


class Results:
  """The results files of a directory, each read and checked once. Calling it with a
  name (`results("wan")`) returns that file's figures and marks it as rendered."""

  def __init__(self, directory: str):
    self.directory = directory
    self.files = {os.path.basename(path)[:-len(".json")]: load(path)
                  for path in sorted(glob.glob(os.path.join(directory, "*.json")))}
    self.rendered: set[str] = set()

  def __call__(self, name: str) -> dict:
    if name not in self.files:
      raise ResultsError(f"{shown(self.path(name))}: missing (the page renders it)")
    self.rendered.add(name)
    return self.files[name]

  def path(self, name: str) -> str:
    return os.path.join(self.directory, f"{name}.json")


def shown(path: str) -> str:
  """A path as an error names it: from the repository's root when it is inside it."""
  path = os.path.abspath(path)
  return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def load(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise ResultsError(f"{shown(path)}: unreadable: {e}") from e
  missing = [key for key in PROVENANCE if not data.get(key)]
  if missing:
    raise ResultsError(
        f"{shown(path)}: no {', '.join(missing)}: every results file says which command "
        "wrote it, when and on what machine (bench/_smoke.py's provenance)")
  if not re.fullmatch(r"\d{4}-\d\d-\d\d", str(data["date"])):
    raise ResultsError(f"{shown(path)}: date {data['date']!r} is not YYYY-MM-DD")
  return data


# --- Markdown ---------------------------------------------------------------------------


def table(header: list[str], rows: list[list]) -> str:
  lines = [header, ["---"] * len(header), *rows]
  return "\n".join("| " + " | ".join(str(cell).replace("|", "\\|") for cell in line) + " |"
                   for line in lines)


def provenance(results: Results, name: str) -> str:
  """The command that wrote a file, then its date and machine."""
  data = results(name)
  return (f"```sh\n{data['command']}\n```\n\nMeasured {data['date']}, {data['machine']}. "
          f"Figures: `bench/results/{name}.json`.")


def num(x: float, digits: int = 0) -> str:
  return f"{x:,.{digits}f}"


def pct(share: float, digits: int = 1) -> str:
  return f"{100 * share:,.0f}%" if share >= 10 else f"{100 * share:.{digits}f}%"


def dec(x: float) -> str:
  """An lr as the configs write it: 1.0, 0.7."""
  return f"{x:.1f}" if x == round(x, 1) else f"{x:g}"


def plural(n: int, word: str) -> str:
  return f"{n} {word}" + ("" if n == 1 else "s")


def change(ratio: float, digits: int = 1) -> str:
  """A ratio as a signed change: 1.089 -> +8.9%."""
  return f"{100 * (ratio - 1):+.{digits}f}%"


def above(a: float, b: float, digits: int = 1) -> str:
  """How a compares with b in words: '8.9% above', '0.2% below'."""
  return f"{abs(100 * (a / b - 1)):.{digits}f}% {'above' if a > b else 'below'}"


def mb(n: float) -> str:
  return f"{n / 1e6:.{2 if n >= 1e6 else 3}f}"


def verdict(ok: bool) -> str:
  return "met" if ok else "missed"


def bold(text: str, on: bool = True) -> str:
  return f"**{text}**" if on else text


# --- the page ---------------------------------------------------------------------------

def intro(results: Results) -> str:
  machines = sorted({d["machine"] for d in results.files.values()})
  where = (f"All of them ran on a {machines[0]}" if len(machines) == 1 else
           "They ran on these machines: " + "; ".join(machines))
  return f"""# Performance

Every figure on this page is read from the JSON files in `bench/results/`, which the
benchmark scripts in `bench/` write; each section gives the command that wrote its file,
the date and the machine it ran on. {where}. On a shared machine, take the ratios measured
side by side in one run (loops or runs taking turns, the same tokens) rather than the
absolute times, which drift with the machine's load from one run to the next. Every script
has `--help` and `--smoke` (seconds, tiny sizes, never written into `bench/results/`), and
`tests/test_bench.py` runs each smoke mode.

The page is generated by `bench/report.py`. After a benchmark writes new results,
regenerate it with `python bench/report.py --write`; `tests/test_performance_page.py`
fails while the page and the results differ."""


def overhead(results: Results) -> str:
  d = results("overhead")
  c, t, k = d["config"], d["tokens_per_sec"], d["config"]["replicas"]
  rows = [
      [f"DiLoCo (the trainer, K={k}, H={c['inner_steps']})", num(t["diloco"]), ""],
      [f"plain AdamW, the same per-step batch ({c['batch_size']} × {c['seq_len']} tokens, "
       f"{k} steps per DiLoCo step)", num(t["plain"]),
       bold(f"{d['ratio_diloco_vs_plain']:.3f}")],
      [f"plain AdamW, one step of {k * c['batch_size']} × {c['seq_len']} tokens",
       num(t["plain_big"]), f"{d['ratio_diloco_vs_plain_big']:.3f}"],
      [f"the trainer's {k} replicas without outer steps", num(t["local"]),
       f"{d['ratio_diloco_vs_local']:.3f}"]]
  return f"""## DiLoCo against plain training

`bench/overhead.py` runs, in one process, the trainer's own sync DiLoCo rounds beside an
independent plain jitted AdamW loop on the same model and tokens, and beside the trainer's
replicas without outer steps. The loops take turns round by round, so the machine's
drifts hit them alike; tokens/s is the median over {c['rounds_timed']} rounds, the first
(compiling) round excluded. Here: configs/tiny.py's model, K={k} replicas, H={c['inner_steps']}.

{provenance(results, "overhead")}

{table(["loop", "tokens/s", "DiLoCo / loop"], rows)}

DiLoCo trains at {d['ratio_diloco_vs_plain']:.3f}× the plain loop's tokens/s with the same
per-step batch, and at {d['ratio_diloco_vs_local']:.3f}× its own
replicas' without outer steps: the outer step every {c['inner_steps']} steps adds
{"nothing measurable" if d['ratio_diloco_vs_local'] >= 0.99 else
 pct(1 - d['ratio_diloco_vs_local']) + " to a round"}.

{overhead_peer(results)}"""


def per_round(d: dict, a: str, b: str) -> tuple[float, float]:
  """The range of a / b over rounds: the loops took turns, so round i of each ran at
  nearly the same moment."""
  ratios = [x / y for x, y in zip(d["samples"][a], d["samples"][b])]
  return min(ratios), max(ratios)


def overhead_peer(results: Results) -> str:
  d = results("overhead_peer")
  c, t = d["config"], d["tokens_per_sec"]
  lo, hi = per_round(d, "diloco", "plain")
  rows = [["DiLoCo (the trainer's rounds, outer step included)", num(t["diloco"]),
           bold(f"{d['ratio_diloco_vs_plain']:.3f}")],
          ["the trainer's inner step and its data, no outer step", num(t["local"]),
           f"{d['ratio_local_vs_plain']:.3f}"],
          ["plain jitted AdamW loop of the same model and batches", num(t["plain"]), ""]]
  return f"""The same comparison on configs/peer.py's model (the one `bench/peer.py` races
against torchft: {c['batch_size']} × {c['seq_len']} tokens per step, K = {c['replicas']},
H = {c['inner_steps']}), in one process on one core with XLA on one thread, as
`bench/peer.py` runs each host; median of {c['rounds_timed']} rounds:

{provenance(results, "overhead_peer")}

{table(["loop (configs/peer.py's model)", "tokens/s", "vs plain"], rows)}

The trainer's rounds run at {d['ratio_diloco_vs_plain']:.3f}× the bare loop's speed (per
round {lo:.2f}–{hi:.2f})."""


def outer_step(results: Results) -> str:
  d = results("outer_step")
  rows = [[r["model"], f"{r['params_millions']:.2f}M", r["hosts"],
           *(f"{1e3 * r[k]:.1f}" for k in ("outer_d2h", "outer_mean", "outer_update",
                                            "outer_h2d", "outer_time", "anchor_hash_time",
                                            "anchor_check_time")),
           f"{100 * r['check_share_of_round']:.3f}", mb(r["bytes_sent_per_round"])]
          for r in d["rows"]]
  worst = max(d["rows"], key=lambda r: r["check_share_of_round"])
  return f"""## The outer step across hosts

`bench/outer_step.py` runs the real trainer on 2 and 4 local host processes (one replica
and one CPU device each, loopback TCP, checkpoints only at the end) and reports the median
over {d['rounds_timed']} rounds of each part of a sync outer step, and of the check that the
outer state is the same on every host (run every round here). `mean` is Δ, this host's
sum, the cross-host sum over gloo and the division by K; it includes waiting for the
slowest host. Bytes are the ring all-reduce's 2(n−1)/n × payload. `hash` is the sha256 of
the outer state (anchor and momentum, on a thread per core), `check` that plus publishing
the hash and reading the previous round's; its share of a round is check / (10 × (50
inner steps + the outer step)), from the measured parts, for the default
`anchor_check_every` = 10.

{provenance(results, "outer_step")}

{table(["model", "params", "hosts", "d2h ms", "mean ms", "update ms", "h2d ms", "outer ms",
        "hash ms", "check ms", "check, % of a round (H=50, every 10)",
        "MB sent/host/round"], rows)}

The check costs at most {100 * worst['check_share_of_round']:.3f}% of a round
({worst['model']} on {worst['hosts']} hosts)."""


def checkpoint(results: Results) -> str:
  d = results("checkpoint")
  c = d["config"]
  clean = [r["seconds"] for r in d["rounds"] if not r["write_behind"]]
  full = [s["full"] for s in d["saves"] if s["full"] is not None]
  rows = [[f"round (median of {len(clean)})", f"{d['round_seconds']:.2f}"],
          [f"save, blocking part: the copy into host memory (median of {len(d['saves'])})",
           f"{d['save_blocking_seconds']:.3f}"],
          [f"save, full: until orbax has written it (median of {len(full)})",
           f"{d['save_full_seconds']:.2f}"],
          ["restore: a fresh trainer resuming", f"{d['restore_seconds']:.2f}"]]
  exact = d["anchor_bit_exact"] and d["state_bit_exact"]
  seconds = [r["seconds"] for r in d["rounds"]]
  return f"""## Checkpoints

`bench/checkpoint.py` runs the trainer on a {d['params'] / 1e6:.1f}M-param model
(`bench/outer_step.py`'s "25m": {c['num_layers']} blocks of width {c['d_model']}), one host,
{c['mode']}, one replica, H={c['inner_steps']}, batch {c['batch_size']} × {c['seq_len']}
tokens, and times a round, a save (the part that blocks the training loop, and the whole
write) and a restore, as `Trainer.run` sees them; round 1 (compiling) excluded.

{provenance(results, "checkpoint")}

{table(["what", "seconds"], rows)}

The blocking part of a save is **{pct(d['blocking_over_round'], 2)}** of a round (target
≤ 5%: {verdict(d['blocking_over_round'] <= 0.05)}); the full save, {pct(d['full_over_round'])},
is written in the background while the next round trains. A checkpoint is
{d['checkpoint_mb']:,.0f} MB on disk (the state: params, AdamW moments and outer state,
{d['state_bytes'] / 1e6:,.0f} MB); the restored state
{"equals the saved one bit for bit" if exact else "differs from the saved one"}. Rounds
ranged {min(seconds):.0f}–{max(seconds):.0f} s over the run."""


# --- over a slow link -------------------------------------------------------------------

# Figures of a results file that the code has changed since, by (file, date): not shown.
WITHDRAWN = {("wan_wire", "2026-11-23"): {"sync-bf16": "row", "streaming-p2": "idle"}}

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


def on_wire(row: dict) -> float:
  """Bytes per host on the veth, the hosts' mean."""
  return statistics.mean(row.get("bytes_per_host") or [0])


def wire_mb(row: dict) -> str:
  return f"{on_wire(row) / 1e6:.1f}" if on_wire(row) else "0"


def wan(results: Results) -> str:
  d = results("wan")
  by = {r["mode"]: r for r in d["rows"]}
  rows = [[r["mode"], f"{r['outer_lr']:g}, {r['outer_momentum']:g}", f"{r['wall_s']:.1f}",
           bold(f"{r['compute_utilization']:.2f}", r["mode"] in ("sync", "eager")),
           pct(r["idle_fraction"]), num(r["tokens_per_sec"]), wire_mb(r),
           f"{r['comm_s_per_round']:.2f}" if "comm_s_per_round" in r else "–",
           f"{r['final_eval_loss']:.4f}"] for r in d["rows"]]
  sync, eager = by["sync"], by["eager"]
  mean_mb = sync["bytes_per_host_counted"] / d["rounds"] / 1e6
  return f"""## Over a slow link

`bench/wan.py` puts {d['hosts']} hosts in their own network namespaces on a bridge, each
link shaped to {d['rate_mbit']:g} Mbit/s each way with `tc tbf` (bandwidth, no delay), and
trains configs/tiny.py's model and data with one replica per host (32 × 64 tokens per
step), H=25, {d['rounds']} rounds, the same tokens in every mode. At this rate sync's mean
({mean_mb:.2f} MB of Δ per round, {sync['comm_s_per_round']:.2f} s) takes about as long as
half an inner phase. `none` is
the compute-only reference: the same hosts as independent one-host jobs. Compute
utilization = reference wall time / the run's wall time (round 1 excluded); "outer-step
idle" is the share of wall time the main thread spent in outer steps, waiting for the
mean included. Bytes are the veth's own counters. The outer lr and momentum per mode are
the best of a small sweep on one host (see `bench/wan.py`).

{provenance(results, "wan")}

{table(["mode", "outer lr, μ", "wall s", "compute util.", "outer-step idle", "tokens/s",
        "MB/host on the wire", "comm s/round", "final eval loss"], rows)}

Eager hides the collective behind the next inner phase: utilization
{eager['compute_utilization']:.2f} against sync's {sync['compute_utilization']:.2f}, outer-step
idle {pct(eager['idle_fraction'])} against {pct(sync['idle_fraction'])}, and its final loss is
{above(eager['final_eval_loss'], sync['final_eval_loss'])} sync's at equal tokens (delayed:
{above(by['delayed']['final_eval_loss'], sync['final_eval_loss'], 0)}). ddp sends
{on_wire(by['ddp']) / on_wire(sync):.0f}× the bytes of DiLoCo with H=25. On 2 shared cores
the reference itself varies between runs, so the idle column is the steadier measure of
what communication costs.

{wan_wire(results)}

{wan_sparseloco(results)}"""


def wan_wire(results: Results) -> str:
  d = results("wan_wire")
  withdrawn = WITHDRAWN.get(("wan_wire", d["date"]), {})
  by = {r["mode"]: r for r in d["rows"]}
  rows = []
  for r in d["rows"]:
    if withdrawn.get(r["mode"]) == "row":
      continue
    label, ref = WIRE_RUNS.get(r["mode"], (r["mode"], None))
    idle = "–" if withdrawn.get(r["mode"]) == "idle" else pct(r["idle_fraction"])
    vs = "" if ref is None else change(r["final_eval_loss"] / by[ref]["final_eval_loss"], 2)
    rows.append([label, f"{r['wall_s']:.1f}", f"{r['compute_utilization']:.2f}", idle,
                 wire_mb(r),
                 mb(r["peak_bytes_per_sync"]) if "peak_bytes_per_sync" in r else "–",
                 f"{r['final_eval_loss']:.4f}",
                 vs + (" vs H=20" if vs and ref == "sync-h20" else "")])
  notes = {"row": "the {} row", "idle": "the outer-step idle of {}"}
  hidden = " and ".join(notes[what].format(WIRE_RUNS[mode][0])
                        for mode, what in withdrawn.items())
  sync, int8, q4 = by["sync"], by["sync-int8"], by["sync-4bit"]
  sp, spo, h20 = by["streaming-p2"], by["streaming-p2-4bit-overlap"], by["sync-h20"]
  worst = max(abs(r["final_eval_loss"] / sync["final_eval_loss"] - 1) for r in (int8, q4))
  return f"""### Compression and fragments over the same link

The same 2 hosts and {d['rate_mbit']:g} Mbit/s link, one replica each, the same inner steps of
32 × 64 tokens per replica in every run. Streaming needs P to divide H, so its runs use
H=20 beside sync at H=20. "peak MB/sync" is the most one sync sent (streaming: one
fragment, the peak bytes in flight); "MB/host" is the veth's own counter over the whole
run.

{provenance(results, "wan_wire")}

{table(["run", "wall s", "compute util.", "outer-step idle", "MB/host (wire)",
        "peak MB/sync", "final eval loss", "vs sync"], rows)}
{f'''
Not shown: {hidden}; this run measured code that has changed since.
''' if hidden else ""}
int8 and 4-bit end within {pct(worst, 2)} of uncompressed sync's loss at equal tokens
(target 1%: {verdict(worst <= 0.01)}) and cut the bytes on the wire
{on_wire(sync) / on_wire(int8):.1f}× and {on_wire(sync) / on_wire(q4):.1f}×. The trainer's own
count and the veth agree (int8: {mb(int8['peak_bytes_per_sync'])} MB counted per sync,
{on_wire(int8) / 1e6:.1f} MB over {d['rounds']} rounds on the veth with the coordination
traffic). Top-k at 5% with error feedback ends
{above(by['sync-topk']['final_eval_loss'], sync['final_eval_loss'], 0)} sync at the same
round count. With P=2 fragments each sync sends {mb(sp['peak_bytes_per_sync'])} MB against
sync's {mb(h20['peak_bytes_per_sync'])} (fragment 0, with the embeddings and head, holds
{pct(sp['peak_bytes_per_sync'] / h20['peak_bytes_per_sync'], 0)} of the params), the same
total bytes; with τ=5 and 4-bit Δ the communication hides behind compute (utilization
{spo['compute_utilization']:.2f}) and the loss ends
{above(spo['final_eval_loss'], h20['final_eval_loss'], 2)} sync's at H=20."""


SPARSELOCO_RUNS = {  # mode -> (label, the float32 sync run of the same model)
    "sync": ("tiny: sync, float32", "sync"),
    "sync-2bit": ("tiny: sync, 2bit + error feedback", "sync"),
    "sparseloco": ("tiny: configs/sparseloco.py's wire and outer step", "sync"),
    "sync-small_text": ("small_text: sync, float32", "sync-small_text"),
    "sparseloco-small_text": ("`configs/sparseloco.py`", "sync-small_text"),
}


def wan_sparseloco(results: Results) -> str:
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
  own = by["sparseloco-small_text"]
  f32 = by["sync-small_text"]
  tiny = by["sparseloco"]
  extra = statistics.mean(tiny["bytes_per_host"]) - tiny["bytes_per_host_counted"]
  lo, hi = (x / min(f32["bytes_per_host"]) for x in (min(own["bytes_per_host"]),
                                                      max(own["bytes_per_host"])))
  return f"""### SparseLoCo's and 2-bit's bytes on the veth

The same two hosts and link: {d['rounds']} rounds of the tiny model, then {d['rounds']}
rounds of `configs/sparseloco.py` itself beside float32 sync of its model
(`configs/small_text.py`'s; batch 4, which the bytes do not depend on). Per host over the
run; the veth's figures are the two hosts' range, and the shares are of float32 sync's
bytes on the same model.

{provenance(results, "wan_sparseloco")}

{table(["run", "payload counted by the trainer", "on the veth",
        f"final eval loss ({d['rounds']} rounds)"], rows)}

On its own model, `configs/sparseloco.py` puts **{pct(lo)}–{pct(hi)}** of float32 sync's
bytes on the veth (the trainer counts
{pct(own['bytes_per_host_counted'] / f32['bytes_per_host_counted'], 2)}). The veth also
carries TCP/IP headers and the coordination service's traffic (start-up, heartbeats, the
link watchdog's beat): ~{extra / 1e3:.0f} KB beside the payload over a run this short, which
on the tiny model is as much as SparseLoCo's payload itself. The losses after
{d['rounds']} rounds say nothing about the methods: `bench/quality.py` compares them at
equal tokens."""


def share(x, of) -> str:
  """' (3.6%)', or ' (9.6–10.0%)' for a range; nothing for the reference itself."""
  if not of or x == of or (isinstance(x, list) and min(x) == of):
    return ""
  return f" ({span(x, lambda v: f'{100 * v / of:.1f}')}%)"


def span(x, fmt) -> str:
  """One value, or a list's range 'lo–hi' (one value when they print alike)."""
  if not isinstance(x, list):
    return fmt(x)
  lo, hi = fmt(min(x)), fmt(max(x))
  return lo if lo == hi else f"{lo}–{hi}"


# --- loss against bytes (bench/quality.py) ----------------------------------------------

# A row of bench/quality.py records only the flags it added to its config, so a row's outer
# step is its config's as the config was when the file was written: the configs took the
# sweep's best outer steps after quality_sweep.json and quality_long.json were written.
CONFIGS_NOW = {
    "configs/small_text.py": {"lr": 1.0, "momentum": 0.5},
    "configs/eager.py": {"lr": 0.7, "momentum": 0.3},
    "configs/sparseloco.py": {"lr": 2.0, "momentum": 0.0, "topk": 256},
    "configs/muloco.py": {"lr": 1.0, "momentum": 0.5},
}
CONFIGS_BEFORE_SWEEP = {
    "configs/small_text.py": {"lr": 0.7, "momentum": 0.9},
    "configs/sparseloco.py": {"lr": 1.0, "momentum": 0.0, "topk": 64},
}
QUALITY_CONFIGS = {"quality": CONFIGS_NOW, "quality_timing": CONFIGS_NOW,
                   "quality_tree": CONFIGS_NOW, "quality_sweep": CONFIGS_BEFORE_SWEEP,
                   "quality_long": CONFIGS_BEFORE_SWEEP}
FAMILIES = ("ddp", "sync", "eager", "streaming", "int8", "sparseloco", "muloco")
TOPK_CHUNK = 4096  # configs/sparseloco.py's topk_chunk


def settings(row: dict, configs: dict) -> dict:
  """What a quality row ran: its method family and outer step, from its config and flags."""
  s = {"config": row["config"], "H": None, **configs.get(row["config"], {})}
  for flag in row["overrides"]:
    key, _, value = flag.removeprefix("--config.").partition("=")
    s[key] = value
  s["lr"], s["momentum"] = float(s.pop("outer.lr", s.get("lr"))), float(
      s.pop("outer.momentum", s.get("momentum")))
  if "outer.topk_fraction" in s:
    s["topk"] = round(float(s.pop("outer.topk_fraction")) * TOPK_CHUNK)
  if "inner_steps" in s:
    s["H"] = int(s.pop("inner_steps"))
  s["family"] = family(s)
  if s["family"] == "ddp":  # a sum every step: no outer step to compare
    s["lr"] = s["momentum"] = None
  return s


def family(s: dict) -> str:
  name = os.path.basename(s["config"])[:-len(".py")]
  if name in ("sparseloco", "muloco"):
    return name
  mode = s.get("mode", "eager" if name == "eager" else "sync")
  return "int8" if s.get("outer.compression") == "int8" and mode == "sync" else mode


def label(s: dict) -> str:
  f = s["family"]
  if f == "ddp":
    return "ddp (a sum every step)"
  step = f"lr {dec(s['lr'])}, μ {s['momentum']:g}"
  if f == "sparseloco":
    return (f"SparseLoCo ({s.get('topk')} of {TOPK_CHUNK}, 2-bit, outer SGD lr {dec(s['lr'])}"
            + (f", Nesterov {s['momentum']:g}" if s["momentum"] else "") + ")")
  return {"sync": f"sync DiLoCo ({step}" + (f", H = {s['H']}" if s["H"] else "") + ")",
          "eager": f"eager ({step})",
          "streaming": f"streaming (P = {s.get('outer.fragments')}, "
                       f"{s.get('outer.compression')}, τ = 0; {step})",
          "int8": f"sync, int8 ({step})",
          "muloco": f"MuLoCo (Muon inner, 2-bit + error feedback; {step})"}[f]


def step(s: dict) -> str:
  """A row's outer step in short, for the text."""
  if s["family"] == "sparseloco":
    return f"{s.get('topk')} of {TOPK_CHUNK} at lr {dec(s['lr'])}"
  return f"lr {dec(s['lr'])}, μ {s['momentum']:g}"


def same(a: dict, b: dict) -> bool:
  keys = ("family", "lr", "momentum", "topk", "H")
  return all(a.get(k) == b.get(k) for k in keys)


class Quality:
  """The quality files' rows, each with its settings, found by method or by settings."""

  def __init__(self, results: Results, name: str):
    self.name, self.data = name, results(name)
    configs = QUALITY_CONFIGS.get(name, CONFIGS_NOW)
    for r in self.data["rows"]:
      if r["config"] not in configs:
        raise ResultsError(f"{shown(results.path(name))}: {r['method']}'s {r['config']} has no "
                           "outer step in bench/report.py's QUALITY_CONFIGS")
    self.rows = [{**r, "s": settings(r, configs)} for r in self.data["rows"]]

  def __getitem__(self, method: str) -> dict:
    return next(r for r in self.rows if r["method"] == method)

  def like(self, row: dict) -> dict | None:
    return next((r for r in self.rows if same(r["s"], row["s"])), None)


def loss(row: dict | None) -> float | None:
  return None if row is None else row["final_eval_loss"]


def quarter(row: dict) -> tuple[float, float]:
  """Eval loss at three quarters of the run and at its end."""
  curve = row["curve"]
  return curve[len(curve) * 3 // 4 - 1][1], curve[-1][1]


def quality(results: Results) -> str:
  q, timing = Quality(results, "quality"), Quality(results, "quality_timing")
  inner = {"adamw": timing["sync"]["inner_seconds_per_round"],
           "muon": timing["muloco"]["inner_seconds_per_round"]}
  sync, ddp = q["sync"], q["ddp"]
  link = sync["link_mbit"]
  rows = [quality_row(r, sync, ddp, inner, link) for r in q.rows]
  return f"""## Loss against bytes

`bench/quality.py` trains every method on `configs/small_text.py`'s model
({sync['params'] / 1e6:.2f}M params, BPE 4,096) on the standard library's sources (prepared
on first use into `~/.cache/diloco_jax/stdlib_bpe4k`), {q.data['hosts']} hosts ×
{q.data['replicas_per_host']} replicas (K = {q.data['hosts'] * q.data['replicas_per_host']}),
the same seed and tokens: {q.data['rounds']} rounds × H = {q.data['inner_steps']} steps of
16 × 128 tokens per replica ({sync['tokens'] / 1e6:.1f}M tokens in all). Each row gives the
final eval loss (nats/token, and bits per byte of text), what host 0 sent (the collective's
own count; `bench/wan.py` checks such counts on a veth), and the compute utilization on a
link of {link:g} Mbit/s, modelled: a round's bytes take bytes × 8 / {link:g} Mbit/s, which every
method but eager waits for (eager hides them behind the next inner phase), against the
inner phase measured alone ({inner['adamw']:.1f} s per round with AdamW,
{inner['muon']:.1f} s with Muon: the second file below).

{provenance(results, "quality")}

{provenance(results, "quality_timing")}

{table(["method", "eval loss", "bits/byte", "vs sync", "vs ddp", "MB/round",
        "of sync's bytes", "MB in all", f"comm s/round at {link:g} Mbit/s", "utilization"],
       rows)}

{quality_findings(q, inner, link)}

{quality_sweep(results, q)}

{quality_long(results, q)}

{quality_tree(results)}"""


def utilization(row: dict, inner: dict, link: float) -> float:
  seconds = inner["muon" if row["s"]["family"] == "muloco" else "adamw"]
  comm = row["bytes_per_round"] * 8 / (link * 1e6)
  if row["s"]["family"] == "eager":  # hidden behind the next inner phase, up to its length
    return seconds / max(seconds, comm)
  return seconds / (seconds + comm)


def quality_row(r: dict, sync: dict, ddp: dict, inner: dict, link: float) -> list:
  config = "" if r["config"] == "configs/small_text.py" else f" `{r['config']}`"
  return [label(r["s"]) + config, f"{r['final_eval_loss']:.4f}",
          f"{r['final_eval_bpb']:.3f}", f"{loss(r) / loss(sync):.3f}",
          f"{loss(r) / loss(ddp):.3f}", mb(r["bytes_per_round"]),
          pct(r["bytes_per_round"] / sync["bytes_per_round"], 1),
          f"{r['total_bytes'] / 1e6:,.1f}",
          f"{r['bytes_per_round'] * 8 / (link * 1e6):.2f}", pct(utilization(r, inner, link))]


def quality_findings(q: Quality, inner: dict, link: float) -> str:
  sync, ddp, eager, sparse = q["sync"], q["ddp"], q["eager"], q["sparseloco"]
  mu, i8, st = q["muloco"], q["int8"], q["streaming"]
  bytes_share = sparse["bytes_per_round"] / sync["bytes_per_round"]
  ddp_q, sync_q = quarter(ddp), quarter(sync)
  compressed = max(abs(loss(r) / loss(sync) - 1) for r in (i8, st))
  busy = ", ".join(f"{r['method']} {pct(utilization(r, inner, link), 0)}" for r in q.rows)
  still = ddp_q[1] < ddp_q[0] and sync_q[1] < sync_q[0]
  return f"""Over the last quarter ddp's eval loss went {ddp_q[0]:.2f} → {ddp_q[1]:.2f} and
sync's {sync_q[0]:.2f} → {sync_q[1]:.2f}{
    ": still falling, the early-training regime where DiLoCo trails data-parallel training"
    if still else ""}. **Sync DiLoCo ends
{above(loss(sync), loss(ddp))} ddp** (target ≤ 1%: {verdict(loss(sync) / loss(ddp) <= 1.01)}),
**eager {above(loss(eager), loss(sync))} sync** (target 1%:
{verdict(loss(eager) / loss(sync) <= 1.01)}), and **SparseLoCo {above(loss(sparse), loss(sync))}
sync at {pct(bytes_share)} of its bytes** (target: within 1% at ≤ 5% of the bytes:
{verdict(abs(loss(sparse) / loss(sync) - 1) <= 0.01 and bytes_share <= 0.05)}). int8 and
streaming's 4-bit fragments end within {pct(compressed)} of sync at
{pct(i8['bytes_per_round'] / sync['bytes_per_round'], 0)} and
{pct(st['bytes_per_round'] / sync['bytes_per_round'], 0)} of its bytes. **MuLoCo ends
{above(loss(mu), loss(sync))} sync**, {above(loss(mu), loss(ddp))} ddp, with
{pct(mu['bytes_per_round'] / sync['bytes_per_round'])} of sync's bytes. On a link of
{link:g} Mbit/s the devices are busy {busy} of the time."""


def quality_sweep(results: Results, q: Quality) -> str:
  sweep = Quality(results, "quality_sweep")
  sync, ddp = q["sync"], q["ddp"]
  order = sorted(sweep.rows, key=lambda r: (FAMILIES.index(r["s"]["family"]), loss(r)))
  best = {}
  for r in order:
    best.setdefault(r["s"]["family"], r)
  rows = [sweep_row(r, sync, ddp, best[r["s"]["family"]] is r) for r in order]
  return f"""### The outer step's hyperparameters, swept

`bench/quality.py --variant=NAME=METHOD:FLAGS`: the table's budget ({sweep.data['rounds']}
rounds × H = {sweep.data['inner_steps']}, K = 4), one outer step per row, compared with the
table above. lr/(1 − μ) is how far the outer step moves along a pseudo-gradient that
repeats round after round. Rows by method, best first.

{provenance(results, "quality_sweep")}

{table(["method", "outer lr", "Nesterov μ", "lr/(1 − μ)", "other", "eval loss",
        "vs sync (the table's)", "vs ddp"], rows)}

The best outer step per method at this budget: {"; ".join(
    f"{label(r['s'])}, {loss(r):.4f}, lr/(1 − μ) = {reach(r['s']):.2g}"
    for r in best.values())}."""


def reach(s: dict) -> float:
  return s["lr"] / (1 - s["momentum"])


def sweep_row(r: dict, sync: dict, ddp: dict, best: bool) -> list:
  s = r["s"]
  other = []
  if s.get("topk"):
    bytes_share = pct(r["bytes_per_round"] / sync["bytes_per_round"])
    other.append(f"{s['topk']} of {TOPK_CHUNK} ({bytes_share} of sync's bytes)")
  if s["H"]:
    other.append(f"H = {s['H']}, {s.get('num_rounds')} rounds")
  return [s["family"] if s["family"] != "sparseloco" else "SparseLoCo", dec(s["lr"]),
          f"{s['momentum']:g}", f"{reach(s):.2g}", ", ".join(other),
          bold(f"{loss(r):.4f}", best), bold(f"{loss(r) / loss(sync):.3f}", best),
          f"{loss(r) / loss(ddp):.3f}"]


def quality_long(results: Results, q: Quality) -> str:
  long = Quality(results, "quality_long")
  sweep = Quality(results, "quality_sweep")
  ddp, tuned = long["ddp"], long.like(q["sync"])
  short = {"ddp": q["ddp"], "sync": q["sync"]}

  def at20(r):  # the same settings at 20 rounds: the table above, or the sweep
    return q.like(r) or sweep.like(r)

  rows = []
  for r in long.rows:
    r20 = at20(r)
    rows.append([label(r["s"]), f"{loss(r20):.4f}" if r20 else "–", f"{loss(r):.4f}",
                 f"{r['final_eval_bpb']:.3f}", trend(r20, short["sync"], r, tuned),
                 trend(r20, short["ddp"], r, ddp),
                 f"{r['total_bytes'] / 1e6:,.1f} ({pct(r['total_bytes'] / tuned['total_bytes'])})"])
  return f"""### Three times the budget

The same methods at {long.data['rounds']} rounds × H = {long.data['inner_steps']}
({ddp['tokens'] / 1e6:.1f}M tokens per method, the inner lr's warmup and cosine spread over
the {long.data['rounds']} rounds), with the outer steps of the sweep beside them. "20 rounds"
is the same settings in the table or the sweep above, where they ran.

{provenance(results, "quality_long")}

{table(["method", "eval loss, 20 rounds", f"eval loss, {long.data['rounds']} rounds",
        "bits/byte", f"vs sync, {step(tuned['s'])} (20 → {long.data['rounds']})",
        f"vs ddp (20 → {long.data['rounds']})", "MB in all (of sync's)"], rows)}

{long_findings(long, q, tuned)}"""


def trend(r20: dict | None, ref20: dict, r: dict, ref: dict) -> str:
  now = f"{loss(r) / loss(ref):.3f}"
  return now if r20 is None or r is ref else f"{loss(r20) / loss(ref20):.3f} → {now}"


def long_findings(long: Quality, q: Quality, tuned: dict) -> str:
  ddp, eager, sparse = long["ddp"], long.like(q["eager"]), long.like(q["sparseloco"])
  share = sparse["bytes_per_round"] / tuned["bytes_per_round"]
  low = min(ddp["curve"], key=lambda p: p[1])
  rises = ddp["curve"][-1][1] > low[1]
  gap20, gap = loss(q["sync"]) / loss(q["ddp"]), loss(tuned) / loss(ddp)
  eager20 = loss(q["eager"]) / loss(q["sync"])
  narrow = all(abs(loss(r) / loss(tuned) - 1) < abs(loss(q.like(r)) / loss(q["sync"]) - 1)
               for r in (ddp, eager, sparse))
  return f"""{"Every gap to sync narrows with the budget. " if narrow else ""}
**SparseLoCo ({step(sparse['s'])}) ends
{above(loss(sparse), loss(tuned))} sync ({step(tuned['s'])}), at {pct(share)} of its bytes**
(target: within 1% at ≤ 5%: {verdict(abs(loss(sparse) / loss(tuned) - 1) <= 0.01
                                      and share <= 0.05)}). **Eager ({step(eager['s'])}) ends
{above(loss(eager), loss(tuned))} sync** (target 1%: {verdict(loss(eager) / loss(tuned) <= 1.01)};
{pct(eager20 - 1)} at 20 rounds): its replicas apply the others' pseudo-gradients a round
late, which costs most while they still change fast from round to round. **Sync ends
{above(loss(tuned), loss(ddp))} ddp** (target 1%: {verdict(gap <= 1.01)}; {pct(gap20 - 1)} at
20 rounds): K = 4 replicas taking batch-16 steps against one batch-64 step is the early,
small-model regime in which the DiLoCo papers also measure DiLoCo behind data-parallel
training. {f'''ddp's eval loss was lowest at {low[0] / 1e6:.1f}M tokens ({low[1]:.3f}) and ends
at {ddp['curve'][-1][1]:.3f}: it overfits the small corpus, which favours DiLoCo in these
ratios.''' if rises else ""}"""


def quality_tree(results: Results) -> str:
  tree = Quality(results, "quality_tree")
  long = Quality(results, "quality_long")
  sync, ddp = tree["sync"], tree["ddp"]
  small_sync, small_ddp = long.like(sync), long["ddp"]
  rows = []
  for r in tree.rows:
    small = long.like(r)
    points = ", ".join(f"{p[1]:.3f}" for p in r["curve"][:-1])
    rows.append([label(r["s"]), points, f"{loss(r):.4f}", f"{r['final_eval_bpb']:.3f}",
                 f"{loss(r) / loss(sync):.3f}", f"{loss(r) / loss(ddp):.3f}",
                 f"{loss(small) / loss(small_sync):.3f}, {loss(small) / loss(small_ddp):.3f}"
                 if small else "–"])
  rounds = tree.data["rounds"]
  marks = [round(p[0] / ddp["tokens"] * rounds) for p in ddp["curve"][:-1]]
  eager, sparse = tree["eager"], tree["sparseloco"]
  share = sparse["bytes_per_round"] / sync["bytes_per_round"]
  ddp_q = quarter(ddp)
  small = {name: long.like(tree[name]) for name in ("ddp", "sync", "eager", "sparseloco")}
  gaps = [(("sync", "ddp"), "sync vs ddp"), (("eager", "sync"), "eager vs sync"),
          (("sparseloco", "sync"), "SparseLoCo vs sync")]
  wider = all(loss(tree[a]) / loss(tree[b]) > loss(small[a]) / loss(small[b])
              for (a, b), _ in gaps)
  return f"""### On a larger corpus

`--stdlib=tree`: the same model, budget and configs on every source file of the standard
library's tree but site-packages (prepared on first use into
`~/.cache/diloco_jax/stdlib_tree_bpe4k`), several times the text of the top-level modules,
so the budget repeats it far less often. Its BPE is its own, so the losses compare with
each other, not with the tables above; the last column is the same ratios on the small
corpus (three times the budget, above).

{provenance(results, "quality_tree")}

{table(["method (its config's outer step)",
        f"eval loss after {', '.join(map(str, marks))} rounds", f"eval loss, {rounds} rounds",
        "bits/byte", "vs sync", "vs ddp", "on the small corpus: vs sync, vs ddp"], rows)}

Over the last quarter ddp's eval loss went {ddp_q[0]:.3f} → {ddp_q[1]:.3f}{
    " (still falling: the text is no longer repeated)" if ddp_q[1] < ddp_q[0] else ""}, and
the gaps are {"wider than" if wider else "not all wider than"} on the small corpus: K = 4
sync DiLoCo ends
{above(loss(sync), loss(ddp))} ddp, eager {above(loss(eager), loss(sync))} sync, and
SparseLoCo {above(loss(sparse), loss(sync))} sync at {pct(share)} of its bytes (target:
within 1% at ≤ 5%: {verdict(abs(loss(sparse) / loss(sync) - 1) <= 0.01 and share <= 0.05)}).
At this model size and budget the DiLoCo papers' parity (≥ 1B parameters, H in the
hundreds, long runs) is out of the reach of 2 CPU cores."""


# --- runs as a user runs them -----------------------------------------------------------


def eta(results: Results) -> str:
  d = results("eta")
  rows = []
  for run in d["runs"]:
    judged = run["rows"][:-1]  # the last round's ETA is 0 s: judged in seconds
    worst = max(judged, key=lambda x: abs(x["error"]))
    rows.append([run["run"], f"{judged[0]['round']}–{judged[-1]['round']}",
                 f"{pct(abs(worst['error']))} (round {worst['round']})",
                 pct(run["median_abs_error"]), f"{run['last_round_error_s']:+.3f} s"])
  return f"""## The ETA

`bench/eta.py` runs `{d['config']}` twice as a user would, once to the end and once
preempted and run again (it resumes). For every round a process trains after its first,
the ETA in its record is compared with the time that was actually left, from the moment
the line was printed to the final line. The ETA is the mean time from one steady round's
end to the next (saves included) times the rounds left, plus the last checkpoint's write.

{provenance(results, "eta")}

{table(["run", "rounds judged", "worst |ETA / left − 1|", "median", "last round: ETA − left"],
       rows)}

The error is mostly the machine's: on a shared machine the same round takes longer or
shorter from one minute to the next. The last round's line (`ETA 0s`) is printed once the
final checkpoint is on disk, just before the final line."""


def restart(results: Results) -> str:
  d = results("restart")
  m = d["median"]
  compiled = sorted({r["compiled_anew"] for r in d["runs"]["cache"]})
  rows = [["without the cache (`--compilation_cache=none`)",
           f"{m['no_cache']['start_to_first_step_s']:.2f}", f"{m['no_cache']['wall_s']:.2f}"],
          ["with the cache (default)", f"{m['cache']['start_to_first_step_s']:.2f}",
           f"{m['cache']['wall_s']:.2f}"]]
  return f"""## Restarting after a preemption

`bench/restart.py`: configs/{d['config']}.py's model on the standard library's bytes, one
host, run as a user would. A fresh run is preempted (SIGTERM) right after compiling and so
stops after round 1 with a checkpoint; the same command then runs again, resuming at round
2 and finishing, once with the compilation cache the first run filled (the default) and
once with `--compilation_cache=none`, taking turns {d['repeats']} times on the preempted
workdir put back in place. Medians:

{provenance(results, "restart")}

{table(["resumed run", "start to first step (s)", "whole resumed run (s)"], rows)}

A fresh run's start to first step: {d['fresh']['start_to_first_step_s']:.2f} s. With the cache
the resumed run reaches its first step
{m['no_cache']['start_to_first_step_s'] / m['cache']['start_to_first_step_s']:.1f}× sooner and
compiled {" or ".join(map(str, compiled))} {"program" if compiled == [1] else "programs"}
anew: the final eval, which the
preempted run never reached. The cache's entries are keyed by the cache directory's path
too, so a workdir moved elsewhere compiles again, once."""


CHAOS_EVENTS = {
    "kill": "SIGKILL host {host}",
    "kill_wipe": "SIGKILL host {host} and wipe its workdir",
    "sigterm": "SIGTERM every host",
    "fewer": "resume on {hosts_after} (SIGTERM, restart with one host fewer)",
    "more": "resume on {hosts_after} (SIGTERM, restart with a new host and an old disk)",
}


def chaos(results: Results) -> str:
  d = results("chaos")
  rows = [[i, CHAOS_EVENTS.get(e["kind"], e["kind"]).format(**e), e["reached"],
           e["resumed_from"], e["hosts_after"], f"{e['down_s']:.1f}",
           healed(e["healed"]),
           num(e["heal_bytes"]), f"{e['heal_seconds']:.2f}"]
          for i, e in enumerate(d["events"], 1)]
  heals = [e["heal_seconds"] for e in d["events"] if e["healed"]]
  again = sum(e["rounds_again"] for e in d["events"])
  u = d["uninterrupted"]
  return f"""## Hosts with their own disks, through chaos

`bench/chaos.py`: {d['hosts']} hosts of `launch/local.py --workdir_per_host` (each its own
workdir, nothing shared but the network) train configs/tiny.py for {d['rounds']} rounds of
{d['inner_steps']} inner steps, with the outer state compared across hosts after every
round, through {len(d['events'])} events drawn at random (seed {d['seed']}; every kind once,
then more), each 2 to 5 rounds after the last resume, beside the same run uninterrupted.
"down" is from the event to the restarted job's first round line: the processes starting
Python, jax and the job, the restore, the plan and any heal.

{provenance(results, "chaos")}

{table(["#", "event", "stopped after round", "resumed from", "hosts after", "down (s)",
        "healed", "heal bytes", "heal (s)"], rows)}

{d['events_survived']} of {len(d['events'])} events survived; the run completed
{d['rounds_completed']} of {d['rounds']} rounds with identical anchors on every host, and
{"no round was" if not again else plural(again, "round") + " were"} trained again by host 0's
count.{
    f" A heal's broadcast of the outer state took {min(heals):.2f}–{max(heals):.2f} s."
    if heals else ""} The run took {d['wall_s']:.0f} s against {u['wall_s']:.0f} s
uninterrupted: the restarts. Final eval loss {d['final_eval_loss']:.4f} against
{u['final_eval_loss']:.4f} uninterrupted, not comparable bit for bit by design
(docs/storage.md): replicas restart from the anchor, and rounds on more hosts train on
more tokens."""


def healed(hosts: list[int]) -> str:
  if not hosts:
    return "–"
  return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(map(str, hosts))


def stragglers(results: Results) -> str:
  d = results("stragglers")
  runs = d["runs"]
  rows = [[name, r["rounds"], steps(r), ", ".join(f"{x:.2f}" for x in r["busy_share"]),
           ", ".join(f"{x:.2f}" for x in r["wait_share"]) + "; "
           + ", ".join(f"{x:.2f}" for x in r["wait_share_median"]),
           num(r["tokens_per_sec"]), f"{r['final_eval_loss']:.4f}"] for name, r in runs.items()]
  wall, tokens = d["at_equal_wall"], d["at_equal_tokens"]
  return f"""## Hosts of unequal speed

`bench/stragglers.py`: {d['hosts']} host processes of configs/tiny.py (one replica each,
H = {d['inner_steps']}), each slowed as a machine of its own speed would be
({d['slowdown']}). `fixed` gives every host H steps a round; `speed`
(`balance = 'speed'`) trains the same tokens with each host's steps in proportion to its
measured speed. Shares of host 0's round time, rounds 2 on.

{provenance(results, "stragglers")}

{table(["balance", "rounds", "steps per host", "busy share", "waiting share (mean; median round)",
        "tokens/s", "final eval loss"], rows)}

The job trains **{d['tokens_per_sec_ratio']:.2f}×** the tokens per second. At equal wall time
(speed's end, {wall['seconds']:.0f} s) its eval loss is {wall['speed']:.4f} against fixed's
{wall['fixed']:.4f}; at equal tokens ({tokens['tokens'] / 1e6:.2f}M) {tokens['speed']:.4f}
against {tokens['fixed']:.4f} ({change(tokens['speed'] / tokens['fixed'])}). The rest of a
round is the outer step, the eval every 2 rounds, and once per fast host a recompile of its
inner step (its learning-rate schedule's length)."""


def steps(run: dict) -> str:
  """Each host's steps per round: one value, or its range when `speed` changed it."""
  per_host = zip(*(d["steps"] for d in run["steps_per_host"][1:] or run["steps_per_host"]))
  return ", ".join(span(list(s), str) for s in per_host)


# --- models, memory, data ---------------------------------------------------------------


def models(results: Results) -> str:
  d = results("models")
  c = d["config"]
  by = {r["family"]: r for r in d["rows"]}
  rows = [[r["family"], num(r["params"]), num(r["mlp_dim"]),
           f"{r['flops_per_token'] / 1e6:.1f}", num(r["tokens_per_sec"]),
           f"{r['flops_per_sec'] / 1e9:.1f}"] for r in d["rows"]]
  return f"""## Model families

`bench/models.py`: the `gpt` and `llama` training steps (loss, gradients, AdamW) at equal
parameter count, taking turns round by round: width {c['d_model']}, {c['num_layers']} blocks,
{c['num_heads']} heads, {c['seq_len']} tokens × {c['batch_size']} sequences, vocabulary
{c['vocab_size']:,}, {c['dtype']}; the llama's SwiGLU width is chosen to match the gpt's
parameter count. Median over {d['rounds_timed']} rounds.

{provenance(results, "models")}

{table(["family", "params", "MLP width", "MFLOPs/token", "tokens/s", "GFLOP/s"], rows)}

**llama / gpt = {d['ratio_llama_vs_gpt']:.3f}** in tokens/s on this CPU; llama's FLOPs per
token are {above(by['llama']['flops_per_token'], by['gpt']['flops_per_token'])} gpt's."""


def memory(results: Results) -> str:
  d = results("memory")
  rows = [[f"{os.path.basename(r['config'])[:-len('.py')]} ({count(r['params'])})",
           layout(r), r["sequences_per_device"],
           f"{r['memory_per_device_bytes'] / GIB:.1f} GiB", f"{r['estimate_bytes'] / GIB:.1f} GiB",
           f"{r['memory_per_device_bytes'] / r['estimate_bytes']:.1f}",
           "yes" if r["memory_per_device_bytes"] <= 80e9 else "no"] for r in d["rows"]]
  state = state_shares(d["rows"])
  return f"""## Memory per device under layouts

`bench/memory.py`: the inner step of `configs/llama_150m.py` and `configs/llama_1b.py`
compiled from shapes alone for a host of {d['devices']} devices emulated on the CPU, one
replica per device group (layout: replicas × fsdp), and XLA's plan for one device read from
the compiled program; beside it the analytic estimate that `check_memory` uses.

{provenance(results, "memory")}

{table(["config", "layout (replicas × fsdp)", "sequences per device",
        "XLA:CPU plan per device", "estimate", "plan / estimate", "fits 80 GB (the plan)"],
       rows)}

The state itself (params and AdamW moments) per device: {state}. What dominates is
temporaries: XLA:CPU keeps each layer's attention scores and probabilities in float32
for the backward pass. A GPU's plan (fused attention, bf16 kept as bf16) is smaller;
treat XLA:CPU's as an upper bound of the same order."""


def layout(row: dict) -> str:
  return f"{row['replicas']} × {row['fsdp']}"


def count(params: int) -> str:
  return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def state_shares(rows: list[dict]) -> str:
  """Per config: the state per device sharded over all devices vs one replica per device."""
  parts = []
  for config in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == config]
    lo = min(mine, key=lambda r: r["estimate"]["state"])
    hi = max(mine, key=lambda r: r["estimate"]["state"])
    parts.append(f"{lo['estimate']['state'] / GIB:.2f} GiB under {layout(lo)} against "
                 f"{hi['estimate']['state'] / GIB:.2f} GiB under {layout(hi)} for "
                 f"{os.path.basename(config)[:-len('.py')]}")
  return "; ".join(parts)


def data(results: Results) -> str:
  d = results("data")
  rows = [[p["tokenizer"] + (f" (BPE of {p['vocab_size']:,}, trained first)"
                             if p["tokenizer"] == "train" else ""),
           f"{p['text_mb']:.1f}", f"{p['mb_per_sec']:.2f}", f"{p['tokenize_mb_per_sec']:.2f}",
           num(p["tokens"]), p["workers"]] for p in d["prepare"]]
  loader, demand = d["loader"], d["demand"]
  return f"""## Data

`bench/data.py`: `python -m diloco_jax.prepare`'s throughput on the standard library's
sources (one document per file), once per tokenizer, and the prepared loader's (the real
`HostData` pipeline, one replica, batches of {loader['batch_size']} × {loader['seq_len'] + 1}
tokens, the shards in the page cache), against what `{demand['model']}` consumes on one
H100 at {pct(demand['mfu'], 0)} MFU ({demand['tokens_per_sec']:,.0f} tokens/s at
{demand['flops_per_token'] / 1e6:.1f} MFLOP/token).

{provenance(results, "data")}

{table(["tokenizer", "text MB", "MB/s end to end", "MB/s tokenizing pass", "tokens",
        "workers"], rows)}

The loader reads **{loader['tokens_per_sec'] / 1e6:.1f}M tokens/s** per host,
**{d['ratio']:.1f}×** what `{demand['model']}` consumes on one H100."""


# --- faults -----------------------------------------------------------------------------

# Trials of linkdrop.json that ran code without today's protections (the service sockets'
# TCP_USER_TIMEOUT and the link watchdog), by (file, date): not shown.
LINKDROP_EARLIER = {("linkdrop", "2026-11-23"): {"baseline", "keepconn"}}


def linkdrop(results: Results) -> str:
  d = results("linkdrop")
  earlier = LINKDROP_EARLIER.get(("linkdrop", d["date"]), set())
  rows = [[t["name"], t["setting"], f"{t['drop_s']:g} s", t["side"],
           *(outcome(t["attempts"][0], h) for h in (0, 1)),
           "resumed" if len(t["attempts"]) > 1 else "none",
           "yes" if t["comparison"]["equal"] else "**no**"]
          for t in d["trials"] if t["name"] not in earlier]
  hidden = sorted(t["name"] for t in d["trials"] if t["name"] in earlier)
  shown_trials = [t for t in d["trials"] if t["name"] not in earlier]
  equal = all(t["comparison"]["equal"] for t in shown_trials)
  return f"""## A link drop between hosts

`bench/linkdrop.py`: 2 hosts in network namespaces (`bench/netns.py`, shared with
`bench/wan.py`), configs/tiny.py with one replica per host; one host's link is taken down
for the trial's drop and comes back. It reports each host's exit and the time after the
drop, and compares every round's train loss, eval loss and anchor hash with an
uninterrupted run ("equal"; after a restart when there was one). One run per trial.

{provenance(results, "linkdrop")}

{table(["trial", "setting", "drop", "side", "host 0", "host 1", "restart", "equal"], rows)}
{f'''
Not shown: the file's trials {" and ".join(hidden)}, which ran code without the link
watchdog.
''' if hidden else ""}
A drop shorter than the link timeout is ridden out: the round in flight waits and the run
goes on. A longer one stops every host with "link lost" and exit code 1 at the link
timeout, for a restart to resume. {EQUAL if equal else UNEQUAL}"""


EQUAL = "In every trial, every round's losses and anchor equal the uninterrupted run's."
UNEQUAL = "**Some trials' rounds differ from the uninterrupted run's.**"


def outcome(attempt: dict, host: int) -> str:
  h = next(x for x in attempt["hosts"] if x["host"] == host)
  code, at = h["exit_code"], h["exit_s_after_drop"]
  when = f" at {at:.1f} s" if at is not None else ""
  if code == 0:
    return "ran on; exit 0" + when
  what = "link lost" if h["link_lost_message"] else f"signal {-code}" if code < 0 else "error"
  return f"exit {code}{when}: {what}" if code > 0 else f"{what}{when}"


POISON_ATTACKS = {"none": "its honest Δ", "scaled": "Δ × 1e6",
                  "noise": "Gaussian noise, 100× Δ's std", "nan": "NaN"}
AGGREGATIONS = ("mean", "trimmed_mean", "median")


def poison(results: Results) -> str:
  d = results("poison")
  cell = {(r["attack"], r["aggregation"]): r for r in d["rows"]}
  attacks = list(dict.fromkeys(r["attack"] for r in d["rows"]))
  rows = [[POISON_ATTACKS.get(a, a), *(poison_cell(cell.get((a, g)), d["rounds"])
                                       for g in AGGREGATIONS)] for a in attacks]
  robust = [abs(cell[a, g]["final_eval_loss"] / cell["none", g]["final_eval_loss"] - 1)
            for a in attacks for g in AGGREGATIONS[1:] if (a, g) in cell]
  return f"""## Poisoning

`bench/poison.py`: configs/tiny.py's model and data, K = {d['replicas']} replicas on one host,
{d['rounds']} rounds; replica {d['poisoned_replica']}'s Δ is replaced at every outer step.
Final eval loss per aggregation (trimmed_mean drops one value at each end of the 5):

{provenance(results, "poison")}

{table([f"replica {d['poisoned_replica']} sends", *AGGREGATIONS], rows)}

With the mean, one bad replica ruins the run or, with NaN, stops every outer step; the
trimmed mean and the median stay within {pct(max(robust))} of their clean run's loss in
every case. The mean's protection is the NaN check: a non-finite mean is never applied,
and `outer.max_skipped_rounds` (set past the end here) stops the job."""


def poison_cell(r: dict | None, rounds: int) -> str:
  if r is None:
    return "–"
  value = r["final_eval_loss"]
  text = "NaN" if value != value else f"{value:.4f}"
  skipped = r["skipped_rounds"]
  if skipped:
    text += (f" (all {rounds} rounds skipped)" if skipped == rounds
             else f" ({skipped} rounds skipped)")
  return text


# --- against torchft --------------------------------------------------------------------

PEER_FIGURES = (("tokens/s per replica", "tokens_per_sec_per_replica", "{:,.0f}"),
                ("round (s)", "round_time_s", "{:.2f}"),
                ("outer step (ms)", "outer_time_s", "{:.0f}", 1e3),
                ("first round (s)", "first_round_s", "{:.2f}"),
                ("start-up to first step (s)", "startup_s", "{:.1f}"),
                ("peak RSS per replica process (MiB)", "max_peak_rss_mib", "{:.0f}"),
                ("of it anonymous, peak (MiB)", "max_peak_anon_mib", "{:.0f}"),
                ("train loss, last round", "final_train_loss", "{:.3f}"),
                ("lighthouse process RSS (MiB)", "lighthouse_rss_mib", "{:.0f}"))


def peer(results: Results) -> str:
  d = results("peer")
  c, s = d["config"], d["summary"]
  rows = [[name, *(fmt.format(s[side][key] * (scale[0] if scale else 1))
                   if key in s[side] else "–" for side in ("diloco_jax", "torchft"))]
          for name, key, fmt, *scale in PEER_FIGURES]
  torch = sorted({r["torch"] for r in d["runs"]["torchft"]})
  ratio = d["ratio_tokens_per_sec"]
  return f"""## Against torchft's DiLoCo

`bench/peer.py`: diloco_jax and torchft's `DiLoCo` (PyTorch {", ".join(torch)}, `Manager`,
`ProcessGroupGloo`, a `torchft_lighthouse`; the bench creates a venv of its own for them on
first use) train the same model on the same bytes with the same recipe: configs/peer.py's
bias-free byte-level GPT ({d['params']['diloco_jax']:,} params on both sides; with
diloco_jax's initial params the torch model's logits agree to
{d['same_model']['max_abs_logit_diff']:.1e}), batch {c['batch_size']} × {c['seq_len']} tokens,
AdamW lr 1e-3 (constant), H = {c['inner_steps']}, outer Nesterov 0.7/0.9, the standard
library's top-level modules. K = {c['replicas']}: one process per replica, each pinned to its
own core and computing on one thread. The runs alternate diloco_jax, torchft,
{c['pairs']} pairs of {c['rounds']} rounds; medians over the runs of rounds 2–{c['rounds']}.

{provenance(results, "peer")}

{table(["", "diloco_jax", "torchft"], rows)}

diloco_jax / torchft tokens/s per replica: **{ratio:.2f}** (per pair
{", ".join(f"{x:.2f}" for x in d['pair_ratios'])}; the goal is ≥ 1.0:
{verdict(ratio >= 1.0)}). torchft's outer step includes asking the lighthouse for a
quorum and a commit every round; both sides' vary with how long the faster replica waits
for the slower. diloco_jax's start-up includes compiling the inner step (a resumed run reads it
from the compilation cache: see "Restarting after a preemption"); torchft's excludes the
lighthouse's own. Outer-step and round times are each replica process's view: diloco_jax's
from host 0's metrics.jsonl, torchft's the mean of its two replicas."""


def plan(results: Results) -> str:
  d = results("plan_fit")
  for name in d["measured_files"]:  # the runs it was fitted to and checked on
    results(name[:-len(".json")])
  c, scale = d["constants"], d["at_scale"]
  held = [r for r in d["rows"] if r["held_out"]]
  worst = max(held, key=lambda r: max(abs(r["round_error"]), abs(r["utilization_error"])))

  def err(x: float) -> str:
    return bold(f"{100 * x:+.1f}%", abs(x) > d["tolerance"])

  outside = [r for r in held if max(abs(r["round_error"]), abs(r["utilization_error"]))
             > d["tolerance"]]
  # Each setting measured its compute-only reference before and after its runs: how far
  # apart the two are is the machine's own drift during the setting.
  drift = {r["file"]: max(r["reference_rounds_s"]) / min(r["reference_rounds_s"]) - 1
           for r in d["rows"]}

  def why(r: dict) -> str:
    before, after = r["reference_rounds_s"][0], r["reference_rounds_s"][-1]
    above = (f"; its measured utilization, {r['measured_utilization']:.2f}, is above 100%, "
             "which no run reaches against a steady reference"
             if r["measured_utilization"] > 1 else "")
    return (f"{plan_run(r)}: its setting's reference took {before:.2f} s a round before the "
            f"runs and {after:.2f} s after ({pct(drift[r['file']])} apart){above}")

  explained = (f"Outside {pct(d['tolerance'], 0)}: {'; '.join(why(r) for r in outside)}. "
               if outside else "")
  rows = [[r["run"], r["hosts"], f"{r['rate_mbit']:g}", r["inner_steps"],
           f"{r['measured_round_s']:.2f}", f"{r['predicted_round_s']:.2f}",
           err(r["round_error"]), f"{r['measured_utilization']:.2f}",
           f"{r['predicted_utilization']:.2f}", err(r["utilization_error"]),
           "held out" if r["held_out"] else "fit"] for r in d["rows"]]
  a = scale["assumptions"]
  grid = {(r["model"], r["hosts"], r["mbit"]): r for r in scale["rows"]}
  keys = list(scale["rows"][0]["utilization"])

  def choice(r: dict) -> str:
    x = r["recommended"]
    return (f"{x['mode']}, {x['compression']}, H={x['inner_steps']} "
            f"({pct(x['utilization'])}{'' if x['reaches'] else ': none reaches the target'})")

  scale_rows = [[r["model"], r["hosts"], f"{r['mbit'] / 1e3:g}", f"{r['step_s']:.2f}",
                 *(pct(r["utilization"][k]) for k in keys), choice(r)]
                for r in scale["rows"]]
  big = grid[("10B", 64, 100.0)]
  def gbit(x: float | None) -> str:
    return "unreachable" if x is None else f"{x:.2f}"

  table6 = [[pct(t["target"], 0), f"{t['paper_gbit']:g}", gbit(t["ours_gbit_float32"]),
             gbit(t["ours_gbit_bf16"])] for t in scale["table6"]]
  ratios = [t["ours_gbit_float32"] / t["paper_gbit"] for t in scale["table6"]
            if t["ours_gbit_float32"]]
  intellect = scale["intellect1"]
  return f"""## Predicting a run: the planner

`python -m diloco_jax.plan` predicts a run's round time, compute utilization and bytes per
host (docs/plan.md); `bench/plan.py` fits its constants to {len(d['rows']) - len(held)}
runs of `bench/wan.py` in network namespaces (2 hosts at
{' and '.join(f.split('_')[-1][:-5] for f in d['calibration_files'])} Mbit/s) and checks
it on {len(held)} runs it was not fitted to (the other settings): round time and
utilization, predicted from the constants and each setting's
own compute-only reference. Each host runs on a core of its own (3 hosts: hosts 0 and 2
share one, in the reference too), the runs evaluate only after their last round, and
each setting measures its reference before and after its runs and uses the mean: the two
differed by {pct(min(drift.values()))} to {pct(max(drift.values()))} between settings, the
machine's own drift over a few minutes. {d['held_out_within']} of {len(held)} held-out
runs are within {pct(d['tolerance'], 0)} on both; the worst is {worst['run']} at
{worst['hosts']} hosts, {worst['rate_mbit']:g} Mbit/s ({100 * worst['round_error']:+.1f}%
round time, {100 * worst['utilization_error']:+.1f}% utilization). {explained} Fitted:
{c['round_overhead_s']:.3g} s of per-round work besides the sync (checkpoints, logging,
the round's bookkeeping), an overhead of {c['overhead_s']:.3g} s per sync, a link
efficiency of {c['link_efficiency']:.3g} (payload bytes over shaped bandwidth × time),
{c['codec_s_per_entry']:.3g} s per entry to encode and decode a compressed format, and
{c['async_overhead_s']:.3g} s per round of eager's own cost of running the sum beside the
inner phase; the outer step's {c['outer_s_per_param']:.3g} s per param is
bench/outer_step.py's. That last term was first modelled as a slowdown in proportion to
the inner phase, which fits the calibration runs as well; the held-out runs at H = 50 and
4 Mbit/s showed a fixed cost per round instead, so the form (not its value, which comes
from the calibration runs alone) was chosen after seeing them. Measured utilization here
is the reference's time for a round's steps over the run's round time.

{provenance(results, "plan_fit")} The measured runs, one command per setting:

```sh
{chr(10).join(results(f[:-len(".json")])["command"] for f in d["measured_files"])}
```

{table(["run", "hosts", "Mbit/s", "H", "round s measured", "predicted", "error",
        "utilization measured", "predicted", "error", ""], rows)}

**At scale, on paper.** The same model for {', '.join(scale_models(scale))} models on hosts
of {a['devices_per_host']} H100s ({a['device_tflops']:g} TFLOP/s bf16 each, {pct(a['mfu'], 0)}
MFU, {a['tokens_per_step'] / 1e6:g}M tokens per inner step per host), {a['rtt_ms']:g} ms
round trips, no per-round work besides the sync and a GPU host's outer step
({a['outer_s_per_param'] * 1e9:g} ns per param: the params over PCIe both ways and the
update in host memory); the last column is the setting the
planner recommends: of the modes, formats and H = {', '.join(map(str, a['sweep']['inner_steps']))}
that reach {pct(a['target'], 0)} utilization, the one that departs least from plain
DiLoCo (a step per format coarser than bf16, one for eager, one per doubling of H), or the
one that comes closest.

{table(["model", "hosts", "Gbit/s", "step s", *keys, "recommended"], scale_rows)}

For a 10B model on 64 hosts at 100 Mbit/s the planner recommends {choice(big)}: plain
float32 DiLoCo at H = 100 would spend most of each round waiting
({pct(big['utilization'][keys[0]])} utilization). Beside the scaling-law paper's Table 6
(arXiv 2503.09799: the bandwidth a 10B model at H = 100 needs), the planner's answer for
sync on 8 hosts under the assumptions above:

{table(["utilization", "paper Gbit/s", "planner, float32", "planner, bf16"], table6)}

For float32 the planner asks for {min(ratios):.2f} to {max(ratios):.2f} times the paper's
bandwidth. Most of the gap is the step time: under these assumptions an inner phase is
{grid[('10B', 8, 1000.0)]['step_s'] * 100:.0f} s (100 steps of
{grid[('10B', 8, 1000.0)]['step_s']:.2f} s), and a longer inner phase hides a slower link;
the paper's step time and exchange model are its own, so the ratio says more about the
assumptions than about either model. INTELLECT-1 measured 83-96% compute utilization for a
10B model at H = 100 with an int8 all-reduce on up to 14 nodes across continents; for 14
such hosts the planner puts 83% at {gbit(intellect['0.83'])} Gbit/s and 96% at
{gbit(intellect['0.96'])} Gbit/s per host. These figures extrapolate constants fitted on a
0.1M-param model on 2 CPU cores (the per-sync overhead, the link efficiency, the codec
time, eager's cost per round); the outer step's time per param is an assumption for GPU
hosts (above), not a measurement."""


def plan_run(r: dict) -> str:
  return f"{r['run']} ({r['hosts']} hosts, {r['rate_mbit']:g} Mbit/s)"


def scale_models(scale: dict) -> list[str]:
  return list(dict.fromkeys(r["model"] for r in scale["rows"]))


SECTIONS = (intro, overhead, outer_step, checkpoint, wan, quality, eta, restart, chaos, stragglers,
            models, memory, data, linkdrop, poison, peer, plan)


def render(results_dir: str = RESULTS) -> str:
  """The page's Markdown from the results files in `results_dir`. Raises ResultsError
  naming the file when one lacks its provenance or no section renders it."""
  results = Results(results_dir)
  page = reflow("\n\n".join(section(results) for section in SECTIONS)) + "\n"
  unrendered = sorted(set(results.files) - results.rendered)
  if unrendered:
    raise ResultsError(f"{shown(results.path(unrendered[0]))}: on no section of the page "
                       "(add one to bench/report.py's SECTIONS)")
  return page


# A line that starts like this is Markdown syntax (a list item, a heading, a quote).
MARKUP = re.compile(r"(\d+[.)]|[-+*>#]|=+)(\s|$)")


def reflow(page: str, width: int = 90) -> str:
  """Prose paragraphs filled to `width` (figures of any length land mid-sentence, so the
  source is wrapped again rather than left ragged); tables, code and headings as they are."""
  blocks = [b.strip("\n") for b in re.sub(r"\n{3,}", "\n\n", page).split("\n\n")]
  return "\n\n".join(b if b.startswith(("```", "|", "#")) else fill(" ".join(b.split()), width)
                     for b in blocks)


def fill(text: str, width: int) -> str:
  for w in range(width, width // 2, -1):  # the widest fill whose lines start as prose
    lines = textwrap.wrap(text, w, break_long_words=False, break_on_hyphens=False)
    if not any(MARKUP.match(line) for line in lines):
      break
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group()
  what.add_argument("--write", action="store_true", help=f"write {shown(PAGE)}")
  what.add_argument("--check", action="store_true",
                    help=f"exit 1 if {shown(PAGE)} differs from what --write would write")
  parser.add_argument("--results", default=RESULTS, help="the results directory")
  args = parser.parse_args(argv)
  try:
    page = render(args.results)
  except ResultsError as e:
    print(f"bench/report.py: {e}", file=sys.stderr)
    return 1
  if args.check:
    if current(PAGE) != page:
      print(f"{shown(PAGE)} is stale: run python bench/report.py --write", file=sys.stderr)
      return 1
  elif args.write:
    with open(PAGE, "w", encoding="utf-8") as f:
      f.write(page)
    print(f"wrote {shown(PAGE)}")
  else:
    sys.stdout.write(page)
  return 0


def current(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except FileNotFoundError:
    return None


if __name__ == "__main__":
  sys.exit(main())
