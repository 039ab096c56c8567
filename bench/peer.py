"""diloco_jax against torchft's DiLoCo: the same model, data and recipe, side by side.

  python -m bench.peer [--pairs=3] [--rounds=4] [--venv=~/.cache/diloco_jax/peer_venv]
  python -m bench.peer --smoke  # seconds: a one-block width-32 model, 1 pair of 2 rounds

The setup: 2 replicas, one process each, each process pinned to its own CPU core and
computing on one thread; H = 50; configs/peer.py's 3.3M-param byte-level GPT (vocab 256,
width 256, 4 blocks of 4 heads, MLP 1024, 128 tokens, batch 8, no biases, untied head);
AdamW lr 1e-3, betas .9/.95, weight decay .1 (matrices and embeddings), global-norm clip 1;
outer Nesterov SGD lr 0.7, momentum 0.9; the bytes of CPython's standard library (its ~170
top-level modules, linked into a temporary directory that both sides read).

  diloco_jax  `launch/local.py --hosts=2 -- --config=configs/peer.py`: one CPU device and
              one replica per host, XLA_FLAGS=--xla_cpu_multi_thread_eigen=false. The
              launcher starts both hosts, so this script pins them: it finds host i (the
              launcher's child with --host_id=i) and sets every thread in /proc/PID/task
              to core i, at once and again every 0.1 s (new threads inherit their
              creator's core).
  torchft     bench/_peer_torch.py: the same model in PyTorch under torchft's `DiLoCo`
              with a `Manager` and `ProcessGroupGloo`, one replica group of one process per
              core (pinned from its exec, torch.set_num_threads(1), OMP_NUM_THREADS=1), and a
              `torchft_lighthouse` process (not pinned: it only forms quorums). It runs in
              a virtualenv of its own (--venv), created with torch and torchft on first use
              (never by --smoke, which skips torchft where that venv does not exist).

Before timing anything, diloco_jax's initial params are loaded into the torch model, whose
logits on random tokens must equal diloco_jax's (to 1e-4); the two runs' parameter counts
must be equal too, or the bench stops. What still differs: diloco_jax's lr is its warmup +
cosine schedule made flat (warmup 0, final lr fraction 1.0); it reads shuffled whole
windows of the first 95% of the bytes, the torch loop random windows of the same 95%; the
torch replicas first meet at the end of round 1 (a quorum; no initial sync, as each side's
replicas start from one seed), diloco_jax's hosts at start-up.

The runs alternate, diloco_jax then torchft, --pairs times, each --rounds rounds; round 1
(compilation, the first quorum) is reported apart. Per run: tokens/s per replica (B x L x
H over the median round time of rounds 2..R), and of the inner steps alone (the round less
the training thread's time in the sync: diloco_jax's outer_time, torchft's time in
DiLoCo's optimizer hook over all the round's steps); the outer step (diloco_jax: its metrics'
outer_time, d2h + mean + update + h2d; torchft: the time inside DiLoCo's optimizer hook on
sync steps: quorum, allreduce, outer SGD, commit); the peak RSS of each replica process
(VmHWM, read every 0.1 s) and of the lighthouse; start-up, from starting the processes to
the first inner step (diloco_jax: when host 0 writes run.json, after compiling, just
before round 1; torchft: the later replica's first step). Then start-up alone,
--startup_reps times in turn, each a run of one round: diloco_jax with an empty
compilation cache, diloco_jax again with the cache that run filled (as a host that
restarts with its workdir finds it), torchft; diloco_jax's starts by phase too, from host
0's run.json (`start.seconds`: the process until the trainer builds, the checks, data,
connections, inner step, init, state and resume; and the launcher's part, the rest). Then,
--join_reps times, a third host joins a running diloco_jax job with an empty workdir (the
hosts keep their own compilation caches; it starts once host 0 has a record, pinned to
host 0's core, as there are two): it takes the compiled programs a member holds, and its
run.json says how long it took from its process's start to the state it trains from
(`start_s`; `own_s`, less its wait for the members' round boundary), against a cached
start's total.
Writes bench/results/peer.json and prints a markdown table of the medians over runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

from bench import harness
from configs import peer as peer_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "diloco_jax", "peer_venv")
# torch's CPU wheel where the index has one; torchft 0.2.0 ships `torchft_lighthouse`.
PEER_PACKAGES = ("torch==2.13.0", "torchft==0.2.0", "numpy")
SMOKE = {"d_model": 32, "num_layers": 1, "num_heads": 2, "mlp_dim": 64, "seq_len": 16,
         "batch_size": 2, "inner_steps": 2, "rounds": 2, "pairs": 1, "startup_reps": 1,
         "join_reps": 1}
JOIN_ROUNDS = 10_000  # of the job a host joins: stopped once it has joined
SHAPE = ("d_model", "num_layers", "num_heads", "mlp_dim", "seq_len")
RUN_TIMEOUT_S = 1800


def stdlib_dir() -> str:
  """A new temporary directory of links to the standard library's top-level modules."""
  path = tempfile.mkdtemp(prefix="bench_peer_stdlib_")
  for f in sorted(glob.glob(os.path.join(sysconfig.get_path("stdlib"), "*.py"))):
    os.symlink(f, os.path.join(path, os.path.basename(f)))
  return path


