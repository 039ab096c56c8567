"""Many hosts: the live-membership coordinator and the epoch wire with N host processes.

  python -m bench.hosts [--hosts=16,32] [--rounds=12] [--mb=4] [--lease_s=10]
                        [--out=bench/results/hosts.json]
  python -m bench.hosts --smoke  # 4 and 6 hosts, 6 rounds of 0.5 MB

No JAX and no model: per N, a coordinator process (`python -m
diloco_jax.membership.coordinator`, loopback, no join token) and N host processes, each of
which imports only diloco_jax.membership.{client,lease} and diloco_jax.wire.* (checked: no
host has `jax` in sys.modules at its end). membership/collective.py, the trainer's loop
around these, imports wire/collective.py, which imports jax, so each host runs that loop
itself here: per round one `Peers.allreduce_sum` of --mb MB of float32 among the current
epoch's members, then `Lease.commit` (voted a round boundary, so it can admit a joiner);
a failed sum is a not-ok vote and the op is redone in the epoch the verdict names. After
round rounds/3 host N-1 leaves cleanly (`Lease.close`); once host 0 has committed round
2·rounds/3 a new host (id N) registers and is admitted at the next commit.

Per N: the commit call's latency (median, p90, over every committed op on every host), the
seconds from the leave (the join's registration) to the first round every member committed
in the new epoch, a sum's median seconds, and what grows with N: sockets per host (N−1
PUSH + 1 PULL; the TCP socket fds are counted too), requests the coordinator answers per
round (every host's commit polls and heartbeats, counted by each host) and frames per sum
per host (counted from the wire's header bytes; the formula beside it). Host h's input to
op s is v_h·(s+1), v_h fixed random float32; every host's result of every committed op is
compared bit for bit with numpy's float32 sum over that epoch's members in host order
(`sums_exact`).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AFTER = 3  # rounds the hosts run after the joiner's admission


def host_vector(host: int, size: int) -> np.ndarray:
  return np.random.default_rng([7, host]).standard_normal(size, np.float32)


def worker(spec: dict) -> None:
  """One host: register, sum and commit every round, leave (or join late); writes its
  records to DIR/host<id>.json."""
  # pylint: disable=import-outside-toplevel
  from diloco_jax.membership import client as client_lib
  from diloco_jax.membership import lease as lease_lib
  from diloco_jax.wire import frames
  from diloco_jax.wire.epoch import PeerError
  from diloco_jax.wire.epoch import WireError
  from diloco_jax.wire.peers import Peers
  requests = collections.Counter()  # every request this host makes of the coordinator
  ask = client_lib.Client._ask  # pylint: disable=protected-access

  def counted(self, body, what):
    requests[body["op"]] += 1
    return ask(self, body, what)
  client_lib.Client._ask = counted  # (in this process only)
  me, role, rounds, work = spec["host"], spec["role"], spec["rounds"], spec["dir"]
  progress = os.path.join(work, "progress")
  out = {"host": me, "role": role, "records": [], "epochs": {}}
  if role == "joiner":  # waits for host 0 to reach the join round (its progress file)
    while int(open(progress).read() if os.path.exists(progress) else 0) < spec["join_round"]:
      time.sleep(0.02)
  lease = lease_lib.Lease.start(spec["coordinator"], host=me, num_hosts=spec["hosts"],
                                token=None, timeout_s=spec["timeout_s"])
  if lease.joining:  # the job runs: pending, admitted at the members' next boundary
    out["event_s"] = time.monotonic()
    lease.join()
    out["admitted_s"] = time.monotonic()
  epoch, step, peers = lease.epoch, lease.epoch.first_step, None
  # The last op: every host agrees on it from the commit that admits the joiner (the same
  # verdict on every member), AFTER ops later; until then the members run on, however long
  # the joiner's start takes.
  end = max(rounds, step + AFTER) if role == "joiner" else None
  mine = host_vector(me, spec["size"])
  say = lambda line: print(line, file=sys.stderr, flush=True)
  requests.clear()  # from here on: the rounds' requests (not the start's waiting heartbeats)
  while end is None or step < end:
    if role == "leaver" and step == spec["leave_round"]:
      out["event_s"], out["event_epoch"] = time.monotonic(), epoch.number
      break
    out["epochs"][epoch.number] = list(epoch.hosts)
    x = mine * np.float32(step + 1)
    ok, suspect, digest, framed = True, None, None, 0
    t0 = time.monotonic()
    try:
      if peers is None:  # as membership/collective.py opens an epoch's wire
        peers = Peers(epoch, me, timeout_s=spec["timeout_s"], log=say,
                      interrupt=functools.partial(lease.interrupt, epoch.hosts),
                      patience=lambda peer: lease.patience(peer, step))
      head, sent = peers.frame_bytes, peers.bytes_sent
      lease.busy = True
      total = peers.allreduce_sum(x)
      # frames sent: their header bytes (no MAC without a token) over one header's
      framed = (peers.frame_bytes - head - (peers.bytes_sent - sent)) // frames.HEADER.size
      digest = hashlib.sha256(total).hexdigest()
    except PeerError as e:  # a member left or went silent: vote not ok, naming it
      ok, suspect = False, e.host
    except WireError:
      ok = False
    finally:
      lease.busy = False
    t1 = time.monotonic()
    verdict = lease.commit(epoch.number, step, ok, suspect, boundary=True)
    t2 = time.monotonic()
    out["records"].append([epoch.number, step, verdict.commit, t0, t1, t2, framed, sockets(),
                           digest if verdict.commit else None])
    if verdict.commit:
      step += 1
      if verdict.admitted:
        end = max(rounds, step + AFTER)
      if me == 0:
        with open(progress + ".tmp", "w") as f:
          f.write(str(step))
        os.replace(progress + ".tmp", progress)
    if verdict.epoch.number != epoch.number:  # the next op runs in the verdict's epoch
      if peers is not None:
        peers.close()
      epoch, peers = verdict.epoch, None
  out["requests"] = dict(requests)
  if peers is not None:
    peers.close()
  lease.close(leave=True)
  out["jax_imported"] = "jax" in sys.modules
  with open("/proc/self/status") as f:  # this process's peak resident memory
    out["rss_mb"] = next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
  with open(os.path.join(work, f"host{me}.json"), "w") as f:
    json.dump(out, f)


def die_with_parent() -> None:
  """In a child before it runs (Popen's preexec_fn): PR_SET_PDEATHSIG, so that a bench
  killed with SIGKILL, which runs no `finally`, still takes its hosts and coordinator."""
  try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: `finally` alone
    pass


def sockets() -> int:
  """This process's socket fds: zmq's TCP connections, its listeners, the coordinator's."""
  count = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # closed since listed
      pass
  return count


def cpu_seconds(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def frames_formula(n: int, size: int, rank: int = 0) -> int:
  """Frames one sum sends from member `rank` (wire/peers.py): its part of every other
  member's span (reduce-scatter), then its own summed span to each (all-gather), each cut
  into chunks of at most links.DEFAULT_CHUNK bytes."""
  from diloco_jax.wire.links import DEFAULT_CHUNK  # pylint: disable=import-outside-toplevel
  spans = [4 * len(c) for c in np.array_split(np.empty(size, bool), n)]
  per = lambda nbytes: max(1, -(-nbytes // DEFAULT_CHUNK))
  return sum(per(s) for i, s in enumerate(spans) if i != rank) + (n - 1) * per(spans[rank])


def run(n: int, args, work: str, procs: list) -> dict:
  """One run of n hosts (and a joiner): the figures of the JSON's row for n."""
  size = int(args.mb * (1 << 20)) // 4
  port, t_start = harness.free_port(), time.monotonic()
  coord = subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={port}",
       f"--max_hosts={n + 1}", f"--lease_s={args.lease_s}"], cwd=REPO,
      stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "coordinator.log"), "w"),
      start_new_session=True, preexec_fn=die_with_parent)
  procs.append(coord)
  base = {"coordinator": f"127.0.0.1:{port}", "hosts": n, "rounds": args.rounds,
          "size": size, "dir": work, "timeout_s": args.timeout_s,
          "leave_round": args.rounds // 3, "join_round": 2 * args.rounds // 3}
  roles = ["member"] * (n - 1) + ["leaver", "joiner"]
  hosts = []
  for h, role in enumerate(roles):
    spec = json.dumps({**base, "host": h, "role": role})
    log = open(os.path.join(work, f"host{h}.log"), "w")
    hosts.append(subprocess.Popen([sys.executable, "-m", "bench.hosts", "--worker", spec], cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=die_with_parent))
    procs.append(hosts[-1])
  deadline = time.monotonic() + args.timeout_s
  while True:
    running = [p.poll() is None for p in hosts]
    failed = [h for h, p in enumerate(hosts) if p.returncode not in (None, 0)]
    if not failed and not any(running):
      break
    if failed or time.monotonic() > deadline:
      h = failed[0] if failed else next(h for h, p in enumerate(hosts) if p.poll() is None)
      tail = open(os.path.join(work, f"host{h}.log")).read()[-3000:]
      raise RuntimeError(f"{n} hosts: host {h} {'failed' if failed else 'did not finish'} "
                         f"(exit {hosts[h].returncode}):\n{tail}")
    time.sleep(0.1)
  wall = time.monotonic() - t_start
  coordinator_cpu = cpu_seconds(coord.pid)
  coord.kill()
  coord.wait()
  outs = [json.load(open(os.path.join(work, f"host{h}.json"))) for h in range(n + 1)]
  return figures(n, size, outs, wall, coordinator_cpu, args.rounds)


def figures(n: int, size: int, outs: list[dict], wall: float, coordinator_cpu: float,
            rounds: int) -> dict:
  epochs = {int(e): hosts for o in outs for e, hosts in o["epochs"].items()}
  done = [(o["host"], r) for o in outs for r in o["records"] if r[2]]  # committed ops
  # Every host's result of every committed op against numpy's sum in host order.
  vectors, exact, ops = {}, True, collections.defaultdict(list)
  for h, r in done:
    ops[(r[0], r[1])].append((h, r))
  for (e, s), rows in ops.items():
    total = None
    for h in epochs[e]:
      x = vectors.setdefault(h, host_vector(h, size)) * np.float32(s + 1)
      total = x if total is None else np.add(total, x, out=total)
    want = hashlib.sha256(total).hexdigest()
    exact &= sorted(h for h, _ in rows) == epochs[e] and all(r[8] == want for _, r in rows)
  steps = sorted({s for _, s in ops})

  def changed(first: tuple[int, int]) -> float:  # when every member had committed it
    return max(r[5] for _, r in ops[first])
  leaver, joiner = outs[n - 1], outs[n]
  after_leave = min((s, e) for e, s in ops if e > leaver["event_epoch"])
  first_joined = min((r[1], r[0]) for r in joiner["records"] if r[2])
  start = min(epochs)  # the first epoch: all n hosts
  first = [r for h, r in done if r[0] == start]
  failed = [(h, r) for o in outs for r in o["records"] if r[0] == leaver["event_epoch"]
            and not r[2]]  # the op the leave broke
  commit = [r[5] - r[4] for _, r in done]
  requests = collections.Counter()
  for o in outs:
    requests.update(o["requests"])
  row = {
      "hosts": n, "rounds_committed": len(steps), "epochs": len(epochs), "wall_s": wall,
      "commit_median_s": float(np.median(commit)),
      "commit_p90_s": float(np.percentile(commit, 90)),
      "sum_median_s": float(np.median([r[4] - r[3] for _, r in done])),
      "leave_epoch_change_s": changed(after_leave[::-1]) - leaver["event_s"],
      # the survivors' not-ok vote: they learn of the leave from a heartbeat (lease/4)
      "leave_noticed_s": max(r[4] for _, r in failed) - leaver["event_s"] if failed else None,
      "join_epoch_change_s": changed(first_joined[::-1]) - joiner["event_s"],
      "join_admitted_s": joiner["admitted_s"] - joiner["event_s"],
      # the first sum of an epoch opens its sockets and waits for every member's HELLO
      "epoch_first_sum_s": float(np.median([r[4] - r[3] for _, r in ops[first_joined[::-1]]])),
      "connections_per_host": n,  # in the first epoch: n-1 PUSH sockets + 1 PULL
      "tcp_sockets_per_host": int(np.median([r[7] for r in first])),
      "coordinator_requests_per_round": sum(requests.values()) / len(steps),
      "commit_requests_per_round": requests["commit"] / len(steps),
      "heartbeats_per_round": requests["heartbeat"] / len(steps),
      "coordinator_cpu_s_per_round": coordinator_cpu / len(steps),
      "frames_per_sum_per_host": int(np.median([r[6] for h, r in done
                                                if r[0] == start and h == 0])),
      "frames_formula": frames_formula(n, size),
      "payload_bytes_per_sum_per_host": 2 * (n - 1) * 4 * size // n,
      "sums_exact": bool(exact and steps == list(range(len(steps))) and len(steps) >= rounds),
      "jax_imported": any(o["jax_imported"] for o in outs),
      "host_rss_mb": max(o["rss_mb"] for o in outs)}
  return row


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    return worker(json.loads(argv[1]))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(__doc__.split("\n\n")[1:]))
  parser.add_argument("--hosts", default="16,32", help="host counts N, one run each")
  parser.add_argument("--rounds", type=int, default=12)
  parser.add_argument("--mb", type=float, default=4.0, help="MB of float32 in each sum")
  parser.add_argument("--lease_s", type=float, default=10.0,
                      help="the coordinator's lease (the trainer's default); hosts "
                           "heartbeat every quarter of it")
  parser.add_argument("--timeout_s", type=float, default=300.0,
                      help="per N: the run's deadline, the wire's and the registration's")
  args = harness.parse_args(parser, "hosts", {"hosts": "4,6", "rounds": 6, "mb": 0.5}, argv)
  counts = [int(h) for h in args.hosts.split(",")]
  if min(counts) < 3 or args.rounds < 6:
    parser.error("needs 3 or more hosts (one leaves) and 6 or more rounds")
  # SIGTERM (a test's timeout, a person) unwinds like Ctrl-C: `finally` kills the children
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  rows, procs = [], []
  try:
    for n in counts:
      with tempfile.TemporaryDirectory(prefix=f"bench_hosts_{n}_") as work:
        rows.append(run(n, args, work, procs))
      r = rows[-1]
      print(f"{n:3d} hosts: commit {r['commit_median_s'] * 1e3:6.1f} ms median, "
            f"{r['commit_p90_s'] * 1e3:6.1f} p90; epoch change: leave "
            f"{r['leave_epoch_change_s']:.2f} s, join {r['join_epoch_change_s']:.2f} s; sum "
            f"{r['sum_median_s'] * 1e3:6.1f} ms; sockets/host {r['connections_per_host']} "
            f"({r['tcp_sockets_per_host']} TCP fds); coordinator requests/round "
            f"{r['coordinator_requests_per_round']:.0f}; frames/sum/host "
            f"{r['frames_per_sum_per_host']}; exact {r['sums_exact']}", flush=True)
  finally:
    for p in procs:  # only what this run started, each in a session of its own
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  result = {"rows": rows, "rounds": args.rounds, "mb": args.mb, "lease_s": args.lease_s,
            "sums_exact": all(r["sums_exact"] for r in rows),
            "jax_imported": any(r["jax_imported"] for r in rows),
            "cpu_count": os.cpu_count(), "smoke": args.smoke, **harness.provenance("hosts", argv)}
  harness.write(args.out, result, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
