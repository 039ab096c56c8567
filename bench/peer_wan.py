"""diloco_jax against torchft's DiLoCo over the same slow link, each system at its best.

  sudo python -m bench.peer_wan [--rates=8,32] [--rounds=5] [--settings=...] [--venv=...]
  python -m bench.peer_wan --smoke  # seconds, no root: 127.0.0.1, a tiny model, no torchft
                                    # unless its venv exists

bench/peer.py's race (configs/peer.py's 3.3M-param byte-level GPT, the same recipe and
bytes, H = 50, 2 replicas each pinned to its own core and computing on one thread), run
through bench/wan.py's links: each replica in a network namespace of its own on a bridge,
its link shaped to the rate in both directions by `tc tbf`. torchft's lighthouse and
diloco_jax's host 0 (which serves its membership coordinator) sit in replica 0's namespace.
Settings (SETTINGS):

  torchft     DiLoCo as its docs configure it (a Manager with a synchronous quorum,
              ProcessGroupGloo), and its streaming DiLoCo: 2 fragments of whole blocks,
              fragment_sync_delay 20 steps (the all-reduce runs behind 20 of each
              fragment's 25 steps). Its quantized all-reduce (`should_quantize`) needs
              triton: where triton is missing it sends float32, so it is not run (the
              results file says whether triton was found).
  diloco_jax  sync; eager (the sum behind the next inner phase, applied one round late with
              this round's own term); streaming with 2 fragments and 20 overlap steps;
              int8 and 4-bit sync; 4-bit eager; configs/sparseloco.py's wire and outer step.
              Every one runs as the README's command does: host 0 serves the membership
              coordinator, and the sums cross the epoch wire (sockets, on the dispatch
              thread in the async modes, so the inner steps run meanwhile).

`alone` is diloco_jax's compute alone: the two hosts as one-host jobs, nothing on the link.

Per run: tokens/s per replica (B x L x H over the median round, rounds 2..R), the share of
the round the training thread waited on the link (torchft: the time in DiLoCo's optimizer
hook: quorum, all-reduce wait, outer step; diloco_jax: the round less `alone`'s, as its
inner steps are dispatched ahead and the wait in its outer step holds their compute), the
bytes each replica's veth sent, and the eval loss on diloco_jax's eval set (the first
eval_batches x batch_size held-out windows; torchft evaluates the same windows after each
round, outside its round's time) against wall-clock time, round 1 counted at the run's
median round (it holds compilation and the first quorum). At each rate, the loss at equal
wall time is every run's eval loss interpolated at the shortest run's end. Writes
bench/results/peer_wan.json and prints a table per rate.

--smoke runs the same orchestration on 127.0.0.1 without shaping or root: 2 rounds of a
two-block width-32 model, diloco_jax alone, its sync and eager-4bit and, where the venv
exists, torchft's DiLoCo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness
from bench import peer
from bench import wan
from bench.netns import Localhost
from bench.netns import Network

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (system, trainer flags or torchft's replica flags)
SETTINGS = {
    # diloco_jax's compute alone: each host a one-host job of its own, nothing on the link.
    # Its round is what a diloco_jax round is without waiting (see `summarize`).
    "alone": ("diloco_jax", ["--config.mode=sync"]),
    "torchft-diloco": ("torchft", []),
    "torchft-streaming": ("torchft", ["--fragments=2", "--sync_delay=20"]),
    "sync": ("diloco_jax", ["--config.mode=sync"]),
    "eager": ("diloco_jax", ["--config.mode=eager"]),
    "streaming": ("diloco_jax", ["--config.mode=streaming", "--config.outer.fragments=2",
                                 "--config.outer.overlap_steps=20"]),
    "sync-int8": ("diloco_jax", ["--config.mode=sync", "--config.outer.compression=int8"]),
    "sync-4bit": ("diloco_jax", ["--config.mode=sync", "--config.outer.compression=4bit"]),
    "eager-4bit": ("diloco_jax", ["--config.mode=eager", "--config.outer.compression=4bit"]),
    "sparseloco": ("diloco_jax", ["--config.mode=sync", *wan.SPARSELOCO]),
}
SMOKE = {"d_model": 32, "num_layers": 2, "num_heads": 2, "mlp_dim": 64, "seq_len": 16,
         "batch_size": 2, "inner_steps": 4, "rounds": 2, "eval_batches": 1, "rates": "0",
         "settings": "alone,sync,eager-4bit,torchft-diloco"}
RUN_TIMEOUT_S = 1800


def outer_flags(flags: list[str]) -> list[str]:
  """bench/wan.py's outer lr and momentum for the setting's mode (eager: momentum 0.5), put
  before the setting's own flags (which win: SparseLoCo's lr 2, momentum 0)."""
  mode = next((f.split("=")[1] for f in flags if f.startswith("--config.mode=")), "sync")
  return [f"--config.outer.lr={wan.OUTER_LR[mode]}",
          f"--config.outer.momentum={wan.OUTER_MOMENTUM[mode]}"]


def run_jax(args, net, flags: list[str], data: str, cpus: list[int],
            alone: bool = False) -> dict:
  """One diloco_jax run: a trainer per namespace, host i pinned to cpus[i], host 0 serving
  the membership coordinator (the README's command); `alone`: each a one-host job (the
  figures are the mean of the two)."""
  workdir = tempfile.mkdtemp(prefix="bench_peer_wan_jax_")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
         "DILOCO_INSECURE": "1",  # namespaces of private addresses, as torchft's run
         "XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                             "--xla_cpu_multi_thread_eigen=false")))}
  port = net.port()
  common = ["--config=configs/peer.py", f"--workdir={workdir}", f"--config.data.path={data}",
            f"--config.num_rounds={args.rounds}", f"--config.inner_steps={args.inner_steps}",
            f"--config.batch_size={args.batch_size}", "--config.eval_every=1",
            f"--config.eval_batches={args.eval_batches}",
            *(f"--config.model.{k}={getattr(args, k)}" for k in peer.SHAPE),
            *outer_flags(flags), *flags]
  hosts = ([[f"--workdir={workdir}/h{i}"] for i in range(2)] if alone else
           [[f"--coordinator_address={net.address(0)}:{port}", "--num_hosts=2",
             "--initialization_timeout=120", f"--host_id={i}"] for i in range(2)])
  before = [net.tx_bytes(i) for i in range(2)]
  procs = []
  try:
    trainers = [subprocess.Popen(net.command(i, [
        "taskset", "-c", str(cpus[i]), sys.executable, "-m", "diloco_jax.train", *common,
        *hosts[i]]), cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    procs += trainers
    outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in trainers]
    for i, (p, out) in enumerate(zip(trainers, outputs)):
      if p.returncode:
        raise RuntimeError(f"diloco_jax host {i} failed ({p.returncode}):\n{out[-3000:]}")
    per_host = ([wan.read_metrics(f"{workdir}/h{i}") for i in range(2)] if alone
                else [wan.read_metrics(workdir)])  # host 0's, in WORKDIR/host0
  finally:
    peer.stop(procs)  # the trainers, only after a failure
    shutil.rmtree(workdir, ignore_errors=True)
  mean = lambda key: [statistics.mean(r.get(key, 0.0) for r in rs)  # noqa: E731
                       for rs in zip(*per_host)]
  return {"round_times": mean("round_time"), "wait_times": mean("outer_time"),
          "eval_losses": mean("eval_loss"), "outer_wait": mean("outer_wait"),
          "collective_time": mean("collective_time"),
          "bytes_per_host": [None if b is None else net.tx_bytes(i) - b
                             for i, b in enumerate(before)]}


def wait_for_port(net, host: int, port: int, timeout: float = 60) -> None:
  """Until something listens at host's address:port, asked from inside host's namespace."""
  probe = ("import socket, sys, time\nend = time.time() + float(sys.argv[3])\n"
           "while time.time() < end:\n  try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close(); break\n"
           "  except OSError: time.sleep(0.05)\nelse: sys.exit(1)")
  if subprocess.run(net.command(host, [sys.executable, "-c", probe, net.address(host),
                                       str(port), str(timeout)])).returncode:
    raise RuntimeError(f"torchft_lighthouse did not open {net.address(host)}:{port}")


def run_torch(args, net, flags: list[str], python: str, data: str, cpus: list[int]) -> dict:
  """One torchft run: the lighthouse in namespace 0, a replica per namespace."""
  tmp = tempfile.mkdtemp(prefix="bench_peer_wan_torch_")
  spec = peer.write_spec(args, data, tmp)
  with open(spec) as f:
    spec_dict = {**json.load(f), "eval_batches": args.eval_batches}
  with open(spec, "w") as f:
    json.dump(spec_dict, f)
  env, port, procs = peer.torch_env(), net.port(), []
  before = [net.tx_bytes(i) for i in range(2)]
  try:
    procs.append(subprocess.Popen(net.command(0, [
        os.path.join(os.path.dirname(python), "torchft_lighthouse"), "--min_replicas=2",
        f"--bind={net.address(0)}:{port}", "--quorum_tick_ms=100",
        "--join_timeout_ms=10000"]), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL))
    wait_for_port(net, 0, port)
    for i in range(2):
      procs.append(subprocess.Popen(net.command(i, [
          "taskset", "-c", str(cpus[i]), python, os.path.join(REPO, "bench", "_peer_torch.py"),
          f"--spec={spec}", f"--replica={i}", f"--lighthouse=http://{net.address(0)}:{port}",
          f"--address={net.address(i)}", f"--out={tmp}/r{i}.json", *flags]),
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs[1:]]
    for i, (p, out) in enumerate(zip(procs[1:], outputs)):
      if p.returncode:
        raise RuntimeError(f"torchft replica {i} failed ({p.returncode}):\n{out[-3000:]}")
    results = peer.replica_results(tmp)
  finally:
    peer.stop(procs)  # the lighthouse always; replicas only after a failure
    shutil.rmtree(tmp, ignore_errors=True)
  fragments = next((int(f.split("=")[1]) for f in flags if f.startswith("--fragments=")), 1)
  if any(r["manager_step"] != args.rounds * fragments for r in results):
    raise RuntimeError(f"torchft committed {[r['manager_step'] for r in results]} syncs, not "
                       f"{args.rounds * fragments}: a sync failed")
  mean = lambda key: [statistics.mean(x) for x in zip(*(r[key] for r in results))]  # noqa: E731
  return {"round_times": mean("round_times"), "wait_times": mean("wait_times"),
          "eval_losses": mean("eval_losses"), "quantized": results[0]["quantized"],
          "bytes_per_host": [None if b is None else net.tx_bytes(i) - b
                             for i, b in enumerate(before)]}


def summarize(run: dict, tokens_per_round: int, alone_s: float | None = None) -> dict:
  """Figures over the steady rounds (2..R) and the eval curve against wall time. The share
  of a round spent waiting: torchft's time in its sync hook (its steps are synchronous);
  diloco_jax's round less `alone_s`, the round of the same hosts alone (its steps are
  dispatched ahead, so the wait in its outer step also holds the inner steps' compute)."""
  steady = peer.steady(run["round_times"])
  round_time = statistics.median(steady)
  if alone_s is not None:
    run = {**run, "wait_times": [max(t - alone_s, 0.0) for t in run["round_times"]]}
  times = [round_time, *run["round_times"][1:]]  # round 1 at the median round
  ends = [sum(times[:i + 1]) for i in range(len(times))]
  return {**run, "round_time_s": round_time,
          "tokens_per_sec_per_replica": tokens_per_round / round_time,
          "wait_share": statistics.median(
              w / t for w, t in zip(peer.steady(run["wait_times"]), steady)),
          "wall_s": ends[-1], "curve": list(zip(ends, run["eval_losses"])),
          "final_eval_loss": run["eval_losses"][-1],
          "mb_per_host": (max(run["bytes_per_host"]) / 1e6
                          if run["bytes_per_host"][0] is not None else None)}


