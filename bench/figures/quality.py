"""Figures of loss against bytes (bench/quality.py): the methods at equal tokens, the outer
step's hyperparameters swept, three times the budget, and a larger corpus.

A row of bench/quality.py records only the flags it added to its config, so its outer step
is its config's as the config was when the file was written: the file's `outer_steps`
records that per config (the configs took the sweep's best outer steps after
quality_sweep.json and quality_long.json were written)."""

from __future__ import annotations

import os

from bench.figures.markdown import bold
from bench.figures.markdown import dec
from bench.figures.markdown import mb
from bench.figures.markdown import pct
from bench.figures.results import Results

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
  """A quality file's rows, each with its settings (`s`), its label and its outer step in
  short (`step`), found by method or by settings."""

  def __init__(self, results: Results, name: str):
    self.name, self.data = name, results(name)
    configs = self.data.get("outer_steps")
    if not isinstance(configs, dict):
      raise results.error(name, "no outer_steps: the outer step (lr, momentum, SparseLoCo's "
                          "topk) of each config its rows ran, as the config had it then")
    for r in self.data["rows"]:
      if r["config"] not in configs:
        raise results.error(name, f"{r['method']}'s {r['config']} has no outer step in the "
                            "file's outer_steps")
    self.rows = []
    for r in self.data["rows"]:
      s = settings(r, configs)
      self.rows.append({**r, "s": s, "label": label(s),
                        "step": None if s["family"] == "ddp" else step(s)})

  def __getitem__(self, method: str) -> dict:
    return next(r for r in self.rows if r["method"] == method)

  def like(self, row: dict) -> dict | None:
    return next((r for r in self.rows if same(r["s"], row["s"])), None)


def loss(row: dict) -> float:
  return row["final_eval_loss"]


