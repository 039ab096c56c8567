"""Stragglers: hosts of unequal speed under balance 'fixed' and 'speed', the same token budget.

  python -m bench.stragglers [--hosts=3] [--rounds=80] [--fast_quota=0.8] [--slow_quota=0.4]
  python -m bench.stragglers --smoke  # 2 hosts, a few short rounds of a smaller model

Host processes (`python -m diloco_jax.train`, configs/tiny.py with one replica per host)
on this machine's cores, the last host slowed by a real mechanism, not by our code:
  cgroup  every host runs in a cgroup v1 CPU controller group of its own, as a machine of
          its own speed would: a CPU quota of --fast_quota of a core for each host but
          the last, --slow_quota for the last (root, /sys/fs/cgroup/cpu writable). The
          quotas add up to at most the machine's cores, so no host's speed depends on
          how busy the others are (3 hosts on 2 cores: 0.8, 0.8, 0.4).
  share   the last host is pinned to a core it shares with a spinning process (about half
          the core), the others to cores of their own; needs a core per host.
  auto    cgroup where it can be written, else share.
'fixed' trains --rounds rounds of H steps on every host; 'speed' trains the same tokens:
--rounds x hosts / (2 (hosts - 1) + 1) rounds, the fast hosts expected to take 2H (the
steps are measured and decided by the trainer, the tokens are what it reports). Per run,
from its metrics.jsonl: each host's busy and waiting share of the round (the seconds
training, and the seconds until the slowest host's inner phase ended, over host 0's round
time, rounds 2 on), the steps decided, the job's tokens/s over rounds 2 on, and the eval
loss against wall-clock time and against tokens; then speed against fixed at equal wall
time (the shorter run's end) and at equal tokens (the smaller count), each interpolated
on the other run's eval curve. The waiting share is given as the mean over rounds and as
the median round's (the mean includes the rounds before the first decision). Writes
bench/results/stragglers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CGROUP_ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 10_000
SMOKE_FLAGS = ["--config.model.num_layers=1", "--config.model.d_model=32",
               "--config.model.mlp_dim=64", "--config.model.num_heads=2",
               "--config.batch_size=8", "--config.inner.warmup_steps=2"]


class Slowdown:
  """Where each host runs (`preexec(host)`, in the child before it starts) and what slows
  the last one: a cgroup CPU quota or a spinning neighbour on its core."""

  def __init__(self, mechanism: str, hosts: int, fast_quota: float, slow_quota: float):
    self.hosts, self.cores = hosts, sorted(os.sched_getaffinity(0))
    self.quotas = [fast_quota] * (hosts - 1) + [slow_quota]
    writable = os.access(CGROUP_ROOT, os.W_OK)
    self.mechanism = mechanism if mechanism != "auto" else "cgroup" if writable else "share"
    self.groups, self.hog = [], None
    if self.mechanism == "cgroup":
      if not writable:
        raise SystemExit(f"--slowdown=cgroup: {CGROUP_ROOT} is not writable (needs root and "
                         f"the cgroup v1 cpu controller); try --slowdown=share")
      if sum(self.quotas) > len(self.cores) + 1e-9:
        raise SystemExit(f"quotas {self.quotas} add up to more than the {len(self.cores)} "
                         f"core(s): the hosts would slow each other down")
      for h, quota in enumerate(self.quotas):
        group = os.path.join(CGROUP_ROOT, f"diloco_stragglers_{os.getpid()}_host{h}")
        os.makedirs(group, exist_ok=True)
        self.groups.append(group)
        # A 10 ms period (the default is 100 ms): a host throttled in short slices runs at
        # an even speed, as a slower machine does, rather than in 100 ms bursts.
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
          f.write(str(PERIOD_US))
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
          f.write(str(int(quota * PERIOD_US)))
    elif len(self.cores) < hosts:
      raise SystemExit(f"--slowdown=share needs a core per host: {len(self.cores)} core(s) "
                       f"for {hosts} hosts; use --slowdown=cgroup or fewer --hosts")

  def slow_core(self) -> int:
    return self.cores[(self.hosts - 1) % len(self.cores)]

  def start(self) -> None:
    if self.mechanism == "share":
      core = self.slow_core()
      self.hog = subprocess.Popen(
          [sys.executable, "-c", "while True: pass"],
          preexec_fn=lambda: os.sched_setaffinity(0, {core}))

  def preexec(self, host: int):
    def place():
      if self.groups:  # on any core, under its quota
        with open(os.path.join(self.groups[host], "cgroup.procs"), "w") as f:
          f.write(str(os.getpid()))
      else:
        os.sched_setaffinity(0, {self.cores[host % len(self.cores)]})
    return place

  def close(self) -> None:
    if self.hog is not None:
      self.hog.kill()
      self.hog.wait()
    for group in self.groups:
      for _ in range(50):  # its processes have exited; the kernel lets go of them soon
        try:
          os.rmdir(group)
          break
        except OSError:
          time.sleep(0.1)

  def describe(self) -> str:
    if self.mechanism == "cgroup":
      return f"cgroup v1 CPU quotas {self.quotas} of a core, one per host"
    return f"host {self.hosts - 1} shares core {self.slow_core()} with a spinning process"


def train(workdir: str, hosts: int, flags: list[str], slowdown: Slowdown, log) -> list[dict]:
  """One job of `hosts` processes; its records (host 0's metrics.jsonl)."""
  port = harness.free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.train", f"--workdir={workdir}", *flags,
       f"--coordinator_address=127.0.0.1:{port}", f"--num_hosts={hosts}", f"--host_id={h}"],
      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
      preexec_fn=slowdown.preexec(h)) for h in range(hosts)]
  try:
    codes = [p.wait(timeout=1800) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  if any(codes):
    raise SystemExit(f"a host failed (exit codes {codes}); see {log.name}")
  with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def summary(records: list[dict]) -> dict:
  """A run's figures from its records (rounds 2 on: round 1 compiles)."""
  steady = records[1:]
  busy = np.array([r["hosts_busy"] for r in steady])
  idle = np.array([r["hosts_idle"] for r in steady])
  round_s = np.array([r["round_time"] for r in steady])[:, None]
  first, last = records[0], records[-1]
  evals = [(r["elapsed"], r["tokens"], r["eval_loss"]) for r in records if "eval_loss" in r]
  decided = []  # the steps per host, each time they changed
  for r in records:
    if not decided or decided[-1]["steps"] != r["hosts_steps"]:
      decided.append({"from_round": r["round"], "steps": r["hosts_steps"]})
  return {
      "rounds": len(records), "tokens": last["tokens"], "wall_s": last["elapsed"],
      "steps_per_host": decided,
      "busy_share": (busy / round_s).mean(axis=0).round(3).tolist(),
      "wait_share": (idle / round_s).mean(axis=0).round(3).tolist(),
      "wait_share_median": np.median(idle / round_s, axis=0).round(3).tolist(),
      "tokens_per_sec": (last["tokens"] - first["tokens"]) / (last["elapsed"]
                                                              - first["elapsed"]),
      "final_eval_loss": last["eval_loss"],
      "eval_curve": [{"elapsed_s": t, "tokens": n, "eval_loss": loss} for t, n, loss in evals]}


def loss_at(run: dict, key: str, x: float) -> float:
  """The run's eval loss at `x` (seconds or tokens), linearly between its evals."""
  curve = run["eval_curve"]
  return float(np.interp(x, [p[key] for p in curve], [p["eval_loss"] for p in curve]))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=3, help="host processes; the last is slow")
  parser.add_argument("--rounds", type=int, default=80, help="rounds of the 'fixed' run")
  parser.add_argument("--inner_steps", type=int, default=25, help="H")
  parser.add_argument("--fast_quota", type=float, default=0.8,
                      help="cgroup: every other host's CPU quota, in cores")
  parser.add_argument("--slow_quota", type=float, default=0.4,
                      help="cgroup: the slow host's CPU quota, in cores")
  parser.add_argument("--slowdown", choices=("auto", "cgroup", "share"), default="auto",
                      help="how the last host is slowed")
  args = harness.parse_args(parser, "stragglers",
                           dict(hosts=2, rounds=4, inner_steps=2, fast_quota=1.0, slow_quota=0.6),
                           argv)
  if args.hosts < 2:
    parser.error(f"--hosts={args.hosts}: at least 2 (one of them slow)")
  for name in ("fast_quota", "slow_quota"):
    if not 0 < getattr(args, name) <= 1:
      parser.error(f"--{name}={getattr(args, name)}: a share of one core, in (0, 1]")
  speed_rounds = max(round(args.rounds * args.hosts / (2 * (args.hosts - 1) + 1)), 2)
  base = ["--config=configs/tiny.py", "--config.replicas_per_host=1",
          f"--config.inner_steps={args.inner_steps}", "--config.eval_every=2",
          "--config.checkpoint.every=0", "--config.balance_every=2",
          *(SMOKE_FLAGS if args.smoke else [])]
  slowdown = Slowdown(args.slowdown, args.hosts, args.fast_quota, args.slow_quota)
  root = tempfile.mkdtemp(prefix="bench_stragglers_")
  # The hosts' output, kept beside a smoke's JSON, else in a temporary directory:
  # bench/results/ holds figures only.
  log_dir = (os.path.dirname(args.out) if args.smoke
             else tempfile.mkdtemp(prefix="bench_stragglers_log_"))
  log_path = os.path.join(log_dir, "stragglers.log")
  runs = {}
  try:
    slowdown.start()
    with open(log_path, "w") as log:
      for balance, rounds in (("fixed", args.rounds), ("speed", speed_rounds)):
        flags = [*base, f"--config.balance={balance}", f"--config.num_rounds={rounds}"]
        runs[balance] = summary(train(os.path.join(root, balance), args.hosts, flags,
                                      slowdown, log))
        decided = [(d["from_round"], d["steps"]) for d in runs[balance]["steps_per_host"]]
        print(f"{balance}: {rounds} rounds, (from round, steps per host) {decided}, "
              f"{runs[balance]['tokens_per_sec']:,.0f} tok/s, final eval loss "
              f"{runs[balance]['final_eval_loss']:.4f}", flush=True)
  finally:
    slowdown.close()
    shutil.rmtree(root, ignore_errors=True)
  fixed, speed = runs["fixed"], runs["speed"]
  wall = min(fixed["wall_s"], speed["wall_s"])
  tokens = min(fixed["tokens"], speed["tokens"])
  result = {
      "smoke": args.smoke, "hosts": args.hosts, "inner_steps": args.inner_steps,
      "slowdown": slowdown.describe(), "cpu_count": os.cpu_count(),
      "runs": runs,
      "tokens_per_sec_ratio": speed["tokens_per_sec"] / fixed["tokens_per_sec"],
      "at_equal_wall": {"seconds": wall, "fixed": loss_at(fixed, "elapsed_s", wall),
                        "speed": loss_at(speed, "elapsed_s", wall)},
      "at_equal_tokens": {"tokens": tokens, "fixed": loss_at(fixed, "tokens", tokens),
                          "speed": loss_at(speed, "tokens", tokens)},
      **harness.provenance("stragglers", argv)}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{result['slowdown']}; {args.hosts} hosts, H = {args.inner_steps}\n"
        "| balance | rounds | steps per host (last) | busy share per host | waiting share "
        "per host: mean, median round | tokens/s | final eval loss |\n" + "|---" * 7 + "|")
  for name, run in runs.items():
    print(f"| {name} | {run['rounds']} | {run['steps_per_host'][-1]['steps']} | "
          f"{run['busy_share']} | {run['wait_share']}, {run['wait_share_median']} | "
          f"{run['tokens_per_sec']:,.0f} | {run['final_eval_loss']:.4f} |")
  e_w, e_t = result["at_equal_wall"], result["at_equal_tokens"]
  print(f"\nspeed / fixed tokens/s: {result['tokens_per_sec_ratio']:.2f}x; eval loss at "
        f"{e_w['seconds']:.1f} s: speed {e_w['speed']:.4f}, fixed {e_w['fixed']:.4f}; at "
        f"{e_t['tokens']:,} tokens: speed {e_t['speed']:.4f}, fixed {e_t['fixed']:.4f} "
        f"({100 * (e_t['speed'] / e_t['fixed'] - 1):+.2f}%)\nwrote {args.out}")


if __name__ == "__main__":
  main()