# Every process this script starts runs through `python -c _EXEC CPU COMMAND...`: pinned
# to core CPU (-1: any) and killed when this script dies (as launch/local.py's hosts are
# when it dies), then COMMAND by exec. Not a preexec_fn: that forks this threaded process.
_EXEC = ("import ctypes, os, signal, sys; cpu = int(sys.argv[1]); "
         "cpu >= 0 and os.sched_setaffinity(0, {cpu}); "
         "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG
         "os.execv(sys.argv[2], sys.argv[2:])")


def shim(command: list[str], cpu: int | None = None) -> list[str]:
  return [sys.executable, "-c", _EXEC, str(-1 if cpu is None else cpu), *command]


class Watcher(threading.Thread):
  """Every 0.1 s: keeps every thread of each watched process on its core, and reads the
  process's peak RSS (VmHWM, which only grows: the last reading is the peak but for the
  process's last 0.1 s), the largest of its anonymous RSS readings (RssAnon: the heap,
  not the pages of mapped files such as the libraries' code, which the page cache holds
  once for every process mapping them; a sample, so a peak shorter than 0.1 s may be
  missed) and its number of threads."""

  def __init__(self):
    super().__init__(daemon=True)
    self._cpus: dict[int, int | None] = {}
    self.peak_kib: dict[int, int] = {}
    self.anon_kib: dict[int, int] = {}
    self.threads: dict[int, int] = {}
    self._lock, self._done = threading.Lock(), threading.Event()
    self.start()

  def watch(self, pid: int, cpu: int | None) -> None:
    with self._lock:
      self._cpus[pid] = cpu
    self._visit(pid, cpu)

  def forget(self, pids) -> None:
    """Stops watching `pids` (once they have exited: their numbers may be reused)."""
    with self._lock:
      for pid in pids:
        self._cpus.pop(pid, None)

  def stop(self) -> None:
    self._done.set()
    self.join()

  def run(self) -> None:
    while not self._done.wait(0.1):
      with self._lock:
        watched = list(self._cpus.items())
      for pid, cpu in watched:
        self._visit(pid, cpu)

  def _visit(self, pid: int, cpu: int | None) -> None:
    try:
      tids = os.listdir(f"/proc/{pid}/task")
      self.threads[pid] = max(self.threads.get(pid, 0), len(tids))
      for tid in tids if cpu is not None else ():
        if os.sched_getaffinity(int(tid)) != {cpu}:
          os.sched_setaffinity(int(tid), {cpu})
      with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
      for peaks, key in ((self.peak_kib, "VmHWM"), (self.anon_kib, "RssAnon")):
        if key in status:
          peaks[pid] = max(peaks.get(pid, 0), int(status[key].split()[0]))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
      pass  # exited (or a thread did) between the listing and the call


def steady(values: list[float]) -> list[float]:
  """The rounds after the first (the whole list when there is only one)."""
  return values[1:] or values


