"""Figures of runs as a user runs them and of faults: the ETA, a restart after preemption,
hosts through chaos, hosts of unequal speed, a link drop, poisoned pseudo-gradients, and
the race against torchft."""

from __future__ import annotations

import math

from bench.figures.markdown import num
from bench.figures.markdown import pct
from bench.figures.markdown import span
from bench.figures.results import Results
from bench.figures.results import kept
from bench.figures.results import withdrawals


def eta(results: Results) -> dict:
  d = results("eta")
  rows = []
  for run in d["runs"]:
    judged = run["rows"][:-1]  # the last round's ETA is 0 s: judged in seconds
    worst = max(judged, key=lambda x: abs(x["error"]))
    rows.append([run["run"], f"{judged[0]['round']}–{judged[-1]['round']}",
                 f"{pct(abs(worst['error']))} (round {worst['round']})",
                 pct(run["median_abs_error"]), f"{run['last_round_error_s']:+.3f} s"])
  return {**d, "table": rows}


def restart(results: Results) -> dict:
  d = results("restart")
  m = d["median"]
  return {**d, "compiled": sorted({r["compiled_anew"] for r in d["runs"]["cache"]}),
          "sooner": m["no_cache"]["start_to_first_step_s"] / m["cache"]["start_to_first_step_s"]}


CHAOS_EVENTS = {
    "kill": "SIGKILL host {host}",
    "kill_wipe": "SIGKILL host {host} and wipe its workdir",
    "sigterm": "SIGTERM every host",
    "fewer": "resume on {hosts_after} (SIGTERM, restart with one host fewer)",
    "more": "resume on {hosts_after} (SIGTERM, restart with a new host and an old disk)",
}


def chaos(results: Results) -> dict:
  d = results("chaos")
  rows = [[i, CHAOS_EVENTS.get(e["kind"], e["kind"]).format(**e), e["reached"],
           e["resumed_from"], e["hosts_after"], f"{e['down_s']:.1f}", healed(e["healed"]),
           num(e["heal_bytes"]), f"{e['heal_seconds']:.2f}"]
          for i, e in enumerate(d["events"], 1)]
  heals = [e["heal_seconds"] for e in d["events"] if e["healed"]]
  return {**d, "table": rows, "heals": (min(heals), max(heals)) if heals else None,
          "rounds_again": sum(e["rounds_again"] for e in d["events"])}


def healed(hosts: list[int]) -> str:
  if not hosts:
    return "–"
  return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(map(str, hosts))


def stragglers(results: Results) -> dict:
  d = results("stragglers")
  rows = [[name, r["rounds"], steps(r), ", ".join(f"{x:.2f}" for x in r["busy_share"]),
           ", ".join(f"{x:.2f}" for x in r["wait_share"]) + "; "
           + ", ".join(f"{x:.2f}" for x in r["wait_share_median"]),
           num(r["tokens_per_sec"]), f"{r['final_eval_loss']:.4f}"]
          for name, r in d["runs"].items()]
  return {**d, "table": rows}


def steps(run: dict) -> str:
  """Each host's steps per round: one value, or its range when `speed` changed it."""
  per_host = zip(*(d["steps"] for d in run["steps_per_host"][1:] or run["steps_per_host"]))
  return ", ".join(span(list(s), str) for s in per_host)


def linkdrop(results: Results) -> dict:
  d = results("linkdrop")
  trials = kept(d["trials"])
  rows = [[t["name"], t["setting"], f"{t['drop_s']:g} s", t["side"],
           *(outcome(t["attempts"][0], h) for h in (0, 1)),
           "resumed" if len(t["attempts"]) > 1 else "none",
           "yes" if t["comparison"]["equal"] else "**no**"] for t in trials]
  withdrawn = withdrawals(results, "linkdrop", d["trials"], "name")
  if any(x["figure"] for w in withdrawn for x in w["items"]):
    raise results.error("linkdrop", "withdraws a figure of a trial: the page withdraws "
                        "whole trials only (`withdrawn` on the trial)")
  return {**d, "table": rows, "equal": all(t["comparison"]["equal"] for t in trials),
          # trials withdrawn whole, by reason, their names sorted
          "withdrawn": [{"reason": w["reason"],
                         "trials": sorted(x["run"] for x in w["items"])}
                        for w in withdrawn]}


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


def poison(results: Results) -> dict:
  d = results("poison")
  cell = {(r["attack"], r["aggregation"]): r for r in d["rows"]}
  attacks = list(dict.fromkeys(r["attack"] for r in d["rows"]))
  rows = [[POISON_ATTACKS.get(a, a), *(poison_cell(cell.get((a, g)), d["rounds"])
                                       for g in AGGREGATIONS)] for a in attacks]
  # the robust aggregations' loss under each attack against their clean run's
  robust = [abs(cell[a, g]["final_eval_loss"] / cell["none", g]["final_eval_loss"] - 1)
            for a in attacks for g in AGGREGATIONS[1:] if (a, g) in cell]
  return {**d, "table": rows, "aggregations": AGGREGATIONS, "robust_worst": max(robust)}


