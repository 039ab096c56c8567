"""Building a prepared corpus: the body of `python -m diloco_jax.prepare` (its flags and
messages are in diloco_jax/prepare.py).

Reads documents (corpus/sources.py), tokenizes them in worker processes
(corpus/tokenizer.py), and writes DIR in the format `data.source = "prepared"` reads
(docs/prepared_format.md): per split, token shards `<split>-NNNNN.bin` (each document's
ids, then EOS) with a document index `<split>-NNNNN.idx`, the tokenizer's file, and
`manifest.json` last.

DIR is built in `.DIR.partial` beside it and renamed into place once complete, so an
interrupted run leaves no half-written corpus (the next run clears it). A run whose
sources (sizes, sha256) and options equal the manifest's says "up to date" and stops.
A bad input raises InputError naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import shutil
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from diloco_jax import digest as digest_lib
from diloco_jax.corpus import format as corpus_format
from diloco_jax.corpus import sources as sources_lib
from diloco_jax.corpus import tokenizer as tokenizer_lib
from diloco_jax.corpus.sources import InputError

_CHUNK_BYTES, _CHUNK_DOCUMENTS = 1 << 20, 1024  # the documents a worker gets at a time


# ----------------------------------------------------------------------------- documents

class EvalSplit:
  """Document i (in input order, non-empty documents counted from 0) is an eval document if
  blake2b-64(f"{seed}:{i}") / 2**64 < fraction, until max_documents of them are; call it
  once per document, in order."""

  def __init__(self, fraction: float, max_documents: int | None, seed: int):
    self.fraction, self.max_documents, self.seed, self.taken = fraction, max_documents, seed, 0

  def __call__(self, index: int) -> bool:
    if self.max_documents is not None and self.taken >= self.max_documents:
      return False
    digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
    drawn = int.from_bytes(digest, "little") < self.fraction * 2.0**64
    self.taken += drawn
    return drawn


def _documents(sources: Sequence[sources_lib.Source], reader: sources_lib.Reader,
               progress: Progress | None = None) -> Iterator[str]:
  for number, source in enumerate(sources):
    if progress:
      progress.file = f"file {number + 1}/{len(sources)}"
    yield from reader.documents(source)


def _training_texts(sources, reader, split: EvalSplit, limit: int, progress) -> Iterator[str]:
  """The train split's texts until `limit` bytes (the BPE never sees eval documents)."""
  seen = 0
  for index, text in enumerate(_documents(sources, reader, progress)):
    if not split(index):
      size = len(text.encode("utf-8"))
      progress.show(seen, None, index + 1)
      yield text
      if (seen := seen + size) >= limit:
        return


def _chunks(documents: Iterator[str], split: EvalSplit) -> Iterator[tuple[list, np.ndarray]]:
  """Documents in groups of about _CHUNK_BYTES, with their eval flags."""
  texts, flags, size = [], [], 0
  for index, text in enumerate(documents):
    texts.append(text)
    flags.append(split(index))
    size += len(text)
    if size >= _CHUNK_BYTES or len(texts) >= _CHUNK_DOCUMENTS:
      yield texts, np.array(flags)
      texts, flags, size = [], [], 0
  if texts:
    yield texts, np.array(flags)


class Progress:
  """A status line on stderr: redrawn in place on a terminal, else printed every 5 s."""

  def __init__(self, label: str, stream=None):
    self.label, self.file, self._stream = label, "", stream or sys.stderr
    self._tty = self._stream.isatty()
    self._every, self._width = (0.2 if self._tty else 5.0), 0
    self.start = self._last = time.monotonic()

  def show(self, text_bytes: int, tokens: int | None, documents: int, force=False) -> None:
    now = time.monotonic()
    if not force and now - self._last < self._every:
      return
    self._last, seconds = now, max(now - self.start, 1e-9)
    line = (f"prepare: {self.label}: {documents:,} documents, {text_bytes / 1e6:,.1f} MB of "
            f"text ({text_bytes / 1e6 / seconds:.2f} MB/s)")
    if tokens is not None:
      line += f", {tokens:,} tokens ({tokens / seconds:,.0f} tokens/s)"
    line += f", {self.file}, {seconds:.0f} s"
    if self._tty:
      self._stream.write("\r" + line.ljust(self._width))
      self._width = len(line)
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def end(self) -> None:
    if self._tty and self._width:
      self._stream.write("\n")
      self._stream.flush()


# ------------------------------------------------------------------------- the directory

def existing_corpus(output: str, overwrite: bool) -> dict | None:
  """The manifest of the prepared corpus at `output`, or None if there is none; an
  InputError if `output` holds something else and --overwrite was not given."""
  if not os.path.lexists(output):
    return None
  if os.path.isdir(output):
    if (manifest := corpus_format.read_manifest(output)) is not None:
      return manifest
    if not os.listdir(output):
      return None
  if overwrite:
    return None
  what = (f"a directory holding {sources_lib.listing(sorted(os.listdir(output)))} and no "
          f"{corpus_format.FORMAT} manifest.json" if os.path.isdir(output) else "not a directory")
  raise InputError(f"--output={output} exists and is not a prepared corpus ({what}); choose "
                   "another --output, or add --overwrite to replace it (deleting what it holds)")


def _options(args: argparse.Namespace) -> dict:
  """The options a corpus depends on (not --workers: the output is the same for any)."""
  tokenizer = args.tokenizer
  if tokenizer not in ("bytes", "train"):
    tokenizer = os.path.abspath(tokenizer)
  keys = ["vocab_size", "eos_token", "text_field", "eval_fraction", "eval_max_documents",
          "seed", "shard_tokens", "tokenizer_train_bytes"]
  return {"tokenizer": tokenizer, **{k: getattr(args, k) for k in keys}}


