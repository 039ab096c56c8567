"""DiLoCo modes over a slow link: K hosts in network namespaces behind rate-limited veths.

  sudo python -m bench.wan [--hosts=2] [--rate_mbit=8] [--rounds=32] [--modes=...] [--out=...]
  python -m bench.wan --smoke  # seconds, no root: 2 hosts on 127.0.0.1, none and sync, 2 rounds

Builds one network namespace per host on a bridge (bench/netns.py), each host's link shaped
to `--rate_mbit` in both directions with `tc tbf` (this kernel has no netem, so the WAN is
modelled by bandwidth, not delay), and runs the trainer (configs/tiny.py's model and data,
one replica per host, the same token budget) in each mode, plus a no-communication
reference (the same hosts as independent one-host jobs). `--modes` also takes the
compression and streaming runs of RUNS (sync-int8, sync-4bit, streaming-p2, ...), and
configs/sparseloco.py's own run beside float32 sync of its model (sparseloco-small_text,
sync-small_text; on bench/quality.py's corpus, which must be prepared).
Reports per run: wall time, compute utilization (tokens/s over the reference's; `none`
may be listed twice, before and after the others, and the mean is used), tokens/s, bytes
each host put on the wire (the veth's own counter), the most bytes one sync sent
(streaming: one fragment; the peak in flight) and the final eval loss.
Writes bench/results/wan.json and wan.png beside it (eval loss against wall-clock time; no
page shows the plot, and git ignores it).

Choice of rate: the tiny model's pseudo-gradient is 0.43 MB; a host's inner phase (H=25
steps of 32 x 64 tokens) takes about half a second here, and at 8 Mbit/s a 2-host
all-reduce moves it in about as long: sync then waits about as long as it computes.
Wall times exclude round 1 (compilation). The namespaces are removed on exit, also after
Ctrl-C or SIGTERM. Needs root (ip netns, tc).

--smoke runs the same orchestration, figures, table and plot in seconds and without root:
no namespaces and no shaping (the hosts are plain processes on 127.0.0.1), 2 rounds of 2
inner steps of 2 sequences of a one-block model, modes none, sync and sync-live-mac; with
no veth to read, the bytes on the wire are host 0's own count (its metrics' `bytes_sent`).
It writes to --out or a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

from bench import cpushare
from bench import harness
from bench import quality
from bench.netns import Localhost
from bench.netns import Network

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The same model, data and tokens for every mode.
COMMON = ["--config=configs/tiny.py", "--config.replicas_per_host=1",
          "--config.batch_size=32"]
# --smoke: the same, tiny (with H = SMOKE_H and `--rounds` rounds, whatever the run's H).
SMOKE_COMMON = ["--config=configs/tiny.py", "--config.replicas_per_host=1",
                "--config.batch_size=2", "--config.eval_every=1", "--config.eval_batches=1",
                "--config.model.num_layers=1", "--config.inner.warmup_steps=1"]
SMOKE_H = 2
# Outer learning rate and momentum per mode: sync uses the DiLoCo paper's 0.7 and 0.9. The
# one-round-late modes are unstable at those on this task; the best of a small sweep of
# eager on one host (K=2, 32 rounds: lr 0.3-0.9, momentum 0.5-0.95) was lr 0.7 with
# momentum 0.5, and delayed did best at lr 0.4 (E25 and S25 use 0.4), momentum 0.9.
OUTER_LR = {"sync": 0.7, "delayed": 0.4, "eager": 0.7, "ddp": 0.7, "none": 0.7,
            "streaming": 0.7}
OUTER_MOMENTUM = {"sync": 0.9, "delayed": 0.9, "eager": 0.5, "ddp": 0.9, "none": 0.9,
                  "streaming": 0.9}


def sparseloco_flags() -> list[str]:
  """configs/sparseloco.py's outer fields as flags: the wire this bench checks is the
  config's, whatever it is set to."""
  config = runpy.run_path(os.path.join(REPO, "configs", "sparseloco.py"))["get_config"]()
  keys = ("compression", "topk_chunk", "topk_fraction", "topk_value_bits", "error_feedback",
          "error_feedback_decay", "lr", "momentum")
  return [f"--config.outer.{key}={config.outer[key]}" for key in keys]


SPARSELOCO = sparseloco_flags()
SMALL_TEXT = ["--config=configs/small_text.py", f"--config.data.path={quality.default_corpus()}",
              "--config.batch_size=4"]


