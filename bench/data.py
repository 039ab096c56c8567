"""How fast a corpus is prepared and read, next to what configs/gpt_150m.py consumes.

  python -m bench.data [--input=DIR] [--max_mb=40] [--tokenizers=bytes,train] [--out=...]
  python -m bench.data --smoke  # seconds: 1 MB of text, bytes tokenizer, a few batches

  prepare  `python -m diloco_jax.prepare` (a subprocess, as a user runs it) on the first
           `--max_mb` MB of the text files under `--input` (default: the Python standard
           library's sources, one document per file), once per tokenizer in
           `--tokenizers` ("train": a byte-level BPE of `--vocab_size`, trained on the
           same text first, included in the time): MB of text per second of wall time,
           with `--workers` tokenizer processes (and prepare's own MB/s of the
           tokenizing pass alone);
  loader   the real HostData pipeline (`data.make_host_data`, source "prepared": grain,
           shuffled windows read from memory-mapped shards) on the first tokenizer's
           corpus with gpt_150m's shapes (one replica per host, batch 512 x 1024+1
           tokens; --smoke: smaller): tokens per second of `next_batch()` on one host,
           the first batch untimed, the files in the page cache (read just before);
  demand   what one H100 training gpt_150m consumes: 0.4 x 989e12 bf16 FLOP/s (40% MFU)
           / `model.flops_per_token` (a 32k vocabulary); `ratio` = loader / demand (> 1:
           the loader keeps up, on this machine's cores).
Writes bench/results/data.json (--smoke: --out, or a file in a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import harness
from configs import gpt_150m
from diloco_jax.data import pipeline as data_lib
from diloco_jax.models import family
from diloco_jax.models import model as model_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

H100_BF16_FLOPS = 989e12  # dense bf16 peak (SXM)
MFU = 0.4


def copy_text(source: str, target: str, max_bytes: int) -> tuple[int, int]:
  """Copies .py files under `source` (sorted, skipping tests' data and site-packages) into
  `target` until `max_bytes`: (files, bytes)."""
  files, total = 0, 0
  for root, dirs, names in os.walk(source):
    dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__")
                     and not d.startswith("."))
    for name in sorted(names):
      if not name.endswith(".py") or total >= max_bytes:
        continue
      with open(os.path.join(root, name), "rb") as f:
        text = f.read(max_bytes - total)
      with open(os.path.join(target, f"{files:06d}.py"), "wb") as f:
        f.write(text)
      files, total = files + 1, total + len(text)
  return files, total


def prepare(text_dir: str, output: str, tokenizer: str, args) -> dict:
  cmd = [sys.executable, "-m", "diloco_jax.prepare", f"--input={text_dir}", f"--output={output}",
         f"--tokenizer={tokenizer}", f"--workers={args.workers}",
         f"--eval_fraction={args.eval_fraction}"]
  if tokenizer == "train":
    cmd.append(f"--vocab_size={args.vocab_size}")
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO})
  seconds = time.perf_counter() - start
  if proc.returncode:
    sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
  with open(os.path.join(output, "manifest.json")) as f:
    manifest = json.load(f)
  splits = manifest["splits"]
  text_bytes = sum(s["bytes"] for s in splits.values())
  tokens = sum(s["tokens"] for s in splits.values())
  # prepare's own figure for the tokenizing pass alone (without a tokenizer's training).
  tokenized = re.search(r"tokenized [\d.]+ MB of text in [\d.]+ s: ([\d.]+) MB/s",
                        proc.stdout + proc.stderr)
  return {"tokenizer": tokenizer, "vocab_size": manifest["vocab_size"],
          "tokenize_mb_per_sec": float(tokenized.group(1)) if tokenized else None,
          "text_mb": text_bytes / 1e6, "tokens": tokens, "seconds": seconds,
          "mb_per_sec": text_bytes / 1e6 / seconds, "tokens_per_sec": tokens / seconds,
          "bytes_per_token": splits["train"]["bytes"] / splits["train"]["tokens"],
          "workers": args.workers}


def loader(path: str, args) -> dict:
  with open(os.path.join(path, "manifest.json")) as f:
    vocab_size = json.load(f)["vocab_size"]
  for name in os.listdir(path):  # into the page cache: the figure is the pipeline's own
    with open(os.path.join(path, name), "rb") as f:
      while f.read(1 << 24):
        pass
  config = gpt_150m.get_config().data
  config.update(dict(path=path, vocab_size=vocab_size))
  start = time.perf_counter()
  data = data_lib.make_host_data(config, seq_len=args.seq_len, batch_size=args.batch_size,
                                 replicas_per_host=1, num_eval_batches=1)
  setup = time.perf_counter() - start
  data.next_batch()
  start = time.perf_counter()
  for _ in range(args.batches):
    batch = data.next_batch()
  seconds = time.perf_counter() - start
  tokens = args.batches * batch.shape[0] * batch.shape[1] * args.seq_len
  return {"seq_len": args.seq_len, "batch_size": args.batch_size, "batches": args.batches,
          "setup_seconds": setup, "seconds": seconds, "tokens_per_sec": tokens / seconds}


def demand() -> dict:
  config = gpt_150m.get_config()
  cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
  flops = model_lib.flops_per_token(cfg, model_lib.num_params_of(cfg))
  return {"model": "configs/gpt_150m.py", "params": model_lib.num_params_of(cfg),
          "flops_per_token": flops, "peak_flops": H100_BF16_FLOPS, "mfu": MFU,
          "tokens_per_sec": MFU * H100_BF16_FLOPS / flops}


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", default=sysconfig.get_path("stdlib"),
                      help="a directory of .py files (default: the standard library's)")
  parser.add_argument("--max_mb", type=float, default=40, help="MB of text to prepare")
  parser.add_argument("--tokenizers", default="bytes,train",
                      help="comma separated: bytes, train (the loader reads the first)")
  parser.add_argument("--vocab_size", type=int, default=4096, help="--tokenizer=train's")
  parser.add_argument("--workers", type=int, default=os.cpu_count(),
                      help="prepare's tokenizer processes")
  parser.add_argument("--eval_fraction", type=float, default=0.05, help="prepare's")
  parser.add_argument("--seq_len", type=int, default=1024, help="loader: tokens per window")
  parser.add_argument("--batch_size", type=int, default=512, help="loader: windows per batch")
  parser.add_argument("--batches", type=int, default=100, help="loader: batches timed")
  args = harness.parse_args(parser, "data", dict(max_mb=1, tokenizers="bytes", batch_size=16,
                                                batches=5, eval_fraction=0.3))
  with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
    text_dir = os.path.join(tmp, "text")
    os.makedirs(text_dir)
    files, _ = copy_text(args.input, text_dir, int(args.max_mb * 1e6))
    rows = []
    for tokenizer in args.tokenizers.split(","):
      rows.append(prepare(text_dir, os.path.join(tmp, tokenizer), tokenizer, args))
      print(f"prepare {tokenizer:>6}: {rows[-1]['text_mb']:.1f} MB of text in "
            f"{rows[-1]['seconds']:.1f} s = {rows[-1]['mb_per_sec']:.2f} MB/s, "
            f"{rows[-1]['tokens_per_sec']:,.0f} tokens/s (tokenizing alone: "
            f"{rows[-1]['tokenize_mb_per_sec']} MB/s)", flush=True)
    read = loader(os.path.join(tmp, args.tokenizers.split(",")[0]), args)
  need = demand()
  result = {"prepare": rows, "loader": read, "demand": need,
            "ratio": read["tokens_per_sec"] / need["tokens_per_sec"],
            "input": {"path": args.input, "files": files, "max_mb": args.max_mb},
            "cpu_count": os.cpu_count(), "smoke": args.smoke, **harness.provenance("data")}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"loader: {read['tokens_per_sec']:,.0f} tokens/s per host (batch {args.batch_size} x "
        f"{args.seq_len}); gpt_150m on one H100 at {MFU:.0%} MFU needs "
        f"{need['tokens_per_sec']:,.0f} tokens/s; ratio {result['ratio']:.1f}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
