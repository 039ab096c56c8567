"""Real sizes on a live job: a late host takes a large state through a slow link, then trains
three times slower than the others; nobody may be evicted.

  sudo python -m bench.sizes [--rate=100] [--d_model=448] [--layers=6] [--late_s=90]
                             [--slow=3] [--wire_timeout=5] [--rounds_after=3]
  python -m bench.sizes --smoke  # seconds, no root: a tiny model on 127.0.0.1, unshaped

Three hosts, each in its own network namespace behind a veth of --rate Mbit/s each way
(bench/netns.py), with a membership coordinator beside host 0 and a join token (so the
seals and MACs of a real deployment are paid). Hosts 0 and 1 start the job (`--min_hosts=2`);
host 2 is started --late_s seconds later, registers, is admitted at a round boundary and
takes the shared state (anchor and outer momentum, float32) from the members through its
link; it then trains under a CPU quota --slow times smaller than theirs (a cgroup's CFS
limit, as bench/stragglers.py sets), so the others wait for it at every sum. After
--rounds_after rounds of host 2, a SIGTERM to the coordinator stops the job, every host
after the same round.

What 7bb7343 would have done is measured against --wire_timeout (the fixed deadline of a
cross-host op then: 60 s; here shorter, with the model and the rate chosen so that the
ratios of a 1 GB state at 100 Mbit/s to 60 s hold): a transfer longer than it made the
joiner accuse its source; a host later than it at a sum was evicted. Now the deadlines
follow progress (docs/fault-tolerance.md). Figures: the state's bytes and transfer seconds
(and their ratio to --wire_timeout), the seconds from host 2's start to its join, host 0's
median round before and after the join and the longest wait at a sum after it (over
--wire_timeout), and the checks: every host exits 0, the coordinator opened exactly two
epochs (nobody left), and host 2's anchor hash equals the others' in every round they share.
Writes bench/results/sizes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import harness
from bench.netns import Localhost
from bench.netns import Network
from bench.stragglers import Slowdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKEN = "bench-sizes-join-token-0123456789abcdef"
HOSTS = 3
JOINED = re.compile(r"host 2 joined at round (\d+): state .* from host (\d+) in ([\d.]+) s")


class Host:
  """One host's process and the lines it printed (read by a thread of its own)."""

  def __init__(self, argv: list[str], env: dict, preexec):
    self.started = time.monotonic()
    self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
    self.lines: list[str] = []
    self.joined_at: float | None = None  # when its join line came
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      if self.joined_at is None and JOINED.search(line):
        self.joined_at = time.monotonic()
      self.lines.append(line)

  def wait(self, timeout: float) -> int:
    code = self.proc.wait(timeout=timeout)
    self._reader.join(10)
    return code

  @property
  def text(self) -> str:
    return "".join(self.lines)