# Runs by name: a mode, config overrides and H (tiny's 25; the rounds are scaled so that
# every run trains the same tokens). Streaming splits tiny's 2 blocks into P = 2 fragments
# (fragment 0 also holds the embeddings, final norm and head: 53% of the params); P must
# divide H, so streaming runs use H = 20, beside sync at H = 20 (`sync-h20`).
RUNS = {mode: (mode, [], 25) for mode in OUTER_LR}
RUNS.update({
    f"sync-{fmt}": ("sync", [f"--config.outer.compression={fmt}"], 25)
    for fmt in ("bf16", "int8", "4bit", "2bit")})
RUNS.update({
    "sync-topk": ("sync", ["--config.outer.compression=topk",
                           "--config.outer.topk_fraction=0.05"], 25),
    # configs/sparseloco.py's wire and outer step on tiny's model (the flags after the
    # mode's lr and momentum win).
    "sparseloco": ("sync", SPARSELOCO, 25),
    # configs/sparseloco.py itself: small_text's 1.47M-param model on bench/quality.py's
    # corpus, beside float32 sync of that model (batch 4: the bytes do not depend on it).
    "sync-small_text": ("sync", SMALL_TEXT, 25),
    "sparseloco-small_text": ("sync", [*SMALL_TEXT, *SPARSELOCO], 25),
    "sync-h20": ("sync", [], 20),
    # Other H, for bench/plan.py's calibration of diloco_jax.plan.
    "sync-h50": ("sync", [], 50),
    "eager-h50": ("eager", [], 50),
    "streaming-p2": ("streaming", ["--config.outer.fragments=2"], 20),
    # sync under live membership (a membership coordinator in host 0's namespace, the sums
    # on the epoch wire instead of gloo), without and with a join token (every frame MACed)
    "sync-live": ("sync", [], 25),
    "sync-live-mac": ("sync", [], 25),
    "streaming-p2-4bit-overlap": ("streaming", [
        "--config.outer.fragments=2", "--config.outer.overlap_steps=5",
        "--config.outer.merge_alpha=0.5", "--config.outer.compression=4bit"], 20),
})


LIVE = {"sync-live": None, "sync-live-mac": "bench-wan-join-token-0123456789"}  # run: token


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


BASELINE = "@base"  # a run of RUNS by another checkout's trainer: NAME@base (--baseline)