def run_jax(args, data: str, cpus: list[int], watcher: Watcher, cache: str = "") -> dict:
  """One diloco_jax run through the local launcher, its hosts pinned to `cpus`; `cache`:
  the compilation cache (default: the trainer's own, in its new workdir: empty)."""
  workdir = tempfile.mkdtemp(prefix="bench_peer_jax_")
  cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--hosts=2", "--",
         "--config=configs/peer.py", f"--workdir={workdir}", f"--config.data.path={data}",
         *([f"--compilation_cache={cache}"] if cache else []),
         f"--config.num_rounds={args.rounds}", f"--config.inner_steps={args.inner_steps}",
         f"--config.batch_size={args.batch_size}",
         *(f"--config.model.{k}={getattr(args, k)}" for k in SHAPE)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                             "--xla_cpu_multi_thread_eigen=false")))}
  log_path = os.path.join(workdir, "launcher.log")
  pids: dict[int, int] = {}  # host id -> pid
  proc = None
  try:
    with open(log_path, "w") as log:
      t0 = time.time()
      proc = subprocess.Popen(shim(cmd), cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
      while len(pids) < 2 and proc.poll() is None and time.time() - t0 < 60:
        for host, pid in harness.host_pids(proc.pid).items():
          if host not in pids:
            pids[host] = pid
            watcher.watch(pid, cpus[host])
        time.sleep(0.01)
      try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        code = "timeout"
      wall = time.time() - t0
    if code != 0 or len(pids) < 2:
      with open(log_path) as f:
        raise RuntimeError(f"diloco_jax run failed ({code}; hosts found {pids}):\n"
                           + f.read()[-4000:])
    with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    with open(os.path.join(harness.host_dir(workdir), "run.json")) as f:
      run = json.load(f)
    params, start_seconds = run["num_params"], run["start"].get("seconds", {})
    startup = os.path.getmtime(os.path.join(harness.host_dir(workdir), "run.json")) - t0
  finally:
    if proc is not None and proc.poll() is None:  # interrupted: its hosts die with it
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    watcher.forget(pids.values())
    shutil.rmtree(workdir, ignore_errors=True)
  rounds = [r["round_time"] for r in records]
  return {"system": "diloco_jax", "params": params, "round_times": rounds,
          "outer_times": [r["outer_time"] for r in records],
          "wait_times": [r["outer_time"] for r in records],
          "train_losses": [r["train_loss"] for r in records],
          "startup_s": startup, "start_seconds": start_seconds,  # host 0's, by phase
          "first_round_s": rounds[0], "wall_s": wall,
          "peak_rss_mib": [watcher.peak_kib.get(pids[h], 0) / 1024 for h in range(2)],
          "peak_anon_mib": [watcher.anon_kib.get(pids[h], 0) / 1024 for h in range(2)],
          "threads": [watcher.threads.get(pids[h], 0) for h in range(2)]}


def run_join(args, data: str, cpus: list[int], watcher: Watcher) -> dict:
  """A third host that joins a running diloco_jax job with an empty workdir, and takes the
  compiled programs a member holds (membership/programs.py): the two hosts train on their
  cores; once host 0 has written its first record the launcher starts host 2 (SIGUSR1,
  --max_hosts=3), pinned to host 0's core, whose run.json says how long it took from its
  process's start to a state it trains from (`start.seconds.total`) and what it took."""
  workdir = tempfile.mkdtemp(prefix="bench_peer_join_")
  rounds = max(args.rounds, JOIN_ROUNDS)
  cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--hosts=2",
         "--max_hosts=3", "--join_later=-1", "--workdir_per_host", "--",
         "--config=configs/peer.py", f"--workdir={workdir}", f"--config.data.path={data}",
         f"--config.num_rounds={rounds}", f"--config.inner_steps={args.inner_steps}",
         f"--config.batch_size={args.batch_size}",
         *(f"--config.model.{k}={getattr(args, k)}" for k in SHAPE)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": "",  # their own
         "XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                             "--xla_cpu_multi_thread_eigen=false")))}
  pids: dict[int, int] = {}
  proc = None
  joiner = os.path.join(workdir, "host2", "run.json")
  try:
    with open(os.path.join(workdir, "launcher.log"), "w") as log:
      proc = subprocess.Popen(shim(cmd), cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
      deadline, started = time.time() + RUN_TIMEOUT_S, False
      while proc.poll() is None and time.time() < deadline and not os.path.exists(joiner):
        for host, pid in harness.host_pids(proc.pid).items():
          if host not in pids:
            pids[host] = pid
            watcher.watch(pid, cpus[host % 2])
        if not started and _size(os.path.join(workdir, "host0", "metrics.jsonl")) > 0:
          proc.send_signal(signal.SIGUSR1)  # the members have compiled and trained a round
          started = True
        time.sleep(0.01)
      proc.send_signal(signal.SIGTERM)  # every host stops after one round, with a checkpoint
      code = proc.wait(timeout=RUN_TIMEOUT_S)
    with open(joiner) as f:
      start = json.load(f)["start"]
  except (OSError, ValueError, KeyError) as e:
    with open(os.path.join(workdir, "launcher.log")) as f:
      raise RuntimeError(f"the joining host wrote no run.json ({type(e).__name__}: {e}):\n"
                         + f.read()[-4000:]) from None
  finally:
    if proc is not None and proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    watcher.forget(pids.values())
    shutil.rmtree(workdir, ignore_errors=True)
  if code != 0 or "joined" not in start:
    raise RuntimeError(f"the join run ended {code}; the joiner's start: {start}")
  return {"start_s": start["seconds"]["total"], "seconds": start["seconds"],
          # less the wait for the members' round boundary, which a round's length decides
          "own_s": start["seconds"]["total"] - start["seconds"].get("admitted", 0.0),
          "programs": start.get("programs"), "joined_round": start["joined"]["round"]}


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


def ensure_venv(venv: str) -> str:
  """The venv's python, after creating the venv and installing PEER_PACKAGES if needed."""
  python = os.path.join(venv, "bin", "python")
  ok = os.path.exists(python) and subprocess.run(
      [python, "-c", "import torch, torchft"], capture_output=True, check=False).returncode == 0
  if not ok:
    print(f"creating {venv} with {', '.join(PEER_PACKAGES)} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", *PEER_PACKAGES], check=True)
  return python


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
  end = time.time() + timeout
  while time.time() < end and proc.poll() is None:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      return
    except OSError:
      time.sleep(0.02)
  raise RuntimeError(f"torchft_lighthouse did not open port {port} (exit {proc.poll()})")


def write_spec(args, data: str, directory: str) -> str:
  """bench/_peer_torch.py's spec: configs/peer.py's recipe with this run's sizes."""
  c = args.config
  spec = {"data_path": data, "eval_fraction": c.data.eval_fraction, "seed": c.seed,
          "batch_size": args.batch_size, "inner_steps": args.inner_steps,
          "rounds": args.rounds, **{k: getattr(args, k) for k in SHAPE},
          "norm_eps": c.model.norm_eps, "lr": c.inner.lr, "b1": c.inner.b1, "b2": c.inner.b2,
          "eps": c.inner.eps,
          "weight_decay": c.inner.weight_decay, "clip_norm": c.inner.clip_norm,
          "outer_lr": c.outer.lr, "outer_momentum": c.outer.momentum,
          "nesterov": c.outer.nesterov}
  path = os.path.join(directory, "spec.json")
  with open(path, "w") as f:
    json.dump(spec, f)
  return path


def torch_env() -> dict[str, str]:
  env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
  env.pop("PYTHONPATH", None)  # the venv's own packages only
  return env


def check_same_model(args, python: str) -> dict:
  """diloco_jax's initial params and its logits on random tokens, loaded into the torch
  model: the same architecture gives the same logits, up to float32 rounding."""
  import jax  # noqa: PLC0415 -- only this check needs jax in this process
  import numpy as np  # noqa: PLC0415

  from diloco_jax.models import family  # noqa: PLC0415

  from diloco_jax.models import model as model_lib  # noqa: PLC0415

  config = peer_config.get_config()
  for k in SHAPE:
    config.model[k] = getattr(args, k)
  cfg = family.ModelConfig.from_config(config.model, vocab_size=256)
  params = model_lib.init_params(cfg, jax.random.key(config.seed))
  tokens = np.random.default_rng(0).integers(0, 256, (2, args.seq_len))
  logits = family.build(cfg).apply({"params": params}, tokens)
  arrays = {".".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  with tempfile.TemporaryDirectory(prefix="bench_peer_check_") as tmp:
    npz, out = os.path.join(tmp, "params.npz"), os.path.join(tmp, "check.json")
    np.savez(npz, tokens=tokens, logits=np.asarray(logits), **arrays)
    proc = subprocess.run([python, os.path.join(REPO, "bench", "_peer_torch.py"),
                           f"--spec={write_spec(args, '', tmp)}", f"--check={npz}",
                           f"--out={out}"], env=torch_env(), capture_output=True, text=True,
                          check=False)
    if proc.returncode:
      raise RuntimeError(f"the torch model could not take diloco_jax's params:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    with open(out) as f:
      check = json.load(f)
  check["params"] = model_lib.count_params(params)
  if check["max_abs_logit_diff"] > 1e-4:
    raise RuntimeError(f"the two models differ: with diloco_jax's params, the torch model's "
                       f"logits are off by up to {check['max_abs_logit_diff']:.3g}")
  return check


def run_torch(args, python: str, data: str, cpus: list[int], watcher: Watcher) -> dict:
  """One torchft run: a lighthouse and two replica processes pinned to `cpus`."""
  tmp = tempfile.mkdtemp(prefix="bench_peer_torch_")
  spec = write_spec(args, data, tmp)
  env = torch_env()
  procs, logs = [], []
  try:
    port = harness.free_port()
    lighthouse_log = open(os.path.join(tmp, "lighthouse.log"), "w")
    logs.append(lighthouse_log)
    t = time.time()
    lighthouse = subprocess.Popen(shim(
        [os.path.join(os.path.dirname(python), "torchft_lighthouse"), "--min_replicas=2",
         f"--bind=127.0.0.1:{port}", "--quorum_tick_ms=100", "--join_timeout_ms=10000"]),
        env=env, stdout=lighthouse_log, stderr=subprocess.STDOUT)
    procs.append(lighthouse)
    wait_for_port(port, lighthouse)
    lighthouse_startup = time.time() - t
    watcher.watch(lighthouse.pid, None)
    t0 = time.time()
    for i in range(2):
      logs.append(open(os.path.join(tmp, f"replica{i}.log"), "w"))
      procs.append(subprocess.Popen(shim(
          [python, os.path.join(REPO, "bench", "_peer_torch.py"), f"--spec={spec}",
           f"--replica={i}", f"--lighthouse=http://127.0.0.1:{port}",
           f"--out={os.path.join(tmp, f'r{i}.json')}"], cpus[i]),
          env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
      watcher.watch(procs[-1].pid, cpus[i])
    deadline = time.time() + RUN_TIMEOUT_S
    codes = [p.wait(timeout=max(deadline - time.time(), 1)) for p in procs[1:]]
    wall = time.time() - t0
    if any(codes):
      tails = ""
      for i in range(2):
        with open(os.path.join(tmp, f"replica{i}.log")) as f:
          tails += f.read()[-3000:]
      raise RuntimeError(f"torchft run failed (exit codes {codes}):\n{tails}")
    results = replica_results(tmp)
  finally:
    stop(procs)  # the lighthouse always; replicas only after a failure
    watcher.forget(p.pid for p in procs)
    for f in logs:
      f.close()
    shutil.rmtree(tmp, ignore_errors=True)
  if any(r["manager_step"] != args.rounds for r in results):
    raise RuntimeError(f"torchft committed {[r['manager_step'] for r in results]} outer "
                       f"steps, not {args.rounds}: a sync failed")
  per_round = list(zip(*(r["round_times"] for r in results)))
  both_start = max(r["t_first_step"] for r in results)
  return {"system": "torchft", "params": results[0]["params"],
          "round_times": [statistics.mean(x) for x in per_round],
          "outer_times": [statistics.mean(x) for x in zip(*(r["outer_times"] for r in results))],
          # every inner step's optimizer hook: the sync steps' and the others' (bookkeeping)
          "wait_times": [statistics.mean(x) for x in zip(*(r["wait_times"] for r in results))],
          "train_losses": [statistics.mean(x) for x in zip(*(r["train_losses"] for r in results))],
          "startup_s": both_start - t0,
          # from the moment both replicas step to the end of round 1 (the first quorum)
          "first_round_s": max(r["t_first_step"] + r["round_times"][0] for r in results)
                           - both_start,
          "wall_s": wall, "peak_rss_mib": [watcher.peak_kib.get(p.pid, 0) / 1024
                                           for p in procs[1:]],
          "peak_anon_mib": [watcher.anon_kib.get(p.pid, 0) / 1024 for p in procs[1:]],
          "lighthouse_rss_mib": watcher.peak_kib.get(lighthouse.pid, 0) / 1024,
          "lighthouse_startup_s": lighthouse_startup, "torch": results[0]["torch"],
          "torch_threads": [r["threads"] for r in results],
          "threads": [watcher.threads.get(p.pid, 0) for p in procs[1:]],
          "affinity": [r["affinity"] for r in results]}


def startup_runs(args, python: str | None, data: str, cpus: list[int],
                 watcher: Watcher) -> dict:
  """Start-up to the first step, --startup_reps times in turn: diloco_jax with an empty
  compilation cache, again with the cache the first run filled (a host that restarts
  with its workdir), and torchft; each a run of one round."""
  short = argparse.Namespace(**{**vars(args), "rounds": 1})
  times = {"diloco_jax_fresh": [], "diloco_jax_cached": [], "torchft": []}
  phases = {"diloco_jax_fresh": [], "diloco_jax_cached": []}  # host 0's run.json, by phase
  for rep in range(args.startup_reps):
    cache = tempfile.mkdtemp(prefix="bench_peer_cache_")
    try:
      for key in ("diloco_jax_fresh", "diloco_jax_cached"):
        run = run_jax(short, data, cpus, watcher, cache)
        times[key].append(run["startup_s"])
        # the launcher's part: from starting it to host 0's process
        phases[key].append({**run["start_seconds"],
                            "launcher": run["startup_s"] - run["start_seconds"]["total"]})
    finally:
      shutil.rmtree(cache, ignore_errors=True)
    if python:
      times["torchft"].append(run_torch(short, python, data, cpus, watcher)["startup_s"])
    print(f"start-up {rep + 1}/{args.startup_reps}: "
          + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), flush=True)
  out = {"reps": times, **{k: statistics.median(v) for k, v in times.items() if v},
         "phases": {k: {phase: statistics.median(p[phase] for p in v) for phase in v[0]}
                    for k, v in phases.items()}}
  if times["torchft"]:
    for key in ("diloco_jax_fresh", "diloco_jax_cached"):
      out[f"{key}_vs_torchft"] = out[key] / out["torchft"]
  return out


def replica_results(directory: str) -> list[dict]:
  """What each torch replica wrote (bench/_peer_torch.py's --out: DIRECTORY/r<i>.json)."""
  results = []
  for i in range(2):
    with open(os.path.join(directory, f"r{i}.json")) as f:
      results.append(json.load(f))
  return results


def stop(procs: list[subprocess.Popen]) -> None:
  """Kills those of `procs` still running and reaps them all."""
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def summarize(run: dict, tokens_per_round: int) -> dict:
  """The run's figures over its steady rounds (all but the first)."""
  round_time = statistics.median(steady(run["round_times"]))
  # Compute only: the round less the time the training thread spent in the sync (the
  # outer step, the wait for the mean, the quorum).
  inner = statistics.median(t - w for t, w in zip(steady(run["round_times"]),
                                                 steady(run["wait_times"])))
  return {**run, "round_time_s": round_time,
          "tokens_per_sec_per_replica": tokens_per_round / round_time,
          "inner_tokens_per_sec_per_replica": tokens_per_round / inner,
          "outer_time_s": statistics.median(steady(run["outer_times"])),
          "max_peak_rss_mib": max(run["peak_rss_mib"]),
          "max_peak_anon_mib": max(run["peak_anon_mib"]),
          "final_train_loss": run["train_losses"][-1]}


FIGURES = ("tokens_per_sec_per_replica", "inner_tokens_per_sec_per_replica", "round_time_s", "outer_time_s", "first_round_s",
           "startup_s", "max_peak_rss_mib", "max_peak_anon_mib", "final_train_loss")


def medians(runs: list[dict]) -> dict | None:
  if not runs:
    return None
  out = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
  if "lighthouse_rss_mib" in runs[0]:
    out["lighthouse_rss_mib"] = statistics.median(r["lighthouse_rss_mib"] for r in runs)
  return out


def table(summary: dict, ratio: float | None) -> str:
  rows = [("tokens/s per replica", "tokens_per_sec_per_replica", "{:,.0f}"),
          ("of the inner steps alone", "inner_tokens_per_sec_per_replica", "{:,.0f}"),
          ("round (s)", "round_time_s", "{:.2f}"),
          ("outer step (ms)", "outer_time_s", None),
          ("first round (s)", "first_round_s", "{:.2f}"),
          ("start-up to first step (s)", "startup_s", "{:.1f}"),
          ("peak RSS per replica process (MiB)", "max_peak_rss_mib", "{:,.0f}"),
          ("of it anonymous, peak (MiB)", "max_peak_anon_mib", "{:,.0f}"),
          ("train loss, last round", "final_train_loss", "{:.3f}")]
  sides = [s for s in ("diloco_jax", "torchft") if summary.get(s)]
  lines = ["| | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
  for label, key, fmt in rows:
    cells = [f"{1e3 * summary[s][key]:.0f}" if fmt is None else fmt.format(summary[s][key])
             for s in sides]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  if summary.get("torchft"):
    lines.append(f"| lighthouse process RSS (MiB) | – | "
                 f"{summary['torchft']['lighthouse_rss_mib']:,.0f} |")
  text = "\n".join(lines)
  if ratio is not None:
    text += f"\n\ndiloco_jax / torchft tokens/s per replica: **{ratio:.2f}**"
  return text


def main(argv=None):
  config = peer_config.get_config()
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--pairs", type=int, default=3, help="diloco_jax, torchft runs, in turn")
  parser.add_argument("--rounds", type=int, default=4, help="rounds per run, the first untimed")
  parser.add_argument("--inner_steps", type=int, default=config.inner_steps, help="H")
  parser.add_argument("--batch_size", type=int, default=config.batch_size)
  for key in SHAPE:
    parser.add_argument(f"--{key}", type=int, default=config.model[key])
  parser.add_argument("--data", default="", help="a text file or directory both sides read "
                      "(default: links to the running Python's stdlib *.py, made here)")
  parser.add_argument("--venv", default=DEFAULT_VENV,
                      help="the virtualenv torchft runs in (created if missing, but not by "
                           "--smoke, which then skips torchft)")
  parser.add_argument("--skip_torchft", action="store_true", help="diloco_jax runs only")
  parser.add_argument("--startup_reps", type=int, default=3,
                      help="start-ups timed apart (fresh, cached, torchft), one round each")
  parser.add_argument("--join_reps", type=int, default=3,
                      help="a third host joining a running job with an empty workdir, timed "
                           "to the state it trains from (against a cached start's)")
  args = harness.parse_args(parser, "peer", SMOKE, argv)
  args.config = config
  cpus = sorted(os.sched_getaffinity(0))
  cpus = [cpus[0], cpus[1 % len(cpus)]]  # one core per replica where there are two
  python = None
  if not args.skip_torchft:
    if not args.smoke:
      python = ensure_venv(args.venv)
    elif os.path.exists(os.path.join(args.venv, "bin", "torchft_lighthouse")):
      python = os.path.join(args.venv, "bin", "python")
    else:
      print(f"--smoke: no torchft venv at {args.venv}: diloco_jax only", flush=True)
  same_model = check_same_model(args, python) if python else None
  if same_model:
    print(f"the same model: with diloco_jax's initial params ({same_model['params']:,}), "
          f"the torch model's logits differ by at most {same_model['max_abs_logit_diff']:.1e}",
          flush=True)
  data = args.data or stdlib_dir()
  tokens_per_round = args.inner_steps * args.batch_size * args.seq_len
  watcher = Watcher()
  runs = {"diloco_jax": [], "torchft": []}
  try:
    for p in range(1, args.pairs + 1):
      runs["diloco_jax"].append(summarize(run_jax(args, data, cpus, watcher), tokens_per_round))
      if python:
        runs["torchft"].append(summarize(run_torch(args, python, data, cpus, watcher),
                                         tokens_per_round))
      for name, rs in runs.items():
        if rs:
          r = rs[-1]
          print(f"pair {p}/{args.pairs} {name}: {r['tokens_per_sec_per_replica']:,.0f} tok/s "
                f"per replica, rounds {', '.join(f'{t:.2f}' for t in r['round_times'])} s, "
                f"outer {1e3 * r['outer_time_s']:.0f} ms, start-up {r['startup_s']:.1f} s, "
                f"{r['params']:,} params, threads {r['threads']} on cores {cpus}", flush=True)
      params = {name: rs[-1]["params"] for name, rs in runs.items() if rs}
      if len(set(params.values())) > 1:
        raise RuntimeError(f"the two models differ: {params} params")
    startup = startup_runs(args, python, data, cpus, watcher)
    joins = [run_join(args, data, cpus, watcher) for _ in range(args.join_reps)]
    if joins:
      startup["join"] = joins
      startup["diloco_jax_join"] = statistics.median(j["start_s"] for j in joins)
      startup["diloco_jax_join_own"] = statistics.median(j["own_s"] for j in joins)
      cached = startup["phases"]["diloco_jax_cached"]["total"]  # host 0's run.json, median
      startup["diloco_jax_join_vs_cached"] = startup["diloco_jax_join"] / cached
      startup["diloco_jax_join_own_vs_cached"] = startup["diloco_jax_join_own"] / cached
      print(f"a host that joins with a member's programs: {startup['diloco_jax_join']:.2f} s "
            f"from its process's start to its state, {startup['diloco_jax_join_vs_cached']:.2f}x "
            f"a cached start's {cached:.2f} s; without the wait for the members' boundary "
            f"{startup['diloco_jax_join_own']:.2f} s, "
            f"{startup['diloco_jax_join_own_vs_cached']:.2f}x ({joins[-1]['programs']})",
            flush=True)
  finally:
    watcher.stop()
    if not args.data:
      shutil.rmtree(data, ignore_errors=True)
  summary = {name: medians(rs) for name, rs in runs.items()}
  ratio = (summary["diloco_jax"]["tokens_per_sec_per_replica"]
           / summary["torchft"]["tokens_per_sec_per_replica"] if summary["torchft"] else None)
  pair_ratios = [a["tokens_per_sec_per_replica"] / b["tokens_per_sec_per_replica"]
                 for a, b in zip(runs["diloco_jax"], runs["torchft"])]
  inner_ratios = [a["inner_tokens_per_sec_per_replica"] / b["inner_tokens_per_sec_per_replica"]
                  for a, b in zip(runs["diloco_jax"], runs["torchft"])]
  result = {
      "config": {"pairs": args.pairs, "rounds": args.rounds, "inner_steps": args.inner_steps,
                 "batch_size": args.batch_size, **{k: getattr(args, k) for k in SHAPE},
                 "replicas": 2, "cpus": cpus, "data": args.data or "stdlib *.py",
                 "tokens_per_round_per_replica": tokens_per_round},
      "params": params, "same_model": same_model, "summary": summary, "ratio_tokens_per_sec": ratio,
      "pair_ratios": pair_ratios, "inner_pair_ratios": inner_ratios,
      "ratio_inner_tokens_per_sec": statistics.median(inner_ratios) if inner_ratios else None,
      "startup": startup,
      "runs": runs, "torchft_skipped": python is None,
      "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "smoke": args.smoke,
      **harness.provenance("peer", argv)}
  harness.write(args.out, result, indent=1)
  print("\nparams: " + ", ".join(f"{k} {v:,}" for k, v in params.items()))
  print(f"medians over {args.pairs} run(s) each, rounds 2..{args.rounds}:\n")
  print(table(summary, ratio))
  if pair_ratios:
    print("per pair: " + ", ".join(f"{x:.2f}" for x in pair_ratios)
          + "; the inner steps alone: " + ", ".join(f"{x:.2f}" for x in inner_ratios)
          + f" (median {statistics.median(inner_ratios):.2f})")
  print("start-up to the first step, median: " + ", ".join(
      f"{k} {startup[k]:.2f} s" for k in ("diloco_jax_fresh", "diloco_jax_cached", "torchft")
      if k in startup) + "".join(f"; {k} {startup[k]:.2f}" for k in startup if k.endswith("_vs_torchft")))
  for key, phases in startup["phases"].items():
    print(f"{key} by phase (median s): "
          + ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items()))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