def quarter(row: dict) -> tuple[float, float]:
  """Eval loss at three quarters of the run and at its end."""
  curve = row["curve"]
  return curve[len(curve) * 3 // 4 - 1][1], curve[-1][1]


def quality(results: Results) -> dict:
  q, timing = Quality(results, "quality"), Quality(results, "quality_timing")
  inner = {"adamw": timing["sync"]["inner_seconds_per_round"],
           "muon": timing["muloco"]["inner_seconds_per_round"]}
  sync, ddp = q["sync"], q["ddp"]
  link = sync["link_mbit"]
  rows = {r["method"]: {**r, "bytes_share": r["bytes_per_round"] / sync["bytes_per_round"],
                        "utilization": utilization(r, inner, link)} for r in q.rows}
  ddp_q, sync_q = quarter(ddp), quarter(sync)
  return {**q.data, "link": link, "inner": inner, "by": rows,
          "table": [quality_row(r, sync, ddp, inner, link) for r in q.rows],
          "quarter": {"ddp": ddp_q, "sync": sync_q},
          "still_falling": ddp_q[1] < ddp_q[0] and sync_q[1] < sync_q[0],
          # int8's and streaming's loss against sync's, the farther of the two
          "compressed": max(abs(loss(q[m]) / loss(sync) - 1) for m in ("int8", "streaming")),
          "busy": [(r["method"], rows[r["method"]]["utilization"]) for r in q.rows]}


def utilization(row: dict, inner: dict, link: float) -> float:
  """The devices' busy share on a link of `link` Mbit/s: a round's measured inner phase
  against the time its bytes take, which every method but eager waits for."""
  seconds = inner["muon" if row["s"]["family"] == "muloco" else "adamw"]
  comm = row["bytes_per_round"] * 8 / (link * 1e6)
  if row["s"]["family"] == "eager":  # hidden behind the next inner phase, up to its length
    return seconds / max(seconds, comm)
  return seconds / (seconds + comm)


def quality_row(r: dict, sync: dict, ddp: dict, inner: dict, link: float) -> list:
  config = "" if r["config"] == "configs/small_text.py" else f" `{r['config']}`"
  return [r["label"] + config, f"{r['final_eval_loss']:.4f}",
          f"{r['final_eval_bpb']:.3f}", f"{loss(r) / loss(sync):.3f}",
          f"{loss(r) / loss(ddp):.3f}", mb(r["bytes_per_round"]),
          pct(r["bytes_per_round"] / sync["bytes_per_round"], 1),
          f"{r['total_bytes'] / 1e6:,.1f}",
          f"{r['bytes_per_round'] * 8 / (link * 1e6):.2f}", pct(utilization(r, inner, link))]


def sweep(results: Results) -> dict:
  q, sweep = Quality(results, "quality"), Quality(results, "quality_sweep")
  sync, ddp = q["sync"], q["ddp"]
  order = sorted(sweep.rows, key=lambda r: (FAMILIES.index(r["s"]["family"]), loss(r)))
  best = {}
  for r in order:
    best.setdefault(r["s"]["family"], r)
  return {**sweep.data,
          "table": [sweep_row(r, sync, ddp, best[r["s"]["family"]] is r) for r in order],
          "best": [{**r, "reach": reach(r["s"])} for r in best.values()]}


def reach(s: dict) -> float:
  """lr / (1 − μ): how far the outer step moves along a pseudo-gradient that repeats."""
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


def long(results: Results) -> dict:
  q = Quality(results, "quality")
  long, sweep = Quality(results, "quality_long"), Quality(results, "quality_sweep")
  ddp, tuned = long["ddp"], long.like(q["sync"])
  rows = []
  for r in long.rows:
    r20 = q.like(r) or sweep.like(r)  # the same settings at 20 rounds, where they ran
    rows.append([r["label"], f"{loss(r20):.4f}" if r20 else "–", f"{loss(r):.4f}",
                 f"{r['final_eval_bpb']:.3f}", trend(r20, q["sync"], r, tuned),
                 trend(r20, q["ddp"], r, ddp),
                 f"{r['total_bytes'] / 1e6:,.1f} ({pct(r['total_bytes'] / tuned['total_bytes'])})"])
  eager, sparse = long.like(q["eager"]), long.like(q["sparseloco"])
  low = min(ddp["curve"], key=lambda p: p[1])
  return {**long.data, "table": rows, "ddp": ddp, "tuned": tuned, "eager": eager,
          "sparse": sparse,
          "sparse_share": sparse["bytes_per_round"] / tuned["bytes_per_round"],
          "gap20": loss(q["sync"]) / loss(q["ddp"]), "gap": loss(tuned) / loss(ddp),
          "eager20": loss(q["eager"]) / loss(q["sync"]),
          # every method's distance to sync is smaller here than at 20 rounds
          "narrows": all(abs(loss(r) / loss(tuned) - 1)
                         < abs(loss(q.like(r)) / loss(q["sync"]) - 1)
                         for r in (ddp, eager, sparse)),
          "ddp_lowest": low, "ddp_rises": ddp["curve"][-1][1] > low[1]}


def trend(r20: dict | None, ref20: dict, r: dict, ref: dict) -> str:
  now = f"{loss(r) / loss(ref):.3f}"
  return now if r20 is None or r is ref else f"{loss(r20) / loss(ref20):.3f} → {now}"


def tree(results: Results) -> dict:
  tree, long = Quality(results, "quality_tree"), Quality(results, "quality_long")
  sync, ddp = tree["sync"], tree["ddp"]
  small_sync, small_ddp = long.like(sync), long["ddp"]
  rows = []
  for r in tree.rows:
    small = long.like(r)
    points = ", ".join(f"{p[1]:.3f}" for p in r["curve"][:-1])
    rows.append([r["label"], points, f"{loss(r):.4f}", f"{r['final_eval_bpb']:.3f}",
                 f"{loss(r) / loss(sync):.3f}", f"{loss(r) / loss(ddp):.3f}",
                 f"{loss(small) / loss(small_sync):.3f}, {loss(small) / loss(small_ddp):.3f}"
                 if small else "–"])
  rounds = tree.data["rounds"]
  small = {name: long.like(tree[name]) for name in ("ddp", "sync", "eager", "sparseloco")}
  gaps = (("sync", "ddp"), ("eager", "sync"), ("sparseloco", "sync"))
  return {**tree.data, "table": rows, "sync": sync, "ddp": ddp, "eager": tree["eager"],
          "sparse": tree["sparseloco"],
          "sparse_share": tree["sparseloco"]["bytes_per_round"] / sync["bytes_per_round"],
          # the rounds after which the curve's points were taken
          "marks": [round(p[0] / ddp["tokens"] * rounds) for p in ddp["curve"][:-1]],
          "ddp_quarter": quarter(ddp),
          "wider": all(loss(tree[a]) / loss(tree[b]) > loss(small[a]) / loss(small[b])
                       for a, b in gaps)}
