"""Loss against bytes sent: every way of training the same model on the same real text.

  python -m bench.quality [--methods=ddp,sync,...] [--rounds=20] [--inner_steps=24] [--out=...]
  python -m bench.quality --smoke  # a minute: a small corpus, 2 rounds of 2 steps, 2 methods
  python -m bench.quality --methods=eager --variant=eager_m0.7=eager:--config.outer.momentum=0.7

Each method trains configs/small_text.py's model (a 2-block GPT, BPE of 4,096 tokens) on
2 host processes x 2 replicas (K = 4) through launch/local.py, from the same seed, data
and tokens: `rounds` x `inner_steps` steps of 16 x 128 tokens per replica. The corpus is
the Python standard library's sources prepared by `python -m diloco_jax.prepare`
(--corpus; made on first use in ~/.cache/diloco_jax/stdlib_bpe4k, as in small_text.py;
`--stdlib=tree`: every source file of the library's tree, 6.7x the text, for runs long
enough to overfit the first).
Methods (METHODS): ddp (a sum of gradients every step), sync DiLoCo, eager, streaming
(P = 2 fragments, 4-bit), sync with int8, SparseLoCo (configs/sparseloco.py's wire and
outer step) and MuLoCo (configs/muloco.py: Muon inner, 2-bit with error feedback).
`--variant=NAME=METHOD:FLAG,FLAG` adds a method: METHOD with these trainer flags (a sweep;
a flag METHOD already sets is replaced).
Reports per method: final eval loss and bits per byte, bytes host 0 sent per round (the
collective's own count; bench/wan.py checks it against a veth) and in all, wall time, and
the compute utilization on a --link_mbit link (default 8 Mbit/s, bench/wan.py's),
modelled from those bytes and the inner phase's time measured here: a round's sums take
bytes x 8 / rate seconds; sync, int8, SparseLoCo, MuLoCo, streaming (tau = 0) and ddp
(every step) wait for them, eager hides them behind the next inner phase up to its length:
utilization = inner / (inner + comm), eager inner / max(inner, comm). Writes
bench/results/quality.json (again after every method; `complete`: all of them ran) and
quality.png beside it (eval loss against total bytes, log x; git ignores the plot). On one
machine the link is loopback: this measures what each method learns per byte, not how long
the bytes take (bench/wan.py shapes a link for that).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (config file, overrides). configs/eager.py, sparseloco.py and muloco.py are
# small_text.py's model and corpus with their own mode, wire, optimizers and outer step.
METHODS = {
    "ddp": ("small_text", ["--config.mode=ddp"]),
    "sync": ("small_text", []),
    "eager": ("eager", []),
    "streaming": ("small_text", ["--config.mode=streaming", "--config.outer.fragments=2",
                                 "--config.outer.compression=4bit"]),
    "int8": ("small_text", ["--config.outer.compression=int8"]),
    "sparseloco": ("sparseloco", []),
    "muloco": ("muloco", []),
}
SMOKE_FLAGS = ["--config.batch_size=2", "--config.eval_batches=1",
               "--config.model.num_layers=1", "--config.inner.warmup_steps=1"]


# --stdlib: which of the standard library's sources make the corpus. `modules`: the ~170
# top-level modules (4.7 MB, 1.3M tokens; configs/small_text.py's corpus); `tree`: every
# source file of the tree but site-packages, tests included (~31 MB, 6.7x the text).
CORPORA = {"modules": "stdlib_bpe4k", "tree": "stdlib_tree_bpe4k"}


def default_corpus(stdlib: str = "modules") -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "diloco_jax", CORPORA[stdlib])


def prepare(output: str, smoke: bool, stdlib: str) -> None:
  """The standard library's sources as a prepared corpus (smoke: its 10 largest modules,
  as bytes)."""
  root = sysconfig.get_path("stdlib")
  if smoke:
    inputs = sorted(glob.glob(os.path.join(root, "*.py")), key=os.path.getsize)[-10:]
    options = ["--tokenizer=bytes", "--eval_fraction=0.2"]  # 2 for eval, 8 for 4 replicas
  else:
    options = ["--tokenizer=train", "--vocab_size=4096", "--eval_fraction=0.05"]
    if stdlib == "modules":
      inputs = [os.path.join(root, "*.py")]
    else:
      inputs, options = [root], [*options, "--exclude=site-packages"]
  subprocess.run([sys.executable, "-m", "diloco_jax.prepare", *options,
                  *[f"--input={i}" for i in inputs],
                  f"--output={output}"], cwd=REPO, check=True, capture_output=True, text=True)


OVERLAPPED = ("eager",)  # the methods whose sums run behind the next inner phase


def override(flags: list[str], more: list[str]) -> list[str]:
  """flags with more's: one of more that sets a key flags sets replaces it, in its place."""
  key = lambda flag: flag.partition("=")[0]
  new = {key(f): f for f in more}
  out = [new.pop(key(f), f) for f in flags]
  return out + [f for f in more if key(f) in new]


