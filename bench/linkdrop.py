"""A network link drop between hosts: does the run survive it, or stop fast and resume exactly?

  sudo python -m bench.linkdrop [--drop_s=20] [--heartbeat_timeout=100] [--rounds=30]
  python -m bench.linkdrop --smoke  # seconds, no root: 2 hosts on 127.0.0.1, no drop

Builds a bridge and one network namespace per host (bench/netns.py: veth pairs, private
10.x addresses, like bench/wan.py but unshaped), starts the trainer on 2 hosts
(configs/tiny.py, one replica per host, debug checks on, a checkpoint every round), waits
until host 0 prints round `--drop_after_round`, takes host 1's link down for `--drop_s`
seconds (`--side`: `inside`, host 1's own interface in its namespace, or `outside`, its
port on the bridge) and brings it back. It records for every host its exit code, when it
exited relative to the start of the drop, whether its output says "link lost", and its
last lines. If any host failed, it starts every host again with the same command and
workdir (up to `--restarts` times, like `launch/local.py --max_restarts`): the trainer
resumes from its newest checkpoint. Finally it compares train_loss, eval_loss and
anchor_hash of every round (the last record of each round in metrics.jsonl) with an
uninterrupted reference run of the same config on the same network, and prints a table;
the JSON goes to --out.

Settings under test go to every host through `--env KEY=VALUE` (repeatable: e.g.
JAX_ENABLE_RECOVERABILITY=1, XLA_FLAGS=--xla_cpu_collective_timeout_seconds=60,
DILOCO_LINK_TIMEOUT=10) and extra trainer flags after `--`.

Every namespace, veth, bridge and /etc/netns entry made here is removed on exit, also after
an error, Ctrl-C or SIGTERM. Needs root (ip netns); --smoke does not: the hosts are plain
processes on 127.0.0.1, 3 rounds, nothing is dropped, and the comparison must match.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench import harness
from bench.netns import Localhost
from bench.netns import Network

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_HOSTS = 2
ROUND_LINE = re.compile(r"^round (\d+)/(\d+) ")
# One replica per host, small rounds (about a second each here once compiled).
COMMON = ["--config=configs/tiny.py", "--config.replicas_per_host=1",
          "--config.debug_checks=True", "--config.inner_steps=10", "--config.batch_size=8",
          "--config.eval_batches=2", "--config.inner.warmup_steps=5",
          "--config.checkpoint.every=1"]


class Job:
  """Every host of one attempt: processes, timestamped output (also to workdir/logs)."""

  def __init__(self, net, args: list[str], env: dict, port: int, log_prefix: str):
    self.t0 = time.monotonic()
    self.lines: list[list[tuple[float, str]]] = [[] for _ in range(net.num_hosts)]
    self.exited: list[float | None] = [None] * net.num_hosts
    self.procs = []
    self._threads = []
    os.makedirs(os.path.dirname(log_prefix), exist_ok=True)
    for i in range(net.num_hosts):
      cmd = net.command(i, [
          sys.executable, "-m", "diloco_jax.train", *args,
          f"--coordinator_address={net.address(0)}:{port}", f"--num_hosts={net.num_hosts}",
          f"--host_id={i}"])
      proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
      self.procs.append(proc)
      t = threading.Thread(target=self._copy, args=(i, proc, f"{log_prefix}.h{i}.log"),
                           daemon=True)
      t.start()
      self._threads.append(t)

  def _copy(self, host: int, proc: subprocess.Popen, path: str) -> None:
    with open(path, "w") as log:
      for raw in iter(proc.stdout.readline, b""):
        now = time.monotonic()
        line = raw.decode(errors="replace").rstrip("\n")
        self.lines[host].append((now, line))
        log.write(f"{now - self.t0:8.2f} {line}\n")
        log.flush()
    proc.wait()
    self.exited[host] = time.monotonic()

  def last_round(self) -> int:
    for _, line in reversed(self.lines[0]):
      m = ROUND_LINE.match(line)
      if m:
        return int(m.group(1))
    return 0

  def done(self) -> bool:
    return all(t is not None for t in self.exited)

  def failed_early(self) -> bool:
    return any(p.poll() not in (None, 0) for p in self.procs)

  def wait(self, deadline: float) -> bool:
    """True if every host exited before `deadline` (monotonic); else kills the rest."""
    while not self.done() and time.monotonic() < deadline:
      time.sleep(0.05)
    finished = self.done()
    if not finished:
      self.kill()
    return finished

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for p in self.procs:
      p.wait()
    for t in self._threads:
      t.join(timeout=5)


def read_metrics(workdir: str) -> dict[int, dict]:
  """The last record of every round (a resumed run logs the rounds it repeats again)."""
  path = os.path.join(harness.host_dir(workdir), "metrics.jsonl")
  out = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        rec = json.loads(line)
        out[rec["round"]] = rec
  return out


def compare(run: dict[int, dict], ref: dict[int, dict]) -> dict:
  keys = ("train_loss", "eval_loss", "anchor_hash")
  mismatched = [r for r in sorted(ref) if r in run and any(
      run[r].get(k) != ref[r].get(k) for k in keys)]
  missing = [r for r in sorted(ref) if r not in run]
  return {"rounds_compared": len([r for r in ref if r in run]), "mismatched_rounds": mismatched,
          "missing_rounds": missing, "equal": not mismatched and not missing,
          "final": {k: run[max(run)].get(k) for k in keys} if run else None}


def host_report(job: Job, host: int, drop_t: float | None, tail: int) -> dict:
  proc = job.procs[host]
  ex = job.exited[host]
  text = [l for _, l in job.lines[host]]
  lost = [l for l in text if "link lost" in l]
  return {"host": host, "exit_code": proc.returncode,
          "exit_s_after_drop": None if ex is None or drop_t is None else round(ex - drop_t, 2),
          "exit_s_after_start": None if ex is None else round(ex - job.t0, 2),
          "link_lost_message": lost[0] if lost else None,
          "last_lines": text[-tail:]}


def run_trial(net, name: str, args: list[str], env: dict, workdir: str, *, drop: bool,
              drop_after_round: int, drop_s: float, side: str, wait_s: float, restarts: int,
              tail: int, start_timeout: float) -> dict:
  """One job: start, (drop host 1's link), wait; then restarts until done or out of them."""
  trial = {"name": name, "attempts": []}
  logs = os.path.join(workdir, "logs")
  for attempt in range(restarts + 1):
    job = Job(net, [*args, f"--workdir={workdir}"], env, harness.free_port(),
              os.path.join(logs, f"{name}.a{attempt}"))
    drop_t = up_t = None
    try:
      if drop and attempt == 0:
        deadline = time.monotonic() + start_timeout
        while (job.last_round() < drop_after_round and not job.failed_early()
               and not job.done() and time.monotonic() < deadline):
          time.sleep(0.05)
        if job.last_round() >= drop_after_round and not job.done():
          drop_t = time.monotonic()
          net.down(1, side)
          print(f"[{name}] round {job.last_round()}: host 1's link down for {drop_s:g}s",
                flush=True)
          while time.monotonic() < drop_t + drop_s:
            time.sleep(0.05)
          net.up(1, side)
          up_t = time.monotonic()
          print(f"[{name}] link up again", flush=True)
        else:
          print(f"[{name}] training never reached round {drop_after_round}: no drop",
                flush=True)
      finished = job.wait(time.monotonic() + wait_s)
    finally:
      job.kill()
      net.kill_all()
    hosts = [host_report(job, h, drop_t, tail) for h in range(net.num_hosts)]
    a = {"attempt": attempt, "drop": drop_t is not None,
         "link_up_s_after_drop": None if up_t is None else round(up_t - drop_t, 2),
         "finished_in_time": finished, "hosts": hosts}
    if drop_t is not None:
      rounds_before = [int(ROUND_LINE.match(l).group(1)) for t, l in job.lines[0]
                       if t < drop_t and ROUND_LINE.match(l)]
      a["drop_at_round"] = max(rounds_before, default=0)
      a["rounds_after_link_up"] = len([1 for t, l in job.lines[0]
                                       if t > up_t and ROUND_LINE.match(l)])
    resumed = [l for h in range(net.num_hosts) for _, l in job.lines[h]
               if l.startswith("resumed from checkpoint")]
    a["resumed"] = resumed[0] if resumed else None
    trial["attempts"].append(a)
    for h in hosts:
      print(f"[{name}] attempt {attempt} host {h['host']}: exit {h['exit_code']} "
            f"at {h['exit_s_after_drop']}s after the drop; last: "
            f"{(h['last_lines'] or [''])[-1][:200]}", flush=True)
    if finished and all(h["exit_code"] == 0 for h in hosts):
      break
  trial["completed"] = bool(trial["attempts"][-1]["finished_in_time"] and all(
      h["exit_code"] == 0 for h in trial["attempts"][-1]["hosts"]))
  return trial


def parse_env(items: list[str]) -> dict:
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"--env {item!r}: expected KEY=VALUE")
    out[key] = value
  return out


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  extra: list[str] = []
  if "--" in argv:
    split = argv.index("--")
    argv, extra = argv[:split], argv[split + 1:]
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--drop_s", type=float, default=20.0,
                      help="seconds host 1's link stays down")
  parser.add_argument("--heartbeat_timeout", type=int, default=100,
                      help="the trainer's --heartbeat_timeout (seconds)")
  parser.add_argument("--rounds", type=int, default=30, help="rounds of the run")
  parser.add_argument("--drop_after_round", type=int, default=4,
                      help="cut the link once host 0 has printed this round")
  parser.add_argument("--side", choices=("inside", "outside"), default="inside",
                      help="which end of host 1's veth goes down: its own interface in its "
                           "namespace, or its port on the bridge")
  parser.add_argument("--restarts", type=int, default=1,
                      help="after a failed attempt, start every host again this many times")
  parser.add_argument("--wait_s", type=float, default=None,
                      help="after the link is back, wait this long for every host to exit "
                           "before killing them (default: heartbeat_timeout + 90)")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="environment for every host of the trial (repeatable)")
  parser.add_argument("--name", default="trial", help="the trial's name in the table")
  parser.add_argument("--no_reference", action="store_true",
                      help="skip the uninterrupted reference run (no loss comparison)")
  parser.add_argument("--reuse_reference", action="store_true",
                      help="reuse --workdir's reference run if it has every round")
  parser.add_argument("--subnet", type=int, default=78, help="10.78.<subnet>.0/24")
  parser.add_argument("--workdir", default="", help="keep workdirs and host logs here")
  parser.add_argument("--tail", type=int, default=6, help="output lines kept per host")
  args = harness.parse_args(parser, "linkdrop",
                           dict(rounds=3, drop_s=0.0, drop_after_round=1, restarts=0),
                           argv)
  if not args.smoke and os.geteuid() != 0:
    sys.exit("bench/linkdrop.py needs root: it creates network namespaces (--smoke does not)")
  if args.wait_s is None:
    args.wait_s = args.heartbeat_timeout + 90.0
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
         "DILOCO_INSECURE": "1",  # namespaces of private addresses: no join token
         **parse_env(args.env)}
  ref_env = {k: v for k, v in env.items() if k not in parse_env(args.env)}
  train_args = [*COMMON, f"--config.num_rounds={args.rounds}",
                f"--heartbeat_timeout={args.heartbeat_timeout}",
                "--initialization_timeout=120", *extra]
  if args.smoke:
    train_args += ["--config.model.num_layers=1", "--config.inner_steps=2",
                   "--config.batch_size=2", "--config.eval_batches=1",
                   "--config.inner.warmup_steps=1"]
  network = (Localhost(NUM_HOSTS) if args.smoke
             else Network(NUM_HOSTS, f"10.78.{args.subnet}", tag="ld"))
  common = dict(drop_after_round=args.drop_after_round, drop_s=args.drop_s, side=args.side,
                tail=args.tail, start_timeout=600.0)
  with network as net, tempfile.TemporaryDirectory() as scratch:
    root = args.workdir or scratch
    ref = None
    ref_dir = os.path.join(root, "reference")
    if args.reuse_reference and len(read_metrics(ref_dir)) == args.rounds:
      ref = {"completed": True, "reused": ref_dir}
      print(f"reusing the reference run in {ref_dir}", flush=True)
    elif not args.no_reference:
      shutil.rmtree(ref_dir, ignore_errors=True)
      ref = run_trial(net, "reference", train_args, ref_env, os.path.join(root, "reference"),
                      drop=False, wait_s=600.0, restarts=0, **common)
      if not ref["completed"]:
        sys.exit(f"the reference run failed: {json.dumps(ref['attempts'][-1], indent=1)}")
    shutil.rmtree(os.path.join(root, args.name), ignore_errors=True)
    trial = run_trial(net, args.name, train_args, env, os.path.join(root, args.name),
                      drop=not args.smoke and args.drop_s > 0,
                      wait_s=args.drop_s + args.wait_s, restarts=args.restarts, **common)
    if ref is not None:
      trial["comparison"] = compare(read_metrics(os.path.join(root, args.name)),
                                    read_metrics(os.path.join(root, "reference")))
  result = {"drop_s": args.drop_s, "heartbeat_timeout": args.heartbeat_timeout,
            "rounds": args.rounds, "side": args.side, "smoke": args.smoke,
            "env": parse_env(args.env), "train_args": train_args, "trial": trial,
            "reference_completed": None if ref is None else ref["completed"],
            **harness.provenance("linkdrop", [*argv, *(["--", *extra] if extra else [])])}
  harness.write(args.out, result, indent=2)
  print(f"\n{args.name}: drop {args.drop_s:g}s ({args.side}), heartbeat timeout "
        f"{args.heartbeat_timeout}s, env {parse_env(args.env) or '-'}")
  print("| attempt | host | exit code | exit s after drop | 'link lost' | last line |\n"
        "|---|---|---|---|---|---|")
  for a in trial["attempts"]:
    for h in a["hosts"]:
      last = (h["last_lines"] or [""])[-1][:90].replace("|", "/")
      print(f"| {a['attempt']} | {h['host']} | {h['exit_code']} | {h['exit_s_after_drop']} | "
            f"{'yes' if h['link_lost_message'] else 'no'} | {last} |")
  if "comparison" in trial:
    c = trial["comparison"]
    print(f"completed: {trial['completed']}; rounds compared with the uninterrupted run: "
          f"{c['rounds_compared']}; equal (train/eval loss, anchor hash): {c['equal']}"
          + (f"; mismatched rounds {c['mismatched_rounds']}" if c["mismatched_rounds"] else "")
          + (f"; missing rounds {c['missing_rounds']}" if c["missing_rounds"] else ""))
  print(f"wrote {args.out}")
  if args.smoke and not (trial["completed"] and trial.get("comparison", {}).get("equal")):
    sys.exit("smoke: the run did not complete equal to the reference")


if __name__ == "__main__":
  main()
