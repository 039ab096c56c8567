"""Figures of live membership: hosts that leave a running job (bench/leave.py), many hosts
on the coordinator and the epoch wire (bench/hosts.py), sync on the epoch wire beside sync
on gloo through slow links (bench/wan.py's live runs), and goodput through churn, live
beside restarts (bench/churn.py)."""

from __future__ import annotations

import statistics

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


def hosts(results: Results) -> dict:
  """Per host count: the commit call's latency, the epoch changes, a sum's time and what
  grows with N; `growth`: each figure at the most hosts over the same at the fewest."""
  d = results("hosts")
  rows = [[r["hosts"], f"{1e3 * r['commit_median_s']:.0f} / {1e3 * r['commit_p90_s']:.0f}",
           f"{r['leave_epoch_change_s']:.2f} / {r['join_epoch_change_s']:.2f}",
           f"{1e3 * r['sum_median_s']:.0f}", f"{1e3 * r['epoch_first_sum_s']:.0f}",
           f"{r['connections_per_host']} ({r['tcp_sockets_per_host']})",
           f"{r['coordinator_requests_per_round']:.0f}", r["frames_per_sum_per_host"]]
          for r in d["rows"]]
  few, most = d["rows"][0], d["rows"][-1]
  growth = {k: most[k] / few[k] for k in (
      "hosts", "commit_median_s", "sum_median_s", "epoch_first_sum_s",
      "coordinator_requests_per_round", "coordinator_cpu_s_per_round")}
  return {**d, "table": rows, "few": few, "most": most, "growth": growth}


def sizes(results: Results) -> dict:
  """The late, slow host with a large state: its figures as table rows, each beside its
  ratio to the wire timeout that stands for 0.1's fixed deadline."""
  d = results("sizes")
  w = d["config"]["wire_timeout"]
  rows = [
      ["the shared state host 2 received, and the seconds it took",
       f"{d['state_bytes'] / 1e6:.0f} MB in {d['transfer_seconds']:.1f} s",
       f"{d['transfer_over_timeout']:.2f}"],
      ["seconds from host 2's start to its join", f"{d['join_after_start_seconds']:.0f}", ""],
      ["host 0's round, median, before / after the join",
       f"{d['round_seconds_before_join']:.1f} / {d['round_seconds_after_join']:.1f} s",
       f"{(d['round_seconds_after_join'] - d['round_seconds_before_join']) / w:.2f}"],
      ["the longest a sum took after the join (waiting for host 2 included)",
       f"{d['longest_sum_wait_seconds']:.1f} s", f"{d['longest_sum_wait_seconds'] / w:.2f}"],
      ["epochs until the stop", "; ".join(
          f"{e['number']}: hosts {', '.join(map(str, e['hosts']))}" for e in d["epochs"]), ""],
      ["host 2's anchor hash equal to host 0's",
       f"{'yes' if d['anchors_equal'] else 'NO'}, in the {d['rounds_shared']} rounds they share",
       ""]]
  return {**d, "table": rows, "state_mb": d["state_bytes"] / 1e6}


def wan_live(results: Results) -> dict:
  """Per rate, the one path's sync (`sync`: host 0 serves the coordinator;
  `sync-live-mac`: a coordinator of its own and a join token) against 0.1's sync on gloo
  (`sync@base`, run from a checkout of it): each run's tokens/s (the mean where a run was
  listed twice) and the ratio."""
  rows, ratios = [], []
  for rate in (0, 8, 32):  # 0: unshaped veths, this machine's own speed
    d = results(f"wan_live_{rate}")
    speed: dict[str, list[float]] = {}
    for r in d["rows"]:
      speed.setdefault(r["mode"], []).append(r["tokens_per_sec"])
    mean = {mode: sum(v) / len(v) for mode, v in speed.items()}
    for mode in ("sync", "sync-live-mac"):
      ratio = mean[mode] / mean["sync@base"]
      ratios.append(ratio)
      rows.append([f"{d['rate_mbit']:g}" if d["rate_mbit"] else "unshaped", mode,
                   f"{mean['sync@base']:,.0f}", f"{mean[mode]:,.0f}", f"{ratio:.2f}",
                   len(speed[mode])])
  return {"table": rows, "lowest": min(ratios), "baseline": results("wan_live_0")["baseline"]}