# ------------------------------------------------------------------------------- running

class Prepared(NamedTuple):
  """What `prepare` did: the manifest written, the seconds spent tokenizing, and notes for
  the user (files skipped, text that was not UTF-8, a BPE smaller than asked)."""
  manifest: dict
  seconds: float
  notes: list[str]


def prepare(args: argparse.Namespace) -> Prepared | None:
  """Writes the prepared corpus args.output; None if it was up to date."""
  spec = None if args.tokenizer == "train" else tokenizer_lib.load(args.tokenizer,
                                                                   args.eos_token)
  sources, skipped = sources_lib.find_sources(args.input, args.text_extensions,
                                                 args.exclude)
  notes = [(f"skipped {len(skipped)} hidden files or files of other formats: "
            f"{sources_lib.listing(skipped)}")] if skipped else []
  output = os.path.normpath(args.output)
  old = existing_corpus(output, args.overwrite)
  paths = [f for s in sources for f in s.files]
  if (size := sum(map(os.path.getsize, paths))) > 1e9:  # about a second per GB
    print(f"prepare: hashing {len(paths)} input files ({size / 1e9:.1f} GB)", file=sys.stderr)
  files = [{"path": os.path.abspath(f), "size": os.path.getsize(f),
            "sha256": digest_lib.file_sha256(f)} for f in paths]
  options = _options(args)
  if spec is not None:
    options["tokenizer_sha256"] = digest_lib.file_sha256(spec.path) if spec.path else None
  if (old is not None and old.get("sources") == files and old.get("args") == options
      and not corpus_format.missing_files(old, output)):
    return None
  _check_not_empty(sources, args.text_field)
  staging = os.path.join(os.path.dirname(os.path.abspath(output)),
                         f".{os.path.basename(output)}.partial")
  corpus_format.remove(staging)  # an interrupted run's
  os.makedirs(staging)
  try:
    if spec is None:
      progress = Progress("training the tokenizer")
      texts = _training_texts(sources, sources_lib.Reader(args.text_field),
                              EvalSplit(args.eval_fraction, args.eval_max_documents, args.seed),
                              args.tokenizer_train_bytes, progress)
      spec = tokenizer_lib.train_bpe(texts, args.vocab_size,
                                     os.path.join(staging, "tokenizer.json"))
      progress.end()
      if spec.vocab_size < args.vocab_size:
        notes.append(f"the BPE ran out of merges at a vocabulary of {spec.vocab_size} "
                     f"(--vocab_size={args.vocab_size}): the corpus is small")
    elif spec.path:
      shutil.copyfile(spec.path, os.path.join(staging, tokenizer_lib.FILE_NAMES[spec.kind]))
    manifest, seconds = _write_splits(sources, spec, staging, args, notes)
    manifest.update(sources=files, args=options, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    corpus_format.write_json(os.path.join(staging, "manifest.json"), manifest)
    corpus_format.publish(staging, output)
  except BaseException:
    corpus_format.remove(staging)
    raise
  return Prepared(manifest, seconds, notes)


def _check_not_empty(sources, text_field: str) -> None:
  """Reads up to the first document: an InputError if there is none."""
  reader = sources_lib.Reader(text_field)
  if next(_documents(sources, reader), None) is None:
    raise InputError(f"empty corpus: no document with text in {sources_lib.describe(sources)}"
                     + (f" (only {reader.empty} empty document"
                        f"{'s' * (reader.empty > 1)})" if reader.empty else ""))


def _write_splits(sources, spec: tokenizer_lib.Spec, staging: str,
                  args: argparse.Namespace, notes: list[str]) -> tuple[dict, float]:
  """Tokenizes every document into the split EvalSplit gives it; (the manifest so far, the
  seconds it took)."""
  reader = sources_lib.Reader(args.text_field)
  split = EvalSplit(args.eval_fraction, args.eval_max_documents, args.seed)
  writers = {flag: corpus_format.SplitWriter(staging, name, spec.dtype, args.shard_tokens)
             for flag, name in [(False, "train"), (True, "eval")]}
  progress, text_bytes, tokens, documents = Progress("tokenizing"), 0, 0, 0
  chunks = _chunks(_documents(sources, reader, progress), split)
  for flags, flat, lengths, sizes in tokenizer_lib.encode_chunks(chunks, spec, args.workers):
    ends = np.cumsum(lengths)
    cuts = [0, *(np.flatnonzero(np.diff(flags)) + 1), len(flags)]
    for a, b in itertools.pairwise(cuts):  # runs of documents of one split, one write each
      writers[bool(flags[a])].add(flat[ends[a] - lengths[a]:ends[b - 1]], lengths[a:b],
                                  int(sizes[a:b].sum()))
    text_bytes, tokens = text_bytes + int(sizes.sum()), tokens + len(flat)
    documents += len(lengths)
    progress.show(text_bytes, tokens, documents)
  progress.show(text_bytes, tokens, documents, force=True)
  progress.end()
  if reader.replaced:
    notes.append(f"{len(reader.replaced)} text files were not valid UTF-8 (bad bytes read as "
                 f"U+FFFD): {sources_lib.listing(reader.replaced)}")
  return ({"format": corpus_format.FORMAT, "vocab_size": spec.vocab_size, "eos_id": spec.eos_id,
          "dtype": spec.dtype.name,
          "tokenizer": {"kind": spec.kind, "file": tokenizer_lib.FILE_NAMES[spec.kind]},
          "splits": {"train": writers[False].close(), "eval": writers[True].close()},
          "eval": {"fraction": args.eval_fraction, "max_documents": args.eval_max_documents,
                   "seed": args.seed}}, time.monotonic() - progress.start)