def run(name: str, corpus: str, args: argparse.Namespace) -> dict:
  base, more = args.variants.get(name, (name, []))  # a variant: its method and flags
  config, extra = METHODS[base]
  extra = override(extra, more)
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), f"--hosts={args.hosts}",
           "--", f"--config=configs/{config}.py", f"--workdir={workdir}",
           f"--config.data.path={corpus}",
           f"--config.replicas_per_host={args.replicas_per_host}",
           f"--config.num_rounds={args.rounds}", f"--config.inner_steps={args.inner_steps}",
           f"--config.eval_every={max(args.rounds // 4, 1)}", "--config.checkpoint.every=0",
           *(SMOKE_FLAGS if args.smoke else []), *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
      raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    with open(os.path.join(harness.host_dir(workdir), "run.json")) as f:
      params = json.load(f)["num_params"]
  last = records[-1]
  steady = records[1:] or records  # round 1 compiles
  inner = statistics.median(r["round_time"] - r["outer_time"] for r in steady)
  bytes_per_round = statistics.median(r.get("bytes_sent", 0) for r in records)
  comm = bytes_per_round * 8 / (args.link_mbit * 1e6)
  utilization = inner / max(inner, comm) if base in OVERLAPPED else inner / (inner + comm)
  return {"method": name, "config": f"configs/{config}.py", "overrides": extra,
          "params": params,
          "final_eval_loss": last["eval_loss"], "final_eval_bpb": last.get("eval_bpb"),
          "tokens": last["tokens"], "wall_s": wall,
          "bytes_per_round": bytes_per_round,
          "total_bytes": sum(r.get("bytes_sent", 0) for r in records),
          "inner_seconds_per_round": inner, "link_mbit": args.link_mbit,
          "utilization": utilization,
          "curve": [(r["tokens"], r["eval_loss"]) for r in records if "eval_loss" in r]}


def plot(rows: list[dict], path: str) -> None:
  import matplotlib

  from diloco_jax.reporting import plots
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  for row in rows:
    ax.plot(max(row["total_bytes"], 1), row["final_eval_loss"], "o", label=row["method"])
    ax.annotate(row["method"], (max(row["total_bytes"], 1), row["final_eval_loss"]),
                textcoords="offset points", xytext=(4, 4), fontsize=8)
  ax.set_xscale("log")
  plots.save_figure(fig, ax, path, xlabel="bytes host 0 sent in all (log)",
                      ylabel="final eval loss (nats/token)",
                      title="What each method learns per byte (K = 4, same tokens)")