def records(workdir: str, host: int) -> list[dict]:
  with open(os.path.join(workdir, f"host{host}", "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def run(args, net, slowdown: Slowdown | None, workdir: str) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
         "DILOCO_JOIN_TOKEN": TOKEN}
  port = net.port()
  coordinator = Host(net.command(0, [
      sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={port}",
      f"--max_hosts={HOSTS}", f"--bind={net.address(0)}", "--lease_s=10"]), env, None)
  model = [f"--config.model.d_model={args.d_model}", f"--config.model.num_layers={args.layers}",
           f"--config.model.mlp_dim={4 * args.d_model}",
           f"--config.model.num_heads={max(1, args.d_model // 64)}"]
  train = [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
           f"--workdir={workdir}", "--config.replicas_per_host=1", "--config.batch_size=8",
           "--config.num_rounds=10000", f"--config.inner_steps={args.inner_steps}",
           "--config.eval_every=100000", "--config.outer.compression=4bit",
           "--config.anchor_check_every=1",  # every host hashes its anchor every round
           f"--config.wire_timeout={args.wire_timeout}", *model,
           f"--membership={net.address(0)}:{port}", f"--num_hosts={HOSTS}", "--min_hosts=2",
           "--initialization_timeout=600"]
  place = (lambda h: slowdown.preexec(h)) if slowdown else (lambda h: None)
  hosts = [Host(net.command(h, [*train, f"--host_id={h}"]), env, place(h)) for h in (0, 1)]
  t0 = time.monotonic()
  try:
    while time.monotonic() - t0 < args.late_s:
      for h, host in enumerate(hosts):
        if host.proc.poll() is not None:
          raise RuntimeError(f"host {h} ended before host 2 started:\n{host.text[-3000:]}")
      time.sleep(0.5)
    hosts.append(Host(net.command(2, [*train, "--host_id=2"]), env, place(2)))
    deadline = time.monotonic() + args.deadline_s
    joined = None
    while time.monotonic() < deadline:
      joined = joined or JOINED.search(hosts[2].text)
      done = joined and _rounds(workdir, 2) >= int(joined.group(1)) + args.rounds_after
      if joined and done:
        break
      if any(h.proc.poll() is not None for h in hosts):
        break
      time.sleep(0.5)
    coordinator.proc.send_signal(signal.SIGTERM)  # every host stops after the same round
    codes = [h.wait(600) for h in hosts]
  finally:
    for proc in [h.proc for h in hosts] + [coordinator.proc]:
      if proc.poll() is None:
        proc.kill()
    net.kill_all()
  coordinator.wait(30)
  for h, code in enumerate(codes):
    if code != 0:
      raise RuntimeError(f"host {h} exited {code}:\n{hosts[h].text[-4000:]}")
  if not joined:
    raise RuntimeError(f"host 2 never joined:\n{hosts[2].text[-4000:]}")
  # the epochs until the stop (then the hosts leave, one by one): a host dropped, for any
  # reason, is an epoch with fewer hosts than the one before
  running = coordinator.text.split("stopping the job")[0]
  epochs = [(int(n), [int(x) for x in h.split(",")])
            for n, h in re.findall(r"coordinator: epoch (\d+): hosts ([\d,]+)", running)]
  mine = [records(workdir, h) for h in range(HOSTS)]
  by_round = {r["round"]: r.get("anchor_hash") for r in mine[0]}
  shared = [r for r in mine[2] if by_round.get(r["round"]) and r.get("anchor_hash")]
  join_round = int(joined.group(1))
  before = [r["round_time"] for r in mine[0] if 2 <= r["round"] <= join_round]
  after = [r for r in mine[0] if r["round"] > join_round + 1]
  with open(os.path.join(workdir, "host2", "run.json")) as f:
    state_bytes = json.load(f)
  transfer_s = float(joined.group(3))
  return {
      "exit_codes": codes,
      "epochs": [{"number": n, "hosts": h} for n, h in epochs],
      "nobody_evicted": all(set(a[1]) <= set(b[1]) for a, b in zip(epochs, epochs[1:]))
      and epochs[-1][1] == list(range(HOSTS)),
      "anchors_equal": bool(shared) and all(by_round[r["round"]] == r["anchor_hash"]
                                            for r in shared),
      "rounds_shared": len(shared),
      "join_round": join_round,
      "state_bytes": _joined_bytes(state_bytes),
      "transfer_seconds": transfer_s,
      "transfer_over_timeout": transfer_s / args.wire_timeout,
      "join_after_start_seconds": _join_after(hosts[2]),
      "round_seconds_before_join": statistics.median(before) if before else None,
      "round_seconds_after_join": (statistics.median(r["round_time"] for r in after)
                                   if after else None),
      "longest_sum_wait_seconds": max((r.get("collective_time", 0.0) for r in after),
                                      default=None),
  }


def _rounds(workdir: str, host: int) -> int:
  """The last round in `host`'s records (every live host writes its own), 0 before any."""
  try:
    return max((r["round"] for r in records(workdir, host)), default=0)
  except (OSError, ValueError):  # not written yet, or a line being written
    return 0


def _joined_bytes(run_json: dict):
  """The bytes of the state host 2 received (run.json's start.joined)."""
  start = run_json.get("start", {})
  return (start.get("joined") or {}).get("bytes")


def _join_after(host: Host) -> float | None:
  """Seconds from the joiner's start to its join line (the lines are timed as they come)."""
  return None if host.joined_at is None else host.joined_at - host.started


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(__doc__.split("\n\n")[1:]))
  parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s each way per host")
  parser.add_argument("--d_model", type=int, default=448)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--inner_steps", type=int, default=4)
  parser.add_argument("--late_s", type=float, default=90.0,
                      help="seconds between the first hosts' start and host 2's")
  parser.add_argument("--slow", type=float, default=3.0,
                      help="host 2's CPU quota is the others' over this")
  parser.add_argument("--fast_quota", type=float, default=0.8,
                      help="hosts 0 and 1's CPU quota, of a core each")
  parser.add_argument("--wire_timeout", type=int, default=5)
  parser.add_argument("--rounds_after", type=int, default=3,
                      help="host 2's rounds before the job is stopped")
  parser.add_argument("--deadline_s", type=float, default=1200.0,
                      help="the most seconds from host 2's start to the job's stop")
  parser.add_argument("--subnet", type=int, default=83, help="10.77.<subnet>.0/24")
  args = harness.parse_args(parser, "sizes", {
      "d_model": 32, "layers": 1, "inner_steps": 2, "late_s": 5, "rounds_after": 2,
      "wire_timeout": 30, "deadline_s": 240}, argv)
  if args.slow < 1 or not 0 < args.fast_quota <= 1:
    parser.error(f"--slow={args.slow} must be >= 1 and --fast_quota={args.fast_quota} in (0, 1]")
  slowdown = None
  if not args.smoke:
    slowdown = Slowdown("cgroup", HOSTS, args.fast_quota, args.fast_quota / args.slow)
    # host 2, the last, is the slow one; hosts 0 and 1 the fast ones
  net = (Localhost(HOSTS) if args.smoke
         else Network(HOSTS, f"10.77.{args.subnet}", args.rate, tag="sz"))
  try:
    with net, tempfile.TemporaryDirectory(prefix="bench_sizes_") as tmp:
      if slowdown:
        slowdown.start()
      row = run(args, net, slowdown, tmp)
  finally:
    if slowdown:
      slowdown.close()
  result = {"config": {k: getattr(args, k) for k in (
      "rate", "d_model", "layers", "inner_steps", "late_s", "slow", "fast_quota",
      "wire_timeout", "rounds_after")},
      "slowdown": (f"cgroup v1 CPU quotas of {args.fast_quota:g}, {args.fast_quota:g} and "
                   f"{args.fast_quota / args.slow:.2f} of a core" if slowdown else "none (smoke)"),
      **row, "smoke": args.smoke, **harness.provenance("sizes", argv)}
  harness.write(args.out, result, indent=2)
  print(f"state {row['state_bytes']} bytes to host 2 in {row['transfer_seconds']:.1f} s "
        f"({row['transfer_over_timeout']:.2f}x the {args.wire_timeout:g} s timeout); joined at "
        f"round {row['join_round']}; host 0's round {row['round_seconds_before_join']} s "
        f"before, {row['round_seconds_after_join']} s after; longest wait at a sum "
        f"{row['longest_sum_wait_seconds']} s; epochs {row['epochs']}; nobody evicted: "
        f"{row['nobody_evicted']}; anchors equal over {row['rounds_shared']} rounds: "
        f"{row['anchors_equal']}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
