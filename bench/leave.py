"""Hosts that leave a live job: the final loss beside an uninterrupted run of the same hosts.

  python -m bench.leave [--modes=sync,delayed,eager,streaming] [--hosts=3] [--rounds=20]
                        [--kills=6:2,12:0] [--out=bench/results/leave.json]
  python -m bench.leave --smoke  # 2 hosts, sync, 4 rounds, host 1 killed after round 2

For each mode, two runs of `configs/tiny.py` (one replica per host) under live membership
(`launch/local.py`, a membership coordinator beside the hosts): one uninterrupted, one
where host h is SIGKILLed as soon as round r's line is printed, for each r:h of --kills. The
survivors train on without restarting. Per run: the final eval loss (of the lowest surviving
host, which evaluates the final model), the replicas in each round's mean, the wall time,
and the seconds from each kill until the survivors' next round line. A survivor's anchor
is compared with the others' every round (debug_checks), so a run that finishes has the
same outer state on every live host in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXTRA = {"streaming": ["--config.outer.fragments=2", "--config.inner_steps=6"]}


def run(mode: str, hosts: int, rounds: int, kills: dict[int, int], workdir: str) -> dict:
  """One live run; `kills`: round -> host to SIGKILL once that round's line is out."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  cmd = [sys.executable, "launch/local.py", f"--hosts={hosts}", "--lease_s=3",
         "--", "--config=configs/tiny.py", f"--workdir={workdir}", f"--config.mode={mode}",
         "--config.replicas_per_host=1", f"--config.num_rounds={rounds}",
         "--config.inner_steps=5", "--config.inner.warmup_steps=5",
         f"--config.eval_every={rounds}", "--config.debug_checks=True",
         "--config.wire_timeout=120", *EXTRA.get(mode, [])]
  t0 = time.monotonic()
  launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
  pending, pids, killed_at, recovered, tail = dict(kills), {}, [], [], []
  for line in launcher.stdout:
    tail = (tail + [line])[-40:]
    if len(pids) < hosts:
      pids.update(harness.host_pids(launcher.pid))
    m = re.search(r"\] round +(\d+)/", line)
    if not m:
      continue
    if killed_at and len(recovered) < len(killed_at):
      recovered.append(time.monotonic() - killed_at[len(recovered)])
    if int(m.group(1)) in pending:
      os.kill(pids[pending.pop(int(m.group(1)))], signal.SIGKILL)
      killed_at.append(time.monotonic())
  launcher.wait()
  wall = time.monotonic() - t0
  if launcher.returncode != 0 or pending:
    raise RuntimeError(f"{mode}: the run failed (exit {launcher.returncode}; kills not "
                       f"made: {pending}):\n{''.join(tail)}")
  survivor = min(set(range(hosts)) - set(kills.values()))
  with open(os.path.join(workdir, f"host{survivor}", "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {"final_eval_loss": records[-1]["eval_loss"], "wall_s": wall,
          "replicas": [r["replicas"] for r in records], "rounds": len(records),
          "kills": {str(r): h for r, h in kills.items()},
          "seconds_to_next_round": recovered}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(__doc__.split("\n\n")[1:]))
  parser.add_argument("--modes", default="sync,delayed,eager,streaming")
  parser.add_argument("--hosts", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--kills", default="6:2,12:0",
                      help="round:host pairs: host is SIGKILLed once round's line is out")
  args = harness.parse_args(parser, "leave", {"modes": "sync", "hosts": 2, "rounds": 4,
                                             "kills": "2:1"}, argv)
  try:
    kills = {int(r): int(h) for r, h in (p.split(":") for p in args.kills.split(","))}
  except ValueError:
    parser.error(f"--kills={args.kills!r}: expected round:host pairs, e.g. 6:2,12:0")
  if args.hosts < 2 or any(not 0 <= h < args.hosts for h in kills.values()):
    parser.error(f"--hosts={args.hosts}, --kills={args.kills}: needs 2 or more hosts and "
                 "kills of hosts 0 .. hosts-1")
  if len(set(kills.values())) >= args.hosts or any(not 1 <= r < args.rounds for r in kills):
    parser.error(f"--kills={args.kills}: a host must survive, and each kill's round must be "
                 f"in 1 .. {args.rounds - 1}")
  rows = []
  for mode in args.modes.split(","):
    with tempfile.TemporaryDirectory(prefix="bench_leave_") as tmp:
      full = run(mode, args.hosts, args.rounds, {}, os.path.join(tmp, "full"))
      left = run(mode, args.hosts, args.rounds, kills, os.path.join(tmp, "left"))
    rows.append({"mode": mode, "uninterrupted": full, "with_kills": left,
                 "loss_ratio": left["final_eval_loss"] / full["final_eval_loss"]})
    print(f"{mode:9s} final eval loss {full['final_eval_loss']:.4f} uninterrupted, "
          f"{left['final_eval_loss']:.4f} with hosts {sorted(kills.values())} killed "
          f"(x{rows[-1]['loss_ratio']:.3f}); replicas {left['replicas']}; next round "
          + ", ".join(f"{s:.1f} s" for s in left["seconds_to_next_round"])
          + " after each kill", flush=True)
  result = {"hosts": args.hosts, "rounds": args.rounds, "rows": rows, "smoke": args.smoke,
            **harness.provenance("leave", argv)}
  harness.write(args.out, result, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