def outer_steps(rows: list[dict]) -> dict[str, dict]:
  """Each config's outer step as its file has it now (lr, momentum; SparseLoCo's top-k of a
  chunk): the performance page labels the rows with it, since a config may change later."""
  out = {}
  for path in sorted({r["config"] for r in rows}):
    spec = importlib.util.spec_from_file_location("config_of_row", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outer = module.get_config().outer
    out[path] = {"lr": outer.lr, "momentum": outer.momentum}
    if outer.compression == "chunk_topk":
      out[path]["topk"] = round(outer.topk_fraction * outer.topk_chunk)
  return out

def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--methods", default=",".join(METHODS), help=f"from {', '.join(METHODS)}")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--inner_steps", type=int, default=24,
                      help="H (streaming's P = 2 must divide it)")
  parser.add_argument("--hosts", type=int, default=2)
  parser.add_argument("--replicas_per_host", type=int, default=2)
  parser.add_argument("--variant", action="append", default=[],
                      help="NAME=METHOD:FLAG,FLAG: METHOD with these trainer flags as NAME")
  parser.add_argument("--link_mbit", type=float, default=8.0,
                      help="the link of the modelled utilization, Mbit/s")
  parser.add_argument("--corpus", default=None,
                      help="a prepared directory (default: --stdlib's in "
                      f"{os.path.dirname(default_corpus())}, made if missing)")
  parser.add_argument("--stdlib", default="modules", choices=sorted(CORPORA),
                      help="the default corpus: the standard library's top-level modules "
                      "(4.7 MB of text) or its whole tree but site-packages (31 MB)")
  args = harness.parse_args(parser, "quality", dict(methods="sparseloco,muloco", rounds=2,
                                                   inner_steps=2))
  args.variants = {}  # name -> (method, its extra flags)
  names = args.methods.split(",") if args.methods else []
  for v in args.variant:
    name, eq, rest = v.partition("=")
    method, colon, flags = rest.partition(":")
    if not (eq and colon and name) or method not in METHODS:
      parser.error(f"--variant={v}: expected NAME=METHOD:FLAG,FLAG with METHOD from "
                   f"{', '.join(METHODS)}")
    args.variants[name] = (method, flags.split(","))
    names.append(name)
  unknown = set(names) - set(METHODS) - set(args.variants)
  if unknown:
    parser.error(f"unknown --methods {sorted(unknown)}; from {', '.join(METHODS)}")
  corpus = args.corpus
  if corpus is None:
    corpus = (os.path.join(os.path.dirname(args.out), "corpus") if args.smoke
              else default_corpus(args.stdlib))
  if not os.path.exists(os.path.join(corpus, "manifest.json")):
    print(f"preparing {corpus} from the standard library's sources", flush=True)
    prepare(corpus, args.smoke, args.stdlib)
  rows = []
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for name in names:
    rows.append(run(name, corpus, args))
    # Written after every method: a long study stopped part way keeps what it measured.
    result = {"rows": rows, "hosts": args.hosts, "replicas_per_host": args.replicas_per_host,
              "rounds": args.rounds, "inner_steps": args.inner_steps, "corpus": corpus,
              "smoke": args.smoke, "complete": len(rows) == len(names),
              "outer_steps": outer_steps(rows), **harness.provenance("quality")}
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"done: {name} (written to {args.out})", flush=True)
  plot(rows, os.path.splitext(args.out)[0] + ".png")
  ref = next((r for r in rows if r["method"] == "sync"), None)
  print(f"\n| method | final eval loss | bits/byte | vs sync | MB/round | MB in all | "
        f"utilization at {args.link_mbit:g} Mbit/s | wall s |\n|---|---|---|---|---|---|---|---|")
  for r in rows:
    vs = f"{r['final_eval_loss'] / ref['final_eval_loss']:.4f}" if ref else "-"
    bpb = f"{r['final_eval_bpb']:.3f}" if r["final_eval_bpb"] is not None else "-"
    print(f"| {r['method']} | {r['final_eval_loss']:.4f} | {bpb} | {vs} | "
          f"{r['bytes_per_round'] / 1e6:.3f} | {r['total_bytes'] / 1e6:.2f} | "
          f"{100 * r['utilization']:.1f}% | {r['wall_s']:.0f} |")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