CHURN_EVENTS = {"kill": "SIGKILL host {host}", "kill_wipe": "SIGKILL host {host}, wipe its disk",
                "leave": "SIGTERM host {host} (it comes back)",
                "freeze": "SIGSTOP host {host} for {freeze_s:g} s",
                "kill_writer": "SIGKILL host {host} (the printing host)",
                "join_new": "host {host} joins (an id never seen before)"}


JOINER_PHASES = ("process", "programs", "checks", "data", "connect", "inner_step", "init",
                 "state", "rehearse", "admitted", "resume", "total")  # run.json, in order


def _taken(event: dict | None) -> str:
  """The compiled programs a live joiner took from a member (bench/churn.py's `programs`)."""
  taken = (event or {}).get("programs")
  if not taken:
    return "–"
  size = taken["bytes"]
  size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
  return f"{taken['files']} ({size}) from host {taken['host']}"


def churn(results: Results) -> dict:
  """Per event, each path's seconds until the job is whole again; per path, goodput, the
  wall time against the uninterrupted run's and the final eval loss."""
  d = results("churn")
  live, restart = d["paths"]["live"]["churn"], d["paths"]["restart"]["churn"]
  steady = _round_s(d["paths"]["live"])
  rows = []
  for i, (kind, host) in enumerate(d["plan"]):
    a = live["events"][i] if i < len(live["events"]) else None
    b = restart["events"][i] if i < len(restart["events"]) else None
    name = CHURN_EVENTS[kind].format(host=(a or b or {}).get("host", host),
                                     freeze_s=d["freeze_s"])
    rows.append([i + 1, name,
                 f"{a['back_s']:.1f}" if a and "back_s" in a else "–",
                 f"{a['state_bytes']:,} from host {a['source']} in {a['transfer_s']:.1f} s"
                 if a and "state_bytes" in a else "–",
                 f"{a['members_round_s'] / steady:.2f}×"
                 if a and steady and "members_round_s" in a else "–",
                 *(f"{a[key] / steady:.1f}×" if a and steady and key in a else "–"
                   for key in ("joined_round_s", "joined_next_round_s")),
                 _taken(a), f"{b['back_s']:.1f}" if b and "back_s" in b else "–"])
  paths = []
  for name in ("live", "restart"):
    p = d["paths"][name]
    ref, run = p["uninterrupted"], p["churn"]
    walls = " and ".join(f"{r['wall_s']:.0f}" for r in _refs(p))
    paths.append([name, f"{run['goodput']:.2f}", f"{run['wall_s']:.0f}", walls,
                  f"{run['rounds_completed']}", len(run["events"]),
                  f"{run['final_eval_loss']:.4f}", f"{ref['final_eval_loss']:.4f}"])
  joins = [e["join_s"] for e in live["events"] if "join_s" in e]
  starts = [e["start_seconds"] for e in live["events"] if e.get("start_seconds")]
  phases = [[name, f"{statistics.median(s.get(name, 0.0) for s in starts):.2f}"]
            for name in JOINER_PHASES if any(name in s for s in starts)]
  return {**d, "table": rows, "paths_table": paths, "joiner_phases": phases,
          "goodput": {n: d["paths"][n]["churn"]["goodput"] for n in ("live", "restart")},
          "joins": (min(joins), max(joins)) if joins else None}


def _refs(path: dict) -> list[dict]:
  """A path's uninterrupted runs: before the churned one and, where measured, after it."""
  return [path["uninterrupted"], *([path["uninterrupted_after"]]
                                   if "uninterrupted_after" in path else [])]


def _round_s(path: dict) -> float | None:
  """The uninterrupted round time: the mean of the runs' medians."""
  times = [r["round_s"] for r in _refs(path) if r.get("round_s")]
  return sum(times) / len(times) if times else None


def churn_uninterrupted(results: Results) -> dict:
  """bench/churn.py's uninterrupted runs on the one path (`live`: that run and the one
  with no event) against 0.1's (`base`: a checkout of it, its hosts on jax.distributed):
  wall times, final eval losses, and 0.1's wall over the one path's mean (above 1: the
  one path is faster)."""
  d = results("churn_uninterrupted")
  live, base = d["paths"]["live"], d["paths"]["base"]["uninterrupted"]
  walls = [live["uninterrupted"]["wall_s"], live["churn"]["wall_s"]]
  mean = sum(walls) / len(walls)
  return {**d, "live_walls": walls, "base_wall": base["wall_s"], "ratio": base["wall_s"] / mean,
          "same_loss": live["uninterrupted"]["final_eval_loss"] == base["final_eval_loss"],
          "loss": base["final_eval_loss"]}