def loss_at(curve: list[tuple[float, float]], t: float) -> float | None:
  """The eval loss at wall time t, linear between the evals around it."""
  for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
    if t0 <= t <= t1:
      return l0 + (l1 - l0) * (t - t0) / (t1 - t0)
  return curve[-1][1] if curve and abs(t - curve[-1][0]) < 1e-9 else None


def compare(rows: dict) -> dict:
  """Per rate: the loss at the shortest run's end, and each diloco_jax run against
  torchft's fastest (tokens/s) run."""
  if "alone" in rows:  # no link: not a contender
    rows["alone"]["eval_loss_at_equal_wall"] = None
    rows = {n: r for n, r in rows.items() if n != "alone"}
  at = min(r["wall_s"] for r in rows.values())
  for r in rows.values():
    r["eval_loss_at_equal_wall"] = loss_at(r["curve"], at)
  torch_rows = {n: r for n, r in rows.items() if SETTINGS[n][0] == "torchft"}
  best = max(torch_rows, key=lambda n: torch_rows[n]["tokens_per_sec_per_replica"],
             default=None)
  for name, r in rows.items():
    if best and SETTINGS[name][0] == "diloco_jax":
      b = rows[best]
      r["vs_torchft_best"] = {
          "setting": best,
          "tokens_per_sec": r["tokens_per_sec_per_replica"] / b["tokens_per_sec_per_replica"],
          "eval_loss_at_equal_wall": (r["eval_loss_at_equal_wall"] / b["eval_loss_at_equal_wall"]
                                      if r["eval_loss_at_equal_wall"]
                                      and b["eval_loss_at_equal_wall"] else None)}
  return {"equal_wall_s": at, "torchft_best": best}


