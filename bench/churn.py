"""Goodput under churn: the same events on a live job and on a job that restarts.

  python -m bench.churn [--hosts=4] [--rounds=240] [--events=10] [--seed=0]
  python -m bench.churn --smoke   # 3 hosts, 120 rounds, two events (kill_wipe, join_new) per path

Two paths train configs/tiny.py on hosts with a workdir each (`launch/local.py
--workdir_per_host`, the outer state compared across hosts every round), each first
uninterrupted, then through one list of events drawn at random (seed; every kind once, then
more), the next event a few rounds after the job is whole again:

  kill         SIGKILL a host (a lost machine).
  kill_wipe    the same, and its workdir deleted (a new machine in its place).
  leave        SIGTERM to one host (a spot preemption notice); the machine comes back.
  freeze       SIGSTOP a host for --freeze_s (longer than a lease), then SIGCONT.
  kill_writer  SIGKILL the host that prints and writes the run's lines (the lowest live one).
  join_new     one host more, an id never seen before (at most once per run).

live      `--rejoin_after=1`: the coordinator beside the hosts; a host that dies or leaves is
          dropped, the others train on, and the launcher starts it again: it joins at a
          round boundary. The job's ids go up to --hosts + 1 (`--max_hosts`); join_new is a
          SIGUSR1 to the launcher, which starts the spare id, and it joins the same way.
restart   `--shared_fate`: a host's exit stops every host, and the same command starts all
          of them again from their checkpoints; a leave and a join_new stop every host with
          its checkpoint (SIGTERM to the launcher), and a join_new starts one host more. A
          frozen host stalls the others until it wakes, or, frozen longer than its lease,
          is dropped and joins again when it wakes (no host exits).

Every host id computes within a CPU quota of its own, the same for each (bench/cpushare.py;
--no-quota: all on every core): a joiner's compile cannot take the members' cores, and a host
that is away leaves its share unused, as a machine of its own would.

Goodput = the tokens the job kept (every round once, times the replicas that took part) ÷
the tokens the uninterrupted run would have trained meanwhile: its tokens/s per host × the
host-seconds the job had (the --hosts hosts for the whole wall time; after a join_new one
more, from its event on), as Decoupled DiLoCo counts it. (--no-quota: the uninterrupted
run's tokens/s × the wall time, whatever the hosts: on shared cores a host more adds
replicas, not tokens/s.) Per event: the seconds until the job is whole again ("back": the
joiner's line on the live path, the restarted job's first round line on the other), a
joiner's start to its join and the state it received, and the members' round time while it
was away (`members_round_s`, the median from the second round after the event; the first,
`first_round_s`, waited for the lost host), the round after the join, which is the
joiner's catch-up round (`joined_round_s`), and the next, its first trained
(`joined_next_round_s`), each read from a member's records, beside the uninterrupted
run's (`round_s`), and where the joiner's start went, by phase (`start_seconds`, from its
run.json), with the compiled programs it took from a member (`programs`). On the live path
every host keeps its compilation cache in its own workdir, whatever the environment says.
The uninterrupted run is measured before the churned one and again after it (--refs=2, not
with --smoke or --events=0), and goodput is against both together (their tokens over their
host-seconds): a shared machine's speed drifts by a few percent within half an hour, which
one run before would count as churn's (`goodput_each`: against each alone).
Writes bench/results/churn.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

from bench import cpushare
from bench import harness
from bench import jobs

KINDS = ("kill", "kill_wipe", "leave", "freeze", "kill_writer", "join_new")
ONCE = ("join_new",)  # one spare host id
SMOKE_EVENTS = ("kill_wipe", "join_new")
JOINED = re.compile(r"^\[host (\d+)\] host \d+ joined at round (\d+): state ([0-9.]+) (\w+) "
                    r"from host (\d+) in ([0-9.]+) s")
PHASES = ("process", "programs", "checks", "data", "connect", "inner_step", "init", "state",
          "rehearse", "admitted", "resume", "total")  # a joiner's run.json, in start order
UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class Quotas:
  """Every trainer whose command line names `marker` (this bench's directory), moved into
  the cgroup of its host id as soon as it is seen (`cpushare.Placement`: the same CPU quota
  for each id): a joiner that compiles cannot take the members' cores, and a host that is
  away leaves its share unused, as on a machine of its own."""

  def __init__(self, placement: cpushare.Placement, marker: str):
    self.placement, self.marker = placement, marker
    self._seen: dict[str, float] = {}  # pid -> when first seen (a fork may exec later)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._follow, daemon=True)
    if placement.quota:
      self._thread.start()

  def _follow(self) -> None:
    while not self._stop.wait(0.02):
      now = time.monotonic()
      for pid in os.listdir("/proc"):
        first = self._seen.setdefault(pid, now)
        if not pid.isdigit() or now - first > 2.0:
          continue  # decided: not a host (a host is moved on its first sight as one)
        found = harness.trainer(pid)
        if found and any(self.marker in a for a in found[1]):
          try:
            self.placement.place(found[0], int(pid))
          except OSError:
            continue  # gone already
          self._seen[pid] = -1e9

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()


def launcher(workdir: str, hosts: int, flags: list[str], live: bool,
             spare: bool = False, baseline: str | None = None) -> subprocess.Popen:
  """`spare` (live): one host id more, started on a SIGUSR1 to the launcher. `baseline`:
  the checkout of another version, whose launcher runs its default (0.1: the hosts on
  jax.distributed, sharing fate)."""
  extra = (["--lease_s=3", "--rejoin_after=1", "--max_restarts=1000",
            *([f"--max_hosts={hosts + 1}", "--join_later=-1"] if spare else [])] if live
           else ["--shared_fate"])  # the restart path: a host lost stops the job
  if not baseline:  # live: each host's own compilation cache, in its workdir, as on a
    # machine of its own (not a smoke run's shared one): a wiped host or a new id has none
    # and takes the members' programs (membership/programs.py)
    return jobs.launch(workdir, hosts, flags, extra,
                       env={"JAX_COMPILATION_CACHE_DIR": ""} if live else None)
  # 0.1 named the wire's timeout after its elastic switch
  flags = [f.replace("--config.wire_timeout=", "--config.elastic_timeout=") for f in flags]
  return jobs.launch(workdir, hosts, flags, [], repo=baseline, env={"PYTHONPATH": baseline})


def records(workdir: str, hosts: int, besides: int | None = None) -> dict[int, dict]:
  """Every round's record, from whichever host has it (the same figures on every host but
  the times: `besides`, a host whose records are not read, a joiner's of its own rounds)."""
  out = {}
  for h in range(hosts):
    if h == besides:
      continue
    try:
      with open(os.path.join(workdir, f"host{h}", "metrics.jsonl")) as f:
        for line in f:
          if line.strip():
            r = json.loads(line)
            out.setdefault(r["round"], r)
    except OSError:
      continue
  return out


def kept_tokens(recs: dict[int, dict], num_hosts: int, hosts_from: list[tuple[int, int]]
                ) -> float:
  """Σ over rounds of the replicas that took part × one replica's tokens of a round. Live
  records count the replicas; a fixed job's rounds had every host of the job that trained
  them (`hosts_from`: (first round, hosts) of each start). `num_hosts`: the host ids the
  job was started with (a record's tokens count one replica on each)."""
  first = recs.get(1)
  if not first:
    return 0.0
  per_replica = first["tokens"] / num_hosts  # tokens after round 1, over the job's ids
  def fixed(r: int) -> int:
    return next(h for start, h in reversed(hosts_from) if start <= r)
  return sum(rec.get("replicas", fixed(r)) * per_replica for r, rec in recs.items())


def run(path: str, workdir: str, hosts: int, flags: list[str], plan: list[tuple[str, int]],
        log, freeze_s: float, rng: random.Random, spare: bool = False,
        baseline: str | None = None) -> dict:
  """Trains on `path` ('live' or 'restart'; 'base': the --baseline checkout's default,
  uninterrupted) through `plan`; what happened. `spare` (live): the job has one host id
  more, which only a join_new starts."""
  live, out = path == "live", jobs.Output(log)
  t0 = time.monotonic()
  job = launcher(workdir, hosts, flags, live, spare, baseline if path == "base" else None)
  out.follow(job)
  events, added = [], []  # added: when each join_new came
  back_round, now_hosts, hosts_from = 0, hosts, [(1, hosts)]
  for kind, victim in plan:
    if not jobs.wait_round(out, job, back_round + rng.randint(2, 5)):
      break
    r, writer = out.last_round()
    victim = {"kill_writer": writer, "join_new": hosts}.get(kind, victim)
    pid = harness.host_pid(job.pid, victim) if kind != "join_new" else job.pid
    if pid is None:
      break
    t_event = time.monotonic()
    if kind == "join_new":  # live: the launcher starts the spare id; else all stop
      added.append(t_event)
    jobs.strike(kind, job, pid, workdir, victim, live, freeze_s)
    event = {"kind": kind, "host": victim, "round": r}
    if live:  # the launcher starts the host again (a host that left, too) and it joins
      joined = _wait_joined(out, job, victim, t_event)
      if joined is None:
        events.append(event)
        break
      when, r_joined, size, source, seconds = joined
      event.update(back_s=when - t_event, joined_at=r_joined, join_s=when - t_event,
                   state_bytes=size, source=source, transfer_s=seconds)
      start = _joiner_start(workdir, victim, r_joined)
      event.update(start_seconds=start.get("seconds"), programs=start.get("programs"))
      back_round = r_joined
    else:
      back = None
      if kind == "freeze":  # the others waited for it, or dropped it (frozen past its
        back = jobs.next_round(out, job, t_event + freeze_s)  # lease) and it joins again
      if back is None:  # the job stopped whole, every host with its checkpoint (a kill:
        now_hosts += kind == "join_new"  # but the victim's), and starts again
        job, back, _ = jobs.restart(out, job, kind, functools.partial(
            launcher, workdir, now_hosts, flags, live=False))
      if back is None:
        events.append(event)
        break
      event.update(back_s=back[0] - t_event, resumed_at=back[1])
      back_round = back[1]
      if now_hosts != hosts_from[-1][1]:
        hosts_from.append((back[1], now_hosts))
    events.append(event)
    phases = event.get("start_seconds") or {}
    print(f"{path}: {kind} host {victim} after round {r}; whole again in "
          f"{event['back_s']:.1f} s" + (" (its start: " + ", ".join(
              f"{k} {phases[k]:.1f}" for k in PHASES if k in phases) + " s)" if phases else ""),
          flush=True)
  code = out.finish(job, timeout=10)
  end = time.monotonic()
  wall = end - t0
  recs = records(workdir, hosts + 1)
  for event in events:  # the members' rounds while the host was away (not the first: it
    away = range(event["round"] + 2, event.get("joined_at", 0) + 1)  # waited for the lost)
    members = records(workdir, hosts + 1, besides=event["host"])
    times = [members[r]["round_time"] for r in away if "round_time" in members.get(r, {})]
    if times:
      event["members_round_s"] = statistics.median(times)
    if "round_time" in members.get(event["round"] + 1, {}):
      event["first_round_s"] = members[event["round"] + 1]["round_time"]
    # the members' round after the join (the joiner's catch-up round) and the next (its
    # first trained): what the transfer and the joiner's first sums cost them
    for key, r in (("joined_round_s", 1), ("joined_next_round_s", 2)):
      after = members.get(event.get("joined_at", -3) + r, {})
      if "round_time" in after:
        event[key] = after["round_time"]
  steady = [rec["round_time"] for r, rec in recs.items() if r > 2 and "round_time" in rec]
  return {"wall_s": wall, "exit": code, "rounds_completed": max(recs, default=0),
          "kept_tokens": kept_tokens(recs, hosts + (live and spare), hosts_from),
          "host_seconds": hosts * wall + sum(end - t for t in added),
          "round_s": statistics.median(steady) if steady else None, "events": events,
          "final_eval_loss": out.final_eval_loss()}


def _wait_joined(out: jobs.Output, job, host: int, since: float):
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and job.poll() is None:
    for when, line in out.since(since):
      m = JOINED.match(line)
      if m and int(m.group(1)) == host:
        size = float(m.group(3)) * UNITS.get(m.group(4), 1)
        return when, int(m.group(2)), int(size), int(m.group(5)), float(m.group(6))
    time.sleep(0.1)
  return None


def _joiner_start(workdir: str, host: int, joined_at: int) -> dict:
  """The joiner's run.json `start`, written once it has the members' state: where its start
  went, by phase (`seconds`: the process, its build, the programs it took from a member,
  its rehearsal, the wait to be admitted, the state received) and the compiled programs it
  took (`programs`); {} if it is not written within a few seconds."""
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      with open(os.path.join(workdir, f"host{host}", "run.json")) as f:
        start = json.load(f).get("start", {})
      if start.get("joined", {}).get("round") == joined_at:
        return start
    except (OSError, ValueError):
      pass
    time.sleep(0.2)
  return {}


def pooled(refs: list[dict]) -> dict:
  """Uninterrupted runs as one: their tokens, host-seconds and wall time summed."""
  return {key: sum(r[key] for r in refs) for key in ("kept_tokens", "host_seconds", "wall_s")}


def goodput(ref: dict, churn: dict, quota: bool) -> float:
  """The tokens `churn` kept ÷ those the uninterrupted run `ref` would have trained in the
  same time. With a quota per host id, the hosts the job had (a join_new adds one from its
  event on: `host_seconds`) at the uninterrupted run's tokens/s per host; without, cores
  every host shares: the job's tokens/s whatever its hosts."""
  if quota:
    return churn["kept_tokens"] / (ref["kept_tokens"] / ref["host_seconds"]
                                   * churn["host_seconds"])
  return churn["kept_tokens"] / (ref["kept_tokens"] / ref["wall_s"] * churn["wall_s"])


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=4, help="hosts of the job")
  parser.add_argument("--rounds", type=int, default=240, help="rounds of each run")
  parser.add_argument("--inner_steps", type=int, default=5, help="inner steps per round")
  parser.add_argument("--events", type=int, default=10, help="events (--smoke: 2 fixed)")
  parser.add_argument("--freeze_s", type=float, default=8.0,
                      help="how long a frozen host stays stopped (longer than the 3 s lease)")
  parser.add_argument("--paths", default="live,restart",
                      help="live, restart, or both; and base: --baseline's uninterrupted run")
  parser.add_argument("--baseline", default=None,
                      help="a checkout of another diloco_jax version (e.g. `git worktree add "
                           "/tmp/base 7bb7343`), whose uninterrupted run is path base")
  parser.add_argument("--seed", type=int, default=0, help="of the events and their victims")
  parser.add_argument("--refs", type=int, choices=(1, 2), default=2,
                      help="uninterrupted runs per path: 2, before and after the churned one "
                           "(--smoke and --events=0: 1)")
  parser.add_argument("--quota", action=argparse.BooleanOptionalAction, default=True,
                      help="each host id an equal CPU quota (bench/cpushare.py; root and the "
                           "cgroup cpu controller) where the ids outnumber the cores; "
                           "--no-quota: every host on every core (never in --smoke)")
  args = harness.parse_args(parser, "churn", dict(hosts=3, rounds=120, inner_steps=5), argv)
  paths = [p for p in args.paths.split(",") if p]
  if args.hosts < 2 or not paths or set(paths) - {"live", "restart", "base"}:
    parser.error("--hosts must be >= 2 and --paths a list of live, restart, base")
  if "base" in paths and not args.baseline:
    parser.error("--paths=...,base needs --baseline=DIR, a checkout of diloco_jax")
  rng = random.Random(args.seed)
  kinds = list(SMOKE_EVENTS) if args.smoke else jobs.draw(KINDS, args.events, rng, ONCE)
  plan = [(kind, rng.randrange(args.hosts)) for kind in kinds]
  flags = jobs.flags(args, "--config.wire_timeout=120")
  root = tempfile.mkdtemp(prefix="bench_churn_")
  spare_id = any(kind in ONCE for kind, _ in plan)
  placement = cpushare.Placement(args.hosts + spare_id, args.quota and not args.smoke)
  log_path = jobs.log_path(args, "churn")
  result = {"smoke": args.smoke, "hosts": args.hosts, "rounds": args.rounds,
            "inner_steps": args.inner_steps, "seed": args.seed, "freeze_s": args.freeze_s,
            "cpu_count": os.cpu_count(), "plan": [list(p) for p in plan], "paths": {},
            "log": log_path, "placement": placement.describe(),
            "quota": placement.share if placement.quota else None}
  quotas = None
  try:
    with open(log_path, "w") as log, placement:
      quotas = Quotas(placement, root)
      for path in paths:
        # live: both runs with the spare id the plan's join_new starts (the same job)
        spare = any(kind in ONCE for kind, _ in plan) and path != "base"
        ref = run(path, os.path.join(root, f"{path}_ref"), args.hosts, flags, [], log,
                  args.freeze_s, random.Random(args.seed), spare, args.baseline)
        if path == "base":  # the other version's uninterrupted run alone
          result["paths"][path] = {"uninterrupted": ref, "baseline": args.baseline}
          print(f"{path}: uninterrupted {ref['wall_s']:.1f} s", flush=True)
          continue
        churn = run(path, os.path.join(root, path), args.hosts, flags, plan, log,
                    args.freeze_s, random.Random(args.seed + 1), spare)
        refs = [ref]
        if args.refs > 1 and plan and not args.smoke:  # the machine's drift, both ways
          refs.append(run(path, os.path.join(root, f"{path}_ref_after"), args.hosts, flags,
                          [], log, args.freeze_s, random.Random(args.seed), spare))
        churn["goodput"] = goodput(pooled(refs), churn, placement.quota)
        churn["goodput_each"] = [goodput(r, churn, placement.quota) for r in refs]
        result["paths"][path] = {"uninterrupted": ref, "churn": churn,
                                 **({"uninterrupted_after": refs[1]} if len(refs) > 1 else {})}
        walls = " and ".join(f"{r['wall_s']:.1f}" for r in refs)
        print(f"{path}: uninterrupted {walls} s; "
              f"through {len(churn['events'])} events {churn['wall_s']:.1f} s, goodput "
              f"{churn['goodput']:.2f}" + (" (against each: " + ", ".join(
                  f"{g:.2f}" for g in churn["goodput_each"]) + ")" if len(refs) > 1 else "")
              + f", final eval loss {churn['final_eval_loss']} (uninterrupted "
              f"{ref['final_eval_loss']})", flush=True)
        if path == "live" and ref["round_s"]:
          away = [f"{e['kind']} {e['members_round_s'] / ref['round_s']:.2f}"
                  for e in churn["events"] if "members_round_s" in e]
          print(f"{path}: the members' round time while a host was away, against "
                f"uninterrupted ({ref['round_s'] * 1000:.0f} ms): {', '.join(away)}",
                flush=True)
      quotas.close()  # (before the cgroups go: the last host processes have ended)
  finally:
    if quotas is not None:
      quotas.close()
    shutil.rmtree(root, ignore_errors=True)
  result.update(harness.provenance("churn", argv))
  harness.write(args.out, result, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
