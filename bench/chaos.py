"""Chaos: a run on hosts with disks of their own, through random failures, beside an
uninterrupted one.

  python -m bench.chaos [--hosts=4] [--rounds=60] [--events=6] [--seed=0]
  python -m bench.chaos --smoke  # 3 hosts, 50 short rounds, three fixed events: on 2
                                 # hosts, kill+wipe one, on 4 hosts (the uninterrupted
                                 # run: 5 rounds, for its round time)

Hosts are processes of `launch/local.py --workdir_per_host` (each host its own workdir,
nothing shared but the network) training configs/tiny.py with debug_checks on (the outer
state is compared across hosts after every round: a run that goes on has identical
anchors on every host). After a random 2 to 5 rounds past the last resume, an event
(every kind once, in random order, then random ones):

  kill        SIGKILL one host; the job stops; the same hosts are started again.
  kill_wipe   SIGKILL one host and delete its workdir (a new machine in its place); the
              job is started again and that host heals from a peer.
  sigterm     SIGTERM every host (a preemption notice): checkpoint, exit 0, start again.
  fewer       SIGTERM every host, then start one host fewer than at first (4 -> 3; never
              fewer than 2): the highest host id is gone.
  more        SIGTERM every host, then start one more than at first (4 -> 5): a host id
              never seen has an empty disk, one seen before keeps its old disk, whose
              checkpoints are older; both heal.

Per event: the last round host 0 printed before the job stopped, the round the restarted
job resumed from, the seconds from the event to the next round's line (`down_s`), the
rounds trained again (host 0 prints a round's line once the next is under way, so this
can miss one), the wall time lost (down_s + rounds trained again x the uninterrupted
run's median round time), and the bytes and seconds of any heal (host 0's run.json). Then the rounds
completed, the events survived and the final eval loss beside the uninterrupted run's
(not equal after a heal or a host-count change: docs/storage.md). Writes
bench/results/chaos.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from bench import harness
from bench import jobs

KINDS = ("kill", "kill_wipe", "sigterm", "fewer", "more")
SMOKE_EVENTS = ("fewer", "kill_wipe", "more")


def start_info(workdir: str) -> dict:
  """What host 0's run.json says of the job's start: the round it resumed from, the hosts
  whose checkpoints it found, and any heal."""
  try:
    with open(os.path.join(workdir, "host0", "run.json")) as f:
      return json.load(f).get("start") or {}
  except (OSError, ValueError):
    return {}


def run(workdir: str, hosts: int, flags: list[str], plan: list[str], rng: random.Random,
        log, rounds: int) -> dict:
  """Trains to the end through the events of `plan`; returns what happened."""
  events, t0, first_hosts, out = [], time.monotonic(), hosts, jobs.Output(log)
  # the hosts share fate: a host lost stops the job, and the bench starts it again
  launch = functools.partial(jobs.launch, workdir, flags=flags, extra=["--shared_fate"])
  job, resumed = launch(hosts), 0
  out.follow(job)
  for kind in plan:
    target = resumed + rng.randint(2, 5)
    if target > rounds - 8 or not jobs.wait_round(out, job, target):
      break  # too near the end (a signal could arrive as the run finishes), or it ended
    victim = rng.randrange(hosts)
    pid = harness.host_pid(job.pid, victim) if kind.startswith("kill") else None
    if kind.startswith("kill") and pid is None:
      raise RuntimeError(f"host {victim} is not running")
    t_event = time.monotonic()
    jobs.strike(kind, job, pid, workdir, victim, live=False)
    hosts = {"fewer": max(first_hosts - 1, 2), "more": first_hosts + 1}.get(kind, hosts)
    job, back, reached = jobs.restart(out, job, kind, functools.partial(launch, hosts))
    if back is None:
      raise RuntimeError(f"after {kind}, the job did not train:\n{out.text()[-3000:]}")
    info = start_info(workdir)
    resumed = int(info.get("round", 0))
    events.append({"kind": kind, "host": victim if kind.startswith("kill") else None,
                   "reached": reached, "resumed_from": resumed, "hosts_after": hosts,
                   "checkpoint_hosts": info.get("checkpoint_hosts"),
                   "down_s": back[0] - t_event,
                   "rounds_again": max(reached - resumed, 0),
                   "healed": info.get("hosts_from_anchor", []),
                   "heal_bytes": info.get("heal_bytes", 0),
                   "heal_seconds": info.get("heal_seconds", 0.0)})
    print(f"event {len(events)}: {kind}"
          + (f" host {victim}" if kind.startswith("kill") else "")
          + f" (stopped after round {reached}); resumed from {resumed} on {hosts} hosts"
          + (f", host(s) {events[-1]['healed']} from the anchor" if events[-1]["healed"] else ""),
          flush=True)
  code = out.finish(job)
  if code != 0:
    raise RuntimeError(f"the last launch failed ({code}):\n{out.text()[-3000:]}")
  return {"events": events, "wall_s": time.monotonic() - t0, "rounds": out.rounds(),
          "final_eval_loss": out.final_eval_loss()}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=4, help="hosts at the start")
  parser.add_argument("--rounds", type=int, default=60, help="rounds of the run")
  parser.add_argument("--inner_steps", type=int, default=5, help="inner steps per round")
  parser.add_argument("--events", type=int, default=6, help="random events (--smoke: 3 fixed)")
  parser.add_argument("--seed", type=int, default=0, help="of the events and their victims")
  args = harness.parse_args(parser, "chaos", dict(hosts=3, rounds=50, inner_steps=2), argv)
  if args.hosts < 2:
    parser.error(f"--hosts={args.hosts}: at least 2")
  rng = random.Random(args.seed)
  # Every kind once (in random order) when there are enough events, then random ones.
  plan = list(SMOKE_EVENTS) if args.smoke else jobs.draw(KINDS, args.events, rng)
  flags = jobs.flags(args)
  root = tempfile.mkdtemp(prefix="bench_chaos_")
  log_path = jobs.log_path(args, "chaos")
  try:
    with open(log_path, "w") as log:
      # --smoke: 5 rounds of the uninterrupted run give its round time, the figure the
      # lost time is counted in (its final loss is then not comparable)
      ref_rounds = 5 if args.smoke else args.rounds
      ref_flags = [f"--config.num_rounds={ref_rounds}" if f.startswith("--config.num_rounds=")
                   else f for f in flags]
      reference = run(os.path.join(root, "reference"), args.hosts, ref_flags, [], rng, log,
                      ref_rounds)
      times = [b[0] - a[0] for a, b in zip(reference["rounds"], reference["rounds"][1:])]
      round_s = statistics.median(times) if times else 0.0
      print(f"uninterrupted: {ref_rounds} rounds in {reference['wall_s']:.1f} s, final eval "
            f"loss {reference['final_eval_loss']}", flush=True)
      chaos = run(os.path.join(root, "chaos"), args.hosts, flags, plan, rng, log,
                  args.rounds)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  for e in chaos["events"]:
    e["lost_s"] = e["down_s"] + e["rounds_again"] * round_s
  result = {
      "smoke": args.smoke, "hosts": args.hosts, "rounds": args.rounds,
      "inner_steps": args.inner_steps, "seed": args.seed, "cpu_count": os.cpu_count(),
      "rounds_completed": chaos["rounds"][-1][1] if chaos["rounds"] else 0,
      "events": chaos["events"],
      "events_survived": len(chaos["events"]),
      "wall_s": chaos["wall_s"], "final_eval_loss": chaos["final_eval_loss"],
      "uninterrupted": {"wall_s": reference["wall_s"], "round_s": round_s,
                        "final_eval_loss": reference["final_eval_loss"]},
      "log": log_path, **harness.provenance("chaos", argv)}
  harness.write(args.out, result, indent=2)
  print("\n| # | event | after round | resumed from | hosts after | down (s) | rounds again "
        "| lost (s) | healed | heal bytes | heal (s) |\n" + "|---" * 11 + "|")
  for i, e in enumerate(chaos["events"], 1):
    print(f"| {i} | {e['kind']}{'' if e['host'] is None else ' host %d' % e['host']} | "
          f"{e['reached']} | {e['resumed_from']} | {e['hosts_after']} | {e['down_s']:.1f} | "
          f"{e['rounds_again']} | {e['lost_s']:.1f} | {e['healed'] or '-'} | "
          f"{e['heal_bytes']:,} | {e['heal_seconds']:.2f} |")
  print(f"\n{result['rounds_completed']}/{args.rounds} rounds, {len(chaos['events'])} events "
        f"survived, {chaos['wall_s']:.1f} s (uninterrupted {reference['wall_s']:.1f} s); final "
        f"eval loss {chaos['final_eval_loss']} (uninterrupted "
        f"{reference['final_eval_loss']}); wrote {args.out}")


if __name__ == "__main__":
  main()