def poison_cell(r: dict | None, rounds: int) -> str:
  if r is None:
    return "–"
  value = r["final_eval_loss"]
  text = "NaN" if math.isnan(value) else f"{value:.4f}"
  skipped = r["skipped_rounds"]
  if skipped:
    text += (f" (all {rounds} rounds skipped)" if skipped == rounds
             else f" ({skipped} rounds skipped)")
  return text


PEER_FIGURES = (("tokens/s per replica", "tokens_per_sec_per_replica", "{:,.0f}"),
                ("of the inner steps alone (the round less the sync)",
                 "inner_tokens_per_sec_per_replica", "{:,.0f}"),
                ("round (s)", "round_time_s", "{:.2f}"),
                ("outer step (ms)", "outer_time_s", "{:.0f}", 1e3),
                ("first round (s)", "first_round_s", "{:.2f}"),
                ("start-up to first step (s)", "startup_s", "{:.1f}"),
                ("peak RSS per replica process (MiB)", "max_peak_rss_mib", "{:.0f}"),
                ("of it anonymous, peak (MiB)", "max_peak_anon_mib", "{:.0f}"),
                ("train loss, last round", "final_train_loss", "{:.3f}"),
                ("lighthouse process RSS (MiB)", "lighthouse_rss_mib", "{:.0f}"))


def peer(results: Results) -> dict:
  d = results("peer")
  s = d["summary"]
  rows = [[name, *(fmt.format(s[side][key] * (scale[0] if scale else 1))
                   if key in s[side] else "–" for side in ("diloco_jax", "torchft"))]
          for name, key, fmt, *scale in PEER_FIGURES]
  st = d["startup"]
  startup_rows = [[what, f"{st[key]:.2f}", ", ".join(f"{x:.2f}" for x in st["reps"][key]),
                   f"{st[key] / st['torchft']:.2f}"]
                  for what, key in (("diloco_jax, fresh (an empty compilation cache)",
                                     "diloco_jax_fresh"),
                                    ("diloco_jax, cached (the cache the fresh start filled)",
                                     "diloco_jax_cached"), ("torchft", "torchft"))]
  phases = st.get("phases", {})  # results written before run.json broke a start down
  phase_rows = [[what, *(f"{phases[k][key]:.2f}" for k in ("diloco_jax_fresh",
                                                            "diloco_jax_cached"))]
                for what, key in START_PHASES if phases and key in phases["diloco_jax_fresh"]]
  return {**d, "table": rows, "startup_table": startup_rows, "phase_table": phase_rows,
          "torch": sorted({r["torch"] for r in d["runs"]["torchft"]})}


START_PHASES = (  # (what, the phase's key in run.json's start.seconds; bench/peer.py's)
    ("the launcher, until host 0's process starts", "launcher"),
    ("the process until the trainer builds (interpreter, imports, jax.distributed)",
     "process"),
    ("the config's checks and the memory check (the model's shapes)", "checks"),
    ("the data", "data"),
    ("the hosts' connections, the workdir, the checkpoint store", "connect"),
    ("the inner step: compiled, or loaded whole", "inner_step"),
    ("the model's init", "init"),
    ("the outer state and the replicas' states", "state"),
    ("the checkpoint read (none here) and the trim after compiling", "resume"),
    ("host 0's total, to run.json", "total"),
)


STARTUP_ROWS = (  # (what, the phase's key in startup.json's "phases")
    ("the interpreter (`python -c pass`)", "interpreter"),
    ("imports: jax, flax, optax, orbax, grain, ml_collections", "imports"),
    ("jax's CPU backend (`jax.devices()`, after the imports)", "jax_start"),
    ("the trainer's start-up line, fresh (data, model init, the inner step compiled)",
     "fresh_startup_line"),
    ("its round 1 line, fresh", "fresh_round_line"),
    ("its exit, fresh (the final eval and checkpoint)", "fresh_exit"),
    ("the start-up line, cached (the same compilation cache)", "cached_startup_line"),
    ("its round 1 line, cached", "cached_round_line"),
    ("its exit, cached", "cached_exit"),
    ("the huge-page re-exec (cached exit with it − without it)", "reexec"),
)


def startup(results: Results) -> dict:
  """Where a cold start's seconds go: each phase's median, and the cached start's share of
  the fresh one."""
  d = results("startup")
  p = d["phases"]
  rows = [[what, f"{p[key]:.2f}"] for what, key in STARTUP_ROWS]
  return {**d, "table": rows, "cached_over_fresh": p["cached_round_line"] / p["fresh_round_line"]}
