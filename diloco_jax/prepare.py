"""python -m diloco_jax.prepare --input=... --output=DIR --tokenizer=...: a prepared corpus_format.

How a corpus is built, and what the directory holds: diloco_jax/corpus/build.py and
docs/prepared_format.md. Any bad input stops with one line naming it and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from diloco_jax.cli import exits
from diloco_jax.corpus import build
from diloco_jax.corpus import format as corpus_format
from diloco_jax.corpus import sources as sources_lib
from diloco_jax.corpus import tokenizer as tokenizer_lib
from diloco_jax.corpus.sources import InputError


# Every failure is the command's input, or the disk's (an OSError: full, not writable, ...).
PREPARE = exits.Command(prefix="prepare", also=(OSError,), exits=False,
                        interrupted="prepare: interrupted; nothing was written to --output")


class _Parser(argparse.ArgumentParser):

  def error(self, message):  # argparse prints the usage and exits 2; one line is enough
    raise InputError(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = _Parser(prog="python -m diloco_jax.prepare", description=__doc__.split("\n\n")[0],
              allow_abbrev=False)
  p.add_argument("--input", action="append", required=True, help="A file, directory or "
                 "glob; repeat for more. Text files (one document each), .jsonl[.gz], "
                 ".parquet, or a datasets.save_to_disk directory.")
  p.add_argument("--output", required=True, help="The prepared corpus directory.")
  p.add_argument("--tokenizer", required=True, help="bytes, train (a byte-level BPE "
                 "trained on the train split), a tokenizer.json or a SentencePiece .model.")
  p.add_argument("--vocab_size", type=int, help="With --tokenizer=train: its vocabulary.")
  p.add_argument("--eos_token", help="The end-of-document token of a tokenizer file (by "
                 "default its own: tokenizer_config.json's, <|endoftext|>, </s>, ...).")
  p.add_argument("--text_field", default="text", help="The text of a JSONL/Parquet/Arrow row.")
  p.add_argument("--text_extensions", default=",".join(sources_lib.TEXT_EXTENSIONS),
                 help="Extensions read as text, one document per file (comma separated).")
  p.add_argument("--exclude", action="append", default=[], help="Skip files and directories "
                 "whose name or path matches this glob (e.g. site-packages, '*/test/*'); "
                 "repeat for more.")
  p.add_argument("--eval_fraction", type=float, default=0.01,
                 help="The share of documents drawn (seeded) for the eval split.")
  p.add_argument("--eval_max_documents", type=int, help="At most this many eval documents.")
  p.add_argument("--seed", type=int, default=0, help="The seed of the eval draw.")
  p.add_argument("--workers", type=int, default=min(4, _cpus()),
                 help="Tokenizer processes (0: tokenize in this process).")
  p.add_argument("--shard_tokens", type=int, default=corpus_format.SHARD_TOKENS,
                 help="A shard is closed at the document that brings it to this many tokens.")
  p.add_argument("--tokenizer_train_bytes", type=int, default=1 << 30,
                 help="With --tokenizer=train: train on the first this many bytes of text.")
  p.add_argument("--overwrite", action="store_true",
                 help="Replace --output even if it is not a prepared corpus_format.")
  args = p.parse_args(argv)
  args.text_extensions = tuple(e if e.startswith(".") else "." + e
                               for e in args.text_extensions.split(",") if e)
  _check(args)
  return args


def _cpus() -> int:
  """The CPUs this process may run on (a job scheduler's limit, not the machine's)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _check(args: argparse.Namespace) -> None:
  if args.tokenizer == "train":
    if args.vocab_size is None:
      raise InputError(f"--tokenizer=train needs --vocab_size (>= {tokenizer_lib.BYTES_VOCAB}:"
                       " the 256 bytes and EOS)")
    if args.vocab_size < tokenizer_lib.BYTES_VOCAB:
      raise InputError(f"--vocab_size={args.vocab_size}: too small for --tokenizer=train, "
                       f"which needs >= {tokenizer_lib.BYTES_VOCAB} (the 256 bytes and EOS)")
  elif args.vocab_size is not None:
    raise InputError(f"--vocab_size is for --tokenizer=train only (--tokenizer="
                     f"{args.tokenizer} has its own vocabulary)")
  for name, low, high in [("eval_fraction", 0, 1), ("eval_max_documents", 0, None),
                          ("workers", 0, None), ("shard_tokens", 1, None),
                          ("tokenizer_train_bytes", 1, None)]:
    value = getattr(args, name)
    if value is not None and not (low <= value and (high is None or value < high)):
      raise InputError(f"--{name}={value}: must be >= {low}" + (f" and < {high}" if high else ""))


def main(argv: Sequence[str] | None = None) -> int:
  """The command; returns its exit status (tests call it)."""
  return exits.run(lambda: _prepare(sys.argv[1:] if argv is None else argv), PREPARE)


def _prepare(argv: Sequence[str]) -> int:
  start = time.monotonic()
  args = parse_args(argv)
  done = build.prepare(args)
  if done is None:
    print(f"prepare: {args.output} is up to date")
    return 0
  manifest, seconds, notes = done
  for note in notes:
    print(f"prepare: {note}", file=sys.stderr)
  train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
  text, tokens = train["bytes"] + held["bytes"], train["tokens"] + held["tokens"]
  print(f"prepare: wrote {args.output}: {train['documents']:,} train + {held['documents']:,} "
        f"eval documents, {tokens:,} tokens ({text / tokens:.2f} bytes/token), "
        f"{len(train['shards']) + len(held['shards'])} shards; vocab {manifest['vocab_size']}, "
        f"EOS {manifest['eos_id']}, {manifest['dtype']}; {time.monotonic() - start:.1f} s")
  print(f"prepare: tokenized {text / 1e6:,.1f} MB of text in {seconds:.1f} s: "
        f"{text / 1e6 / seconds:.2f} MB/s, {tokens / seconds:,.0f} tokens/s "
        f"({args.workers} workers)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
