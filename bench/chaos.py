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
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("kill", "kill_wipe", "sigterm", "fewer", "more")
SMOKE_EVENTS = ("fewer", "kill_wipe", "more")
SMOKE_FLAGS = ["--config.model.num_layers=1", "--config.model.d_model=32",
               "--config.model.mlp_dim=64", "--config.model.num_heads=2"]
ROUND = re.compile(r"^\[host 0\] round (\d+)/")
FINAL = re.compile(r"final eval loss ([0-9.]+)")


class Job:
  """One launch of every host; its output lines with their arrival times."""

  def __init__(self, workdir: str, hosts: int, flags: list[str], log):
    self.hosts = hosts
    # the hosts share fate: a host lost stops the job, and the bench starts it again
    cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), f"--hosts={hosts}",
           "--workdir_per_host", "--shared_fate", "--", f"--workdir={workdir}", *flags]
    self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
    self.lines: list[tuple[float, str]] = []
    self.rounds: list[tuple[float, int]] = []  # host 0's round lines
    self._log = log
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      now = time.monotonic()
      self.lines.append((now, line))
      self._log.write(line)
      m = ROUND.match(line)
      if m:
        self.rounds.append((now, int(m.group(1))))

  def last_round(self) -> int:
    return self.rounds[-1][1] if self.rounds else 0

  def wait(self) -> int:
    self.proc.wait()
    self._reader.join()
    return self.proc.returncode

  def text(self) -> str:
    return "".join(line for _, line in self.lines)

  def host_pid(self, host: int) -> int:
    pid = harness.host_pid(self.proc.pid, host)
    if pid is None:
      raise RuntimeError(f"host {host} is not running")
    return pid


def start_info(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, "host0", "run.json")) as f:
      return json.load(f).get("start") or {}
  except (OSError, ValueError):
    return {}


def run(workdir: str, hosts: int, flags: list[str], plan: list[str], rng: random.Random,
        log, rounds: int) -> dict:
  """Trains to the end through the events of `plan`; returns what happened."""
  events, t0, first_hosts = [], time.monotonic(), hosts
  job, resumed = Job(workdir, hosts, flags, log), 0
  for kind in plan:
    target = resumed + rng.randint(2, 5)
    if target > rounds - 8:
      break  # too near the end: a signal could arrive while the run finishes
    while job.last_round() < target and job.proc.poll() is None:
      time.sleep(0.05)
    if job.proc.poll() is not None:
      break  # the run ended first
    victim = rng.randrange(job.hosts)
    t_event = time.monotonic()
    if kind.startswith("kill"):
      os.kill(job.host_pid(victim), signal.SIGKILL)
    else:
      job.proc.send_signal(signal.SIGTERM)
    code = job.wait()
    reached = job.last_round()  # a preemption stops some rounds after the notice
    if kind.startswith("kill") == (code == 0):
      raise RuntimeError(f"{kind}: the launcher exited {code}:\n{job.text()[-3000:]}")
    if kind == "kill_wipe":
      shutil.rmtree(os.path.join(workdir, f"host{victim}"))
    hosts = {"fewer": max(first_hosts - 1, 2), "more": first_hosts + 1}.get(kind, job.hosts)
    job = Job(workdir, hosts, flags, log)
    while not job.rounds and job.proc.poll() is None:
      time.sleep(0.05)
    if not job.rounds:
      raise RuntimeError(f"after {kind}, the job did not train:\n{job.text()[-3000:]}")
    info = start_info(workdir)
    resumed = int(info.get("round", 0))
    events.append({"kind": kind, "host": victim if kind.startswith("kill") else None,
                   "reached": reached, "resumed_from": resumed, "hosts_after": hosts,
                   "checkpoint_hosts": info.get("checkpoint_hosts"),
                   "down_s": job.rounds[0][0] - t_event,
                   "rounds_again": max(reached - resumed, 0),
                   "healed": info.get("hosts_from_anchor", []),
                   "heal_bytes": info.get("heal_bytes", 0),
                   "heal_seconds": info.get("heal_seconds", 0.0)})
    print(f"event {len(events)}: {kind}"
          + (f" host {victim}" if kind.startswith("kill") else "")
          + f" (stopped after round {reached}); resumed from {resumed} on {hosts} hosts"
          + (f", host(s) {events[-1]['healed']} from the anchor" if events[-1]["healed"] else ""),
          flush=True)
  code = job.wait()
  if code != 0:
    raise RuntimeError(f"the last launch failed ({code}):\n{job.text()[-3000:]}")
  final = FINAL.search(job.text())
  return {"events": events, "wall_s": time.monotonic() - t0,
          "final_eval_loss": float(final.group(1)) if final else None, "job": job}


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
  plan = (list(SMOKE_EVENTS) if args.smoke else
          rng.sample(KINDS, min(args.events, len(KINDS)))
          + [rng.choice(KINDS) for _ in range(args.events - len(KINDS))])
  flags = ["--config=configs/tiny.py", "--config.replicas_per_host=1",
           f"--config.num_rounds={args.rounds}", f"--config.inner_steps={args.inner_steps}",
           "--config.inner.warmup_steps=2", "--config.debug_checks=True",
           "--heartbeat_timeout=20", *(SMOKE_FLAGS if args.smoke else [])]
  root = tempfile.mkdtemp(prefix="bench_chaos_")
  # The hosts' output (long: XLA's and gloo's lines too), kept beside a smoke's JSON, else
  # in a temporary directory: bench/results/ holds figures only.
  log_dir = (os.path.dirname(args.out) if args.smoke
             else tempfile.mkdtemp(prefix="bench_chaos_log_"))
  log_path = os.path.join(log_dir, "chaos.log")
  try:
    with open(log_path, "w") as log:
      # --smoke: 5 rounds of the uninterrupted run give its round time, the figure the
      # lost time is counted in (its final loss is then not comparable)
      ref_rounds = 5 if args.smoke else args.rounds
      ref_flags = [f"--config.num_rounds={ref_rounds}" if f.startswith("--config.num_rounds=")
                   else f for f in flags]
      reference = run(os.path.join(root, "reference"), args.hosts, ref_flags, [], rng, log,
                      ref_rounds)
      times = [b[0] - a[0] for a, b in zip(reference["job"].rounds, reference["job"].rounds[1:])]
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
      "rounds_completed": chaos["job"].last_round(), "events": chaos["events"],
      "events_survived": len(chaos["events"]),
      "wall_s": chaos["wall_s"], "final_eval_loss": chaos["final_eval_loss"],
      "uninterrupted": {"wall_s": reference["wall_s"], "round_s": round_s,
                        "final_eval_loss": reference["final_eval_loss"]},
      "log": log_path, **harness.provenance("chaos", argv)}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
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
