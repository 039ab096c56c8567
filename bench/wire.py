"""The epoch wire's sum (wire/peers.py, zmq) against today's gloo path, side by side.

  sudo python -m bench.wire [--hosts=2] [--sizes=1000000,10000000] [--reps=10]
                            [--rates=8,32] [--wan_sizes=250000,1000000] [--wan_reps=8]
  python -m bench.wire --rates=  # loopback only, no root
  python -m bench.wire --smoke  # seconds, no root: tiny sizes, unshaped

Starts --hosts processes in one jax.distributed job, as tests/wire_main.py does. Each holds
both transports: `collective.HostCollective` (a jitted sum over a mesh of one CPU device per
process, run by XLA:CPU through gloo) and the epoch wire's `Peers.allreduce_sum`, without a
join token and with one (every frame MACed: wire/frames.py). For every size they take turns,
repetition by repetition (each op preceded by a one-byte all-gather on the same transport so
that all hosts start it together), so drifts in the shared machine's speed hit all of them
alike; the figure is the median seconds per sum, and the process's CPU seconds per sum
beside it. Also: the wire's bytes per host per sum (payload, and with headers and MACs)
against the planner's formula (planning/model.py: a float32 ring sends 2(n-1)/n x 4N), and
whether the wire's sum has the same bits as gloo's (2 hosts: a + b either way).

First on loopback (--sizes), then through slow links (--rates, Mbit/s each way; --wan_sizes):
each host in its own network namespace behind a veth shaped by `tc tbf` in both directions
(bench/netns.py, as bench/wan.py builds them; removed on exit). There each sum's bytes are
also read off the host's veth (every side: TCP/IP headers and the ACKs of what it receives
included), and the rate the wire's payload reached says whether one TCP stream per peer
fills the link. Needs root (ip netns, tc) unless --rates is empty.

--smoke runs the same code on tiny sizes, the "slow link" pass on 127.0.0.1 unshaped (no
namespaces, no root, no veth to read). Writes bench/results/wire.json (--smoke: --out, or a
file in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness
from bench.netns import Localhost
from bench.netns import Network

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKEN = "bench-wire-join-token-0123456789"
SIDES = ("gloo", "wire", "wire_hmac")


def veth_tx() -> int:
  """This namespace's veth's transmit counter (`ip netns exec` mounts the namespace's own
  /sys, where the veth is the one interface besides lo)."""
  name, = (n for n in os.listdir("/sys/class/net") if n != "lo")
  with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
    return int(f.read())


def hash_gb_per_s() -> dict:
  """On one core of this CPU: SHA-256 (frames v1's MAC hashed every byte with it) and
  frames v2's MAC (NH, then HMAC-SHA256 over the NH digest), GB/s of payload."""
  import hashlib  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel

  from diloco_jax.wire import frames  # pylint: disable=import-outside-toplevel
  buf = memoryview(np.ones(1 << 18, np.float32)).cast("B")
  speeds = {}
  for name, fn in (("sha256", lambda: hashlib.sha256(buf).digest()),
                   ("mac_v2", lambda: frames.mac(b"k" * 32, b"h" * 48, buf))):
    fn()
    start = time.perf_counter()
    for _ in range(64):
      fn()
    speeds[name] = 64 * buf.nbytes / (time.perf_counter() - start) / 1e9
  return speeds


def worker(job: dict) -> None:
  """One host: both transports, taking turns; host 0 writes its timings to job["out"]."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import resource  # pylint: disable=import-outside-toplevel

  from diloco_jax.runtime import cluster  # pylint: disable=import-outside-toplevel
  host, hosts = job["host"], job["hosts"]
  cluster.initialize(cluster.Cluster(coordinator_address=job["coordinator"],
                                     num_hosts=hosts, host_id=host,
                                     initialization_timeout=60, heartbeat_timeout=60))
  import numpy as np  # pylint: disable=import-outside-toplevel

  from diloco_jax.runtime.security import JoinToken  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire import collective  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire.epoch import Epoch  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire.peers import Peers  # pylint: disable=import-outside-toplevel
  gloo = collective.HostCollective()
  gloo.connect()
  members = tuple(range(hosts))
  plain = Peers(Epoch.of(1, members, tuple(job["plain"])), host, timeout_s=300)
  keyed = Peers(Epoch.of(2, members, tuple(job["keyed"])), host,
                token=JoinToken(TOKEN, "bench"), timeout_s=300)
  plain.connect()
  keyed.connect()

  def gloo_sum(x):
    return gloo.sum({"x": x})["x"]

  def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

  ops = {"gloo": (gloo_sum, lambda: gloo.allgather(np.zeros(1, np.uint8))),
         "wire": (plain.allreduce_sum, lambda: plain.allgather(np.zeros(1, np.uint8))),
         "wire_hmac": (keyed.allreduce_sum, lambda: keyed.allgather(np.zeros(1, np.uint8)))}
  rows = []
  for size in job["sizes"]:
    x = np.random.default_rng(host).standard_normal(size).astype(np.float32)
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu_s: dict[str, list[float]] = {side: [] for side in SIDES}
    veth: dict[str, list[int]] = {side: [] for side in SIDES}
    results, per_sum = {}, {}
    for rep in range(job["reps"] + 1):  # the first is untimed (gloo compiles for the shape)
      for side in SIDES:
        fn, align = ops[side]
        align()
        sent, framed = plain.bytes_sent + keyed.bytes_sent, plain.frame_bytes + keyed.frame_bytes
        tx = veth_tx() if job["veth"] else None  # loopback: lo counts the whole machine
        used, start = cpu(), time.perf_counter()
        results[side] = fn(x)
        elapsed, busy = time.perf_counter() - start, cpu() - used
        if side != "gloo":
          per_sum[side] = (plain.bytes_sent + keyed.bytes_sent - sent,
                           plain.frame_bytes + keyed.frame_bytes - framed)
        if rep:
          seconds[side].append(elapsed)
          cpu_s[side].append(busy)
          if tx is not None:  # once every host is done, this host's last bytes have left
            align()
            veth[side].append(veth_tx() - tx)
    row = {"size": size, "mb": 4 * size / 1e6,
           "seconds": {side: statistics.median(v) for side, v in seconds.items()},
           "cpu_seconds": {side: statistics.median(v) for side, v in cpu_s.items()},
           "samples": seconds,
           "same_bits_as_gloo": {side: results[side].tobytes() == results["gloo"].tobytes()
                                 for side in SIDES[1:]},
           "payload_bytes_per_host": per_sum["wire"][0],
           "framed_bytes_per_host": {side: per_sum[side][1] for side in SIDES[1:]}}
    if veth["gloo"]:  # the median sum's bytes on this host's veth
      row["veth_bytes_per_host"] = {side: int(statistics.median(v)) for side, v in veth.items()}
    rows.append(row)
  plain.close()
  keyed.close()
  if host == 0:
    with open(job["out"], "w") as f:
      json.dump(rows, f)


def run_job(net: Network | Localhost, sizes: list[int], reps: int, scratch: str) -> list:
  """Every host's worker in its place (a namespace, or this machine); host 0's rows."""
  hosts = net.num_hosts
  if isinstance(net, Localhost):  # every host on 127.0.0.1: a port each
    ports = harness.free_ports(2 * hosts)
    plain = [f"127.0.0.1:{p}" for p in ports[:hosts]]
    keyed = [f"127.0.0.1:{p}" for p in ports[hosts:]]
  else:  # an address each: the same ports everywhere
    plain = [f"{net.address(h)}:{net.port() + 1}" for h in range(hosts)]
    keyed = [f"{net.address(h)}:{net.port() + 2}" for h in range(hosts)]
  out = os.path.join(scratch, f"rows-{time.monotonic_ns()}.json")
  job = {"hosts": hosts, "coordinator": f"{net.address(0)}:{net.port()}", "plain": plain,
         "keyed": keyed, "sizes": sizes, "reps": reps, "out": out,
         "veth": isinstance(net, Network)}
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  procs = [subprocess.Popen(net.command(h, [sys.executable, "-m", "bench.wire", "--worker",
                                            json.dumps({**job, "host": h})]),
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for h in range(hosts)]
  outputs = [p.communicate(timeout=3600)[0] for p in procs]
  for h, (p, output) in enumerate(zip(procs, outputs)):
    if p.returncode:
      sys.exit(f"bench/wire.py: host {h} failed (exit code {p.returncode}):\n{output[-3000:]}")
  with open(out) as f:
    return json.load(f)


def finish(rows: list, hosts: int, rate_mbit: float | None) -> list:
  """The planner's bytes and the ratios (gloo seconds / wire seconds: > 1 is the wire
  faster); on a shaped link, the rate each side's payload reached."""
  from diloco_jax.planning import model  # pylint: disable=import-outside-toplevel
  for row in rows:
    s = model.Setting(num_params=row["size"], hosts=hosts, step_time=(0.1,),
                      up_mbit=1, down_mbit=1)
    row["planner_bytes_per_host"] = model.bytes_per_host(s)
    row["ratio_gloo_over_wire"] = row["seconds"]["gloo"] / row["seconds"]["wire"]
    row["ratio_gloo_over_wire_hmac"] = row["seconds"]["gloo"] / row["seconds"]["wire_hmac"]
    if rate_mbit:
      row["payload_mbit_per_s"] = {side: 8 * row["planner_bytes_per_host"] / t / 1e6
                                   for side, t in row["seconds"].items()}
  return rows


