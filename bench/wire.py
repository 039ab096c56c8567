"""The epoch wire's sum (wire/peers.py, zmq) against today's gloo path, side by side.

  python bench/wire.py [--hosts=2] [--sizes=1000000,10000000] [--reps=10] [--out=...]
  python bench/wire.py --smoke  # seconds: tiny sizes, 2 repetitions

Starts --hosts processes on this machine (loopback) in one jax.distributed job, as
tests/wire_main.py does. Each holds both transports: `collective.HostCollective` (a jitted
sum over a mesh of one CPU device per process, run by XLA:CPU through gloo) and the epoch
wire's `Peers.allreduce_sum`, without a join token and with one (every frame under
HMAC-SHA256). For every size they take turns, repetition by repetition (each op preceded by
a one-byte all-gather on the same transport so that all hosts start it together), so drifts
in the shared machine's speed hit all of them alike; the figure is the median seconds per
sum. Also: the wire's bytes per host per sum (payload, and with headers and MACs) against
the planner's formula (planning/model.py: a float32 ring sends 2(n-1)/n x 4N), and whether
the wire's sum has the same bits as gloo's (2 hosts: a + b either way).
Writes bench/results/wire.json (--smoke: --out, or a file in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import _smoke  # noqa: E402

TOKEN = "bench-wire-join-token-0123456789"
SIDES = ("gloo", "wire", "wire_hmac")


def free_ports(n: int) -> list[int]:
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def worker(host: int, hosts: int, port: int, wire_ports: str, sizes: str, reps: int,
           out: str) -> None:
  """One host: both transports, taking turns; host 0 writes its timings to `out`."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from diloco_jax.runtime import cluster  # pylint: disable=import-outside-toplevel
  cluster.initialize(cluster.Cluster(coordinator_address=f"127.0.0.1:{port}",
                                     num_hosts=hosts, host_id=host,
                                     initialization_timeout=60, heartbeat_timeout=60))
  import numpy as np  # pylint: disable=import-outside-toplevel

  from diloco_jax.runtime.security import JoinToken  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire import collective  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire.epoch import Epoch  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire.peers import Peers  # pylint: disable=import-outside-toplevel
  gloo = collective.HostCollective()
  gloo.connect()
  addresses = tuple(f"127.0.0.1:{p}" for p in wire_ports.split(","))
  plain = Peers(Epoch(1, tuple(range(hosts)), addresses[:hosts]), host, timeout_s=120)
  keyed = Peers(Epoch(2, tuple(range(hosts)), addresses[hosts:]), host,
                token=JoinToken(TOKEN, "bench"), timeout_s=120)
  plain.connect()
  keyed.connect()

  def gloo_sum(x):
    return gloo.sum({"x": x})["x"]

  ops = {"gloo": (gloo_sum, lambda: gloo.allgather(np.zeros(1, np.uint8))),
         "wire": (plain.allreduce_sum, lambda: plain.allgather(np.zeros(1, np.uint8))),
         "wire_hmac": (keyed.allreduce_sum, lambda: keyed.allgather(np.zeros(1, np.uint8)))}
  rows = []
  for size in map(int, sizes.split(",")):
    x = np.random.default_rng(host).standard_normal(size).astype(np.float32)
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    results, per_sum = {}, {}
    for rep in range(reps + 1):  # the first is untimed (gloo compiles for the shape)
      for side in SIDES:
        fn, align = ops[side]
        align()
        sent, framed = plain.bytes_sent + keyed.bytes_sent, plain.frame_bytes + keyed.frame_bytes
        start = time.perf_counter()
        results[side] = fn(x)
        if rep:
          seconds[side].append(time.perf_counter() - start)
        if side != "gloo":
          per_sum[side] = (plain.bytes_sent + keyed.bytes_sent - sent,
                           plain.frame_bytes + keyed.frame_bytes - framed)
    rows.append({"size": size, "mb": 4 * size / 1e6,
                 "seconds": {side: statistics.median(v) for side, v in seconds.items()},
                 "samples": seconds,
                 "same_bits_as_gloo": {side: results[side].tobytes() == results["gloo"].tobytes()
                                       for side in SIDES[1:]},
                 "payload_bytes_per_host": per_sum["wire"][0],
                 "framed_bytes_per_host": {side: per_sum[side][1] for side in SIDES[1:]}})
  plain.close()
  keyed.close()
  if host == 0:
    with open(out, "w") as f:
      json.dump(rows, f)


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(*[int(a) if a.isdigit() else a for a in sys.argv[2:]])
    return
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2, help="processes on this machine")
  parser.add_argument("--sizes", default="1000000,10000000",
                      help="float32 entries per sum, comma-separated")
  parser.add_argument("--reps", type=int, default=10, help="timed sums per size and side")
  args = _smoke.parse_args(parser, "wire", dict(sizes="1000,100000", reps=2))
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  ports = free_ports(1 + 2 * args.hosts)
  tmp = tempfile.mkdtemp(prefix="bench_wire_")
  out = os.path.join(tmp, "host0.json")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(h), str(args.hosts),
                             str(ports[0]), ",".join(map(str, ports[1:])), args.sizes,
                             str(args.reps), out], cwd=REPO, env=env)
           for h in range(args.hosts)]
  codes = [p.wait(timeout=1800) for p in procs]
  if any(codes):
    sys.exit(f"bench/wire.py: a host failed (exit codes {codes})")
  with open(out) as f:
    rows = json.load(f)
  for row in rows:
    s = model.Setting(num_params=row["size"], hosts=args.hosts, step_time=(0.1,),
                      up_mbit=1, down_mbit=1)
    row["planner_bytes_per_host"] = model.bytes_per_host(s)
    row["ratio_gloo_over_wire"] = row["seconds"]["gloo"] / row["seconds"]["wire"]
    row["ratio_gloo_over_wire_hmac"] = row["seconds"]["gloo"] / row["seconds"]["wire_hmac"]
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"hosts": args.hosts, "reps": args.reps, "rows": rows, "smoke": args.smoke,
               "transport": "loopback", **_smoke.provenance("wire")}, f, indent=2)
  print(f"\n{args.hosts} hosts on loopback, median of {args.reps} sums (ratio = gloo seconds "
        "/ wire seconds: > 1 is the wire faster)\n"
        "| float32 entries | MB | gloo s | wire s | wire+HMAC s | ratio | ratio (HMAC) "
        "| wire bytes/host | framed (HMAC) | planner |\n|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    t = r["seconds"]
    print(f"| {r['size']} | {r['mb']:.1f} | {t['gloo']:.4f} | {t['wire']:.4f} | "
          f"{t['wire_hmac']:.4f} | {r['ratio_gloo_over_wire']:.2f} | "
          f"{r['ratio_gloo_over_wire_hmac']:.2f} | {r['payload_bytes_per_host']} | "
          f"{r['framed_bytes_per_host']['wire_hmac']} | {r['planner_bytes_per_host']:.0f} |")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