def table(rate: str, rows: dict, cmp: dict) -> str:
  lines = [f"\n{rate}: eval loss at {cmp['equal_wall_s']:.0f} s (the shortest run's end)\n",
           "| setting | tokens/s per replica | waiting on the link | MB/replica | eval loss "
           "at equal wall | final eval loss | vs torchft's fastest (tokens/s, loss) |",
           "|---|---|---|---|---|---|---|"]
  for name, r in rows.items():
    vs = r.get("vs_torchft_best")
    vs_text = "–" if not vs else (f"{vs['tokens_per_sec']:.2f}×, " + (
        f"{vs['eval_loss_at_equal_wall']:.3f}" if vs["eval_loss_at_equal_wall"] else "–"))
    eq, mb = r["eval_loss_at_equal_wall"], r["mb_per_host"]
    lines.append(f"| {name} | {r['tokens_per_sec_per_replica']:,.0f} | "
                 f"{100 * r['wait_share']:.0f}% | {'–' if mb is None else f'{mb:.1f}'} | "
                 f"{'–' if eq is None else f'{eq:.4f}'} | {r['final_eval_loss']:.4f} | {vs_text} |")
  return "\n".join(lines)


def main(argv=None):
  config = peer.peer_config.get_config()
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rates", default="8,32",
                      help="Mbit/s each way per replica, comma-separated (0: unshaped)")
  parser.add_argument("--rounds", type=int, default=5, help="rounds per run, the first untimed")
  parser.add_argument("--settings", default=",".join(SETTINGS),
                      help=f"comma-separated, run in this order, from {', '.join(SETTINGS)}")
  parser.add_argument("--inner_steps", type=int, default=config.inner_steps, help="H")
  parser.add_argument("--batch_size", type=int, default=config.batch_size)
  parser.add_argument("--eval_batches", type=int, default=4,
                      help="eval batches after every round, on both sides")
  for key in peer.SHAPE:
    parser.add_argument(f"--{key}", type=int, default=config.model[key])
  parser.add_argument("--subnet", type=int, default=78, help="10.78.<subnet + i>.0/24")
  parser.add_argument("--venv", default=peer.DEFAULT_VENV,
                      help="torchft's virtualenv (created if missing, but not by --smoke, "
                           "which then skips torchft)")
  args = harness.parse_args(parser, "peer_wan", SMOKE, argv)
  args.config = config
  settings = args.settings.split(",")
  unknown = set(settings) - set(SETTINGS)
  if unknown:
    parser.error(f"--settings: unknown {sorted(unknown)}; from {', '.join(SETTINGS)}")
  rates = [float(r) for r in args.rates.split(",")]
  # SIGTERM unwinds like Ctrl-C: the namespaces and their processes are removed on the way.
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  if not args.smoke and os.geteuid() != 0:
    sys.exit("bench/peer_wan.py needs root: it creates network namespaces and tc qdiscs "
             "(--smoke does not)")
  python, triton = None, None
  if any(SETTINGS[s][0] == "torchft" for s in settings):
    if not args.smoke:
      python = peer.ensure_venv(args.venv)
    elif os.path.exists(os.path.join(args.venv, "bin", "torchft_lighthouse")):
      python = os.path.join(args.venv, "bin", "python")
    else:
      print(f"--smoke: no torchft venv at {args.venv}: diloco_jax only", flush=True)
      settings = [s for s in settings if SETTINGS[s][0] != "torchft"]
  if python:
    triton = subprocess.run([python, "-c", "import triton"], capture_output=True,
                            env=peer.torch_env()).returncode == 0
    check = peer.check_same_model(args, python)
    print(f"the same model: logits within {check['max_abs_logit_diff']:.1e} "
          f"({check['params']:,} params); triton {'found' if triton else 'missing'}", flush=True)
  cpus = sorted(os.sched_getaffinity(0))
  cpus = [cpus[0], cpus[1 % len(cpus)]]
  tokens_per_round = args.inner_steps * args.batch_size * args.seq_len
  data = stdlib = peer.stdlib_dir()
  results = {}
  try:
    for k, rate in enumerate(rates):
      network = (Localhost(2) if args.smoke else
                 Network(2, f"10.78.{args.subnet + k}", rate or None, tag="pw"))
      rows = {}
      with network as net:
        for name in settings:
          system, flags = SETTINGS[name]
          t = time.time()
          run = (run_torch(args, net, flags, python, data, cpus) if system == "torchft"
                 else run_jax(args, net, flags, data, cpus, alone=name == "alone"))
          alone_s = (rows["alone"]["round_time_s"] if system == "diloco_jax"
                     and name != "alone" and "alone" in rows else None)
          rows[name] = summarize(run, tokens_per_round, alone_s)
          print(f"{rate:g} Mbit/s {name}: {rows[name]['tokens_per_sec_per_replica']:,.0f} tok/s "
                f"per replica, waiting {100 * rows[name]['wait_share']:.0f}%, eval "
                f"{rows[name]['final_eval_loss']:.4f} ({time.time() - t:.0f} s)", flush=True)
      cmp = compare(rows)
      key = "unshaped" if args.smoke or not rate else f"{rate:g} Mbit/s"
      results[key] = {"rate_mbit": None if args.smoke else rate, "rows": rows, **cmp}
      print(table(key, rows, cmp), flush=True)
  finally:
    shutil.rmtree(stdlib, ignore_errors=True)
  out = {"config": {"rounds": args.rounds, "inner_steps": args.inner_steps,
                    "batch_size": args.batch_size, "eval_batches": args.eval_batches,
                    **{k: getattr(args, k) for k in peer.SHAPE}, "replicas": 2, "cpus": cpus,
                    "tokens_per_round_per_replica": tokens_per_round},
         "settings": {s: SETTINGS[s] for s in settings}, "torchft_triton": triton,
         "rates": results, "smoke": args.smoke, **harness.provenance("peer_wan", argv)}
  harness.write(args.out, out, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