def run_mode(net: Network | Localhost, name: str, rounds: int, workdir: str,
             smoke: bool = False, eval_every: int = 4,
             placement: cpushare.Placement | None = None,
             train_flags: tuple[str, ...] = (), baseline: str | None = None) -> dict:
  """One run of RUNS on every host; figures from host 0's metrics and every host's veth
  (Localhost: host 0's metrics only). `placement`: each host's cores (bench/cpushare.py),
  the reference's one-host jobs' too, so that hosts do not trade cores between runs.
  NAME@base runs NAME with the trainer of the checkout at `baseline` (its own package,
  the same installed dependencies)."""
  repo = baseline if name.endswith(BASELINE) else REPO
  # namespaces of private addresses, unauthenticated unless the run gives a token (0.1's
  # trainer, --baseline, ignores the variable)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo, "PYTHONUNBUFFERED": "1",
         "DILOCO_INSECURE": "1"}
  mode, extra, h = RUNS[name.removesuffix(BASELINE)]
  num_rounds = rounds * 25 // h
  if smoke:
    h, num_rounds = SMOKE_H, rounds
  common = SMOKE_COMMON if smoke else COMMON
  own = [flag for flag in extra if flag.startswith("--config=")]
  if own:  # the run's own config file, first (overrides must come after it)
    common = [*own, *(flag for flag in common if not flag.startswith("--config="))]
    extra = [flag for flag in extra if flag not in own]
  if not smoke:
    common = [*common, f"--config.eval_every={eval_every}"]
  args = [*common, f"--config.num_rounds={num_rounds}",
          f"--config.inner_steps={h}",
          f"--config.outer.lr={OUTER_LR[mode]}",
          f"--config.outer.momentum={OUTER_MOMENTUM[mode]}", *extra, *train_flags]
  def pinned(i: int, argv: list[str]) -> list[str]:
    return placement.command(i, argv) if placement else argv

  if mode == "none":  # the reference: every host its own one-host job, nothing crosses
    procs = [subprocess.Popen(pinned(i, [sys.executable, "-m", "diloco_jax.train", *args,
                               "--config.mode=sync", f"--workdir={workdir}/h{i}"]),
                              cwd=repo, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(net.num_hosts)]
  else:
    port = net.port()
    before = [net.tx_bytes(i) for i in range(net.num_hosts)]
    join = ["--coordinator_address", "--initialization_timeout=120"]
    if name in LIVE:  # the coordinator beside host 0, in its namespace
      if LIVE[name]:
        env["DILOCO_JOIN_TOKEN"] = LIVE[name]
      coordinator = subprocess.Popen(net.command(0, [
          sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={port}",
          f"--max_hosts={net.num_hosts}", f"--bind={net.address(0)}", "--lease_s=10"]),
          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      join[0] = "--membership"
    # Placed first: `ip netns exec` mounts the namespace's own /sys, without the cgroups.
    procs = [subprocess.Popen(pinned(i, net.command(i, [
        sys.executable, "-m", "diloco_jax.train",
        *args, f"--config.mode={mode}", f"--workdir={workdir}",  # shared, as checkpoints need
        f"{join[0]}={net.address(0)}:{port}", f"--num_hosts={net.num_hosts}",
        f"--host_id={i}", join[1]])),
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(net.num_hosts)]
  outputs = [p.communicate()[0] for p in procs]
  if name in LIVE:
    coordinator.terminate()
    coordinator.wait()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    if p.returncode != 0:
      raise RuntimeError(f"{name}: host {i} failed:\n{out[-3000:]}")
  # One-host jobs each log their own run; a multi-host job logs on host 0 only.
  per_host = ([read_metrics(f"{workdir}/h{i}") for i in range(net.num_hosts)]
              if mode == "none" else  # a live job: every host logs, each in WORKDIR/host<i>
              [read_metrics(f"{workdir}/host0" if name in LIVE else workdir)])
  records = per_host[0]
  wall = max(sum(r["round_time"] for r in recs[1:]) for recs in per_host)
  tokens = records[-1]["tokens"] - records[0]["tokens"]
  if mode == "none":
    tokens *= net.num_hosts  # each one-host job counted only its own tokens
  # The main thread's time in outer steps (waiting for the mean included): the time the
  # devices sat idle because of DiLoCo, whatever else slowed the host down.
  idle = sum(r.get("outer_time", 0.0) for r in records[1:])
  # The outer step the run used: the last of each flag wins, as in the trainer.
  last = {flag.partition("=")[0]: flag.partition("=")[2] for flag in args}
  row = {"mode": name, "outer_lr": float(last["--config.outer.lr"]),
         "outer_momentum": float(last["--config.outer.momentum"]),
         "wall_s": wall, "idle_fraction": idle / wall,
         "tokens_per_sec": tokens / wall, "final_eval_loss": records[-1]["eval_loss"],
         "curve": [(sum(r["round_time"] for r in records[1:i + 1]), r["eval_loss"])
                   for i, r in enumerate(records) if "eval_loss" in r and i > 0]}
  if mode != "none":
    row["bytes_per_host_counted"] = sum(r.get("bytes_sent", 0) for r in records)
    if before[0] is not None:  # each host's veth
      row["bytes_per_host"] = [net.tx_bytes(i) - b for i, b in enumerate(before)]
    else:  # no veth (Localhost): host 0's own count, the only host that logs
      row["bytes_per_host"] = [row["bytes_per_host_counted"]]
    # The most one sync put on the wire at once (streaming: one fragment).
    row["peak_bytes_per_sync"] = max(r.get("bytes_peak", r.get("bytes_sent", 0))
                                     for r in records)
    if mode != "ddp":
      timed = records[1:]
      row["comm_s_per_round"] = sum(r["collective_time"] for r in timed) / len(timed)
  return row


def checkout(path: str | None) -> str | None:
  """The commit a --baseline checkout is at (its short hash), for the results file."""
  if not path:
    return None
  done = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True, check=False)
  return done.stdout.strip() or os.path.abspath(path)


def plot(rows: list[dict], path: str, title: str) -> None:
  import matplotlib

  from diloco_jax.reporting import plots
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  for row in rows:
    if row["curve"]:
      xs, ys = zip(*row["curve"])
      ax.plot(xs, ys, "o-", markersize=3, label=f"{row['mode']} ({row['wall_s']:.0f} s)")
  plots.save_figure(fig, ax, path, xlabel="wall-clock time (s, round 1 excluded)",
                      ylabel="eval loss (nats/token)", title=title)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2)
  parser.add_argument("--rate_mbit", type=float, default=8.0,
                      help="each host's link, each way (0: unshaped, the veths' own speed)")
  parser.add_argument("--rounds", type=int, default=32)
  parser.add_argument("--modes", default="none,sync,delayed,eager,ddp",
                      help=f"runs, comma-separated, from {', '.join(RUNS)}")
  parser.add_argument("--subnet", type=int, default=77, help="10.77.<subnet>.0/24")
  parser.add_argument("--workdir", default="", help="keep each mode's workdirs here")
  parser.add_argument("--eval_every", type=int, default=4, help="rounds between evals")
  parser.add_argument("--train_flags", default="",
                      help="trainer flags added to every run, space-separated (e.g. "
                           "--config.checkpoint.every=0: checkpoints at the end only)")
  parser.add_argument("--baseline", default=None,
                      help="a checkout of another diloco_jax version (e.g. `git worktree add "
                           "/tmp/base 7bb7343`): the modes NAME@base run NAME with its trainer, "
                           "side by side with this one's")
  parser.add_argument("--pin_cores", action="store_true",
                      help="host i on core i mod the cores (taskset), the reference too; with "
                           "more hosts than cores, every host an equal CPU quota instead "
                           "(bench/cpushare.py: hosts sharing a core would take turns, one's "
                           "wait on the link the other's compute)")
  args = harness.parse_args(parser, "wan", dict(hosts=2, rounds=2, modes="none,sync,sync-live-mac"))
  if not args.smoke and os.geteuid() != 0:
    sys.exit("bench/wan.py needs root: it creates network namespaces and tc qdiscs "
             "(--smoke does not)")
  signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
  rows, failed = [], []
  network = (Localhost(args.hosts) if args.smoke
             else Network(args.hosts, f"10.77.{args.subnet}", args.rate_mbit or None,
                          tag="dj"))
  placement = cpushare.Placement(args.hosts, args.pin_cores and not args.smoke)
  with network as net, placement, tempfile.TemporaryDirectory() as scratch:
    tmp = args.workdir or scratch
    modes = args.modes.split(",")
    unknown = {m for m in modes if m.removesuffix(BASELINE) not in RUNS}
    if unknown:
      sys.exit(f"--modes: unknown {sorted(unknown)}; one of {', '.join(RUNS)}, each also "
               f"as NAME{BASELINE} with --baseline")
    if any(m.endswith(BASELINE) for m in modes) and not (
        args.baseline and os.path.isdir(os.path.join(args.baseline, "diloco_jax"))):
      sys.exit(f"--modes NAME{BASELINE} need --baseline=DIR, a checkout of diloco_jax "
               f"(got {args.baseline!r})")
    for i, mode in enumerate(args.modes.split(",")):
      t = time.time()
      try:
        rows.append(run_mode(net, mode, args.rounds, os.path.join(tmp, f"{i}-{mode}"),
                             args.smoke, args.eval_every, placement,
                             tuple(args.train_flags.split()), args.baseline))
      except RuntimeError as e:  # report it, keep the other runs' figures
        print(f"{mode}: FAILED\n{e}", flush=True)
        failed.append(mode)
        continue
      print(f"{mode}: done in {time.time() - t:.0f} s", flush=True)
  # Utilization: tokens per second against the reference's (the mean of its runs when
  # `none` is listed more than once, e.g. before and after the others). Per token, not per
  # run: round 1 is left out of every run, which is more steps at a larger H.
  references = [r["tokens_per_sec"] for r in rows if r["mode"] == "none"]
  reference = sum(references) / len(references) if references else None
  for r in rows:
    r["compute_utilization"] = r["tokens_per_sec"] / reference if reference else None
  title = (f"smoke: {args.hosts} hosts on 127.0.0.1, unshaped, H={SMOKE_H}" if args.smoke else
           f"{args.hosts} hosts, "
           + (f"{args.rate_mbit:g} Mbit/s each way" if args.rate_mbit else "unshaped links")
           + ", H=25, tiny model unless "
           "the run names another")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"hosts": args.hosts, "rate_mbit": None if args.smoke else args.rate_mbit,
               "placement": placement.describe(), "baseline": checkout(args.baseline),
               "rounds": args.rounds, "rows": rows, "smoke": args.smoke,
               **harness.provenance("wan")}, f, indent=2)
  plot(rows, args.out.replace(".json", ".png"), title)
  print(f"\n{title}\n| mode | outer lr, μ | wall s | compute util. | outer-step idle | tokens/s "
        f"| MB/host (wire) | peak MB/sync | comm s/round | final eval loss |\n"
        f"|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    mb = f"{max(r['bytes_per_host']) / 1e6:.1f}" if "bytes_per_host" in r else "0"
    comm = f"{r['comm_s_per_round']:.2f}" if r.get("comm_s_per_round") else "-"
    peak = f"{r['peak_bytes_per_sync'] / 1e6:.3f}" if r.get("peak_bytes_per_sync") else "-"
    util = f"{r['compute_utilization']:.2f}" if r["compute_utilization"] else "-"  # no none
    print(f"| {r['mode']} | {r['outer_lr']}, {r['outer_momentum']} | {r['wall_s']:.1f} | "
          f"{util} | {100 * r['idle_fraction']:.1f}% | "
          f"{r['tokens_per_sec']:,.0f} | {mb} | {peak} | {comm} | "
          f"{r['final_eval_loss']:.4f} |")
  print(f"wrote {args.out} and {args.out.replace('.json', '.png')}")
  if failed and args.smoke:  # a smoke run is a test: any failed run fails it
    sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
  main()