def table(rows: list, veth: bool) -> str:
  lines = ["| float32 entries | MB | gloo s | wire s | wire+MAC s | ratio | ratio (MAC) | "
           "CPU s/host (gloo, wire, MAC) | wire bytes/host | framed (MAC) | planner |"
           + (" veth bytes/host (gloo, wire, MAC) | payload Mbit/s (gloo, wire, MAC) |"
              if veth else ""),
           "|---" * (11 + 2 * veth) + "|"]
  for r in rows:
    t, c = r["seconds"], r["cpu_seconds"]
    line = (f"| {r['size']} | {r['mb']:.1f} | {t['gloo']:.4f} | {t['wire']:.4f} | "
            f"{t['wire_hmac']:.4f} | {r['ratio_gloo_over_wire']:.2f} | "
            f"{r['ratio_gloo_over_wire_hmac']:.2f} | "
            f"{', '.join(f'{c[s]:.4f}' for s in SIDES)} | {r['payload_bytes_per_host']} | "
            f"{r['framed_bytes_per_host']['wire_hmac']} | {r['planner_bytes_per_host']:.0f} |")
    if veth:
      v, m = r.get("veth_bytes_per_host"), r["payload_mbit_per_s"]
      line += (f" {', '.join(str(v[s]) for s in SIDES) if v else '-'} | "
               f"{', '.join(f'{m[s]:.2f}' for s in SIDES)} |")
    lines.append(line)
  return "\n".join(lines)


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(json.loads(sys.argv[2]))
    return
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2, help="processes")
  parser.add_argument("--sizes", default="1000000,10000000",
                      help="float32 entries per sum on loopback, comma-separated")
  parser.add_argument("--reps", type=int, default=10, help="timed sums per size and side")
  parser.add_argument("--rates", default="8,32",
                      help="shaped links, Mbit/s each way, comma-separated (empty: none)")
  parser.add_argument("--wan_sizes", default="250000,1000000",
                      help="float32 entries per sum through the shaped links")
  parser.add_argument("--wan_reps", type=int, default=8,
                      help="timed sums per size and side through the shaped links")
  parser.add_argument("--subnet", type=int, default=79, help="10.77.<subnet>.0/24")
  args = harness.parse_args(parser, "wire", dict(sizes="1000,100000", reps=2, rates="8",
                                                wan_sizes="1000", wan_reps=1))
  rates = [float(r) for r in args.rates.split(",") if r]
  if rates and not args.smoke and os.geteuid() != 0:
    sys.exit("bench/wire.py needs root for --rates: it creates network namespaces and tc "
             "qdiscs (--rates= runs loopback only; --smoke needs no root)")
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  sizes = [int(s) for s in args.sizes.split(",")]
  wan_sizes = [int(s) for s in args.wan_sizes.split(",")]
  speeds = hash_gb_per_s()
  links = []
  with tempfile.TemporaryDirectory(prefix="bench_wire_") as scratch:
    with Localhost(args.hosts) as net:
      rows = finish(run_job(net, sizes, args.reps, scratch), args.hosts, None)
    for rate in rates:
      if args.smoke:  # the same orchestration, unshaped on 127.0.0.1
        network, where = Localhost(args.hosts), "127.0.0.1, unshaped (smoke)"
      else:
        network = Network(args.hosts, f"10.77.{args.subnet}", rate, tag="dw")
        where = f"network namespaces, veths shaped by tc tbf to {rate:g} Mbit/s each way"
      t = time.time()
      with network as net:
        link_rows = run_job(net, wan_sizes, args.wan_reps, scratch)
      links.append({"rate_mbit": rate, "network": where, "reps": args.wan_reps,
                    "rows": finish(link_rows, args.hosts, rate)})
      print(f"{rate:g} Mbit/s: done in {time.time() - t:.0f} s", flush=True)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"hosts": args.hosts, "reps": args.reps, "rows": rows, "smoke": args.smoke,
               "transport": "loopback", "links": links, "hash_gb_per_s": speeds,
               **harness.provenance("wire")}, f, indent=2)
  print(f"\n{args.hosts} hosts on loopback, median of {args.reps} sums (ratio = gloo seconds "
        f"/ wire seconds: > 1 is the wire faster; on one core, SHA-256 hashes "
        f"{speeds['sha256']:.2f} GB/s, the v2 MAC {speeds['mac_v2']:.2f} GB/s)")
  print(table(rows, veth=False))
  for link in links:
    print(f"\n{args.hosts} hosts, {link['network']}, median of {link['reps']} sums")
    print(table(link["rows"], veth=True))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
