"""Tokenizers for `prepare`: raw bytes, a byte-level BPE trained on the corpus, a HF
`tokenizer.json`, a SentencePiece `.model`; each turns texts into ids and has an EOS id.

`tokenizers`, `sentencepiece` (and `pyarrow`, for sources) are the optional `prepare`
extra, imported when first needed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np

from diloco_jax.corpus.sources import InputError
from diloco_jax.corpus.sources import require

BYTES_VOCAB, BYTES_EOS = 257, 256  # byte values 0..255, then EOS
TRAINED_EOS = "<|endoftext|>"
# End-of-document tokens looked for in a tokenizer.json that does not say its own.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[EOS]")
FILE_NAMES = {"bytes": None, "bpe": "tokenizer.json", "tokenizer.json": "tokenizer.json",
              "sentencepiece": "tokenizer.model"}


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a worker needs to build the tokenizer. kind: bytes, bpe, tokenizer.json or
  sentencepiece (the manifest's words); path: its file (None for bytes); ids are
  < vocab_size; eos_id ends every document."""
  kind: str
  path: str | None
  vocab_size: int
  eos_id: int

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


def load(arg: str, eos_token: str | None) -> Spec:
  """The Spec of --tokenizer=bytes, a tokenizer.json or a .model file (a directory holding
  one of them also works); `train` is made by `train_bpe`."""
  if arg == "bytes":
    return Spec("bytes", None, BYTES_VOCAB, BYTES_EOS)
  path = arg
  if os.path.isdir(arg):
    found = [os.path.join(arg, n) for n in ("tokenizer.json", "tokenizer.model")
             if os.path.isfile(os.path.join(arg, n))]
    if not found:
      raise InputError(f"--tokenizer={arg}: a directory without tokenizer.json or "
                       "tokenizer.model")
    path = found[0]
  if not path.endswith((".json", ".model")):
    raise InputError(f"--tokenizer={arg}: unknown; use bytes, train (with --vocab_size), "
                     "a tokenizer.json path or a SentencePiece .model path")
  if not os.path.isfile(path):
    raise InputError(f"--tokenizer={arg}: no such file")
  if path.endswith(".json"):
    return _load_hf(path, eos_token)
  return _load_sentencepiece(path, eos_token)


def _load_hf(path: str, eos_token: str | None) -> Spec:
  tokenizers = require("tokenizers")
  try:
    tok = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception
    raise InputError(f"--tokenizer={path}: not a HF tokenizers file "
                     f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
  vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
  candidates = [eos_token] if eos_token else [*_configured_eos(path), *EOS_TOKENS]
  for token in candidates:
    if (eos_id := tok.token_to_id(token)) is not None:
      return Spec("tokenizer.json", path, vocab_size, eos_id)
  if eos_token:
    raise InputError(f"--eos_token={eos_token!r} is not in the vocabulary of {path}")
  raise InputError(f"{path}: no end-of-document token found (tried tokenizer_config.json's "
                   f"eos_token and {', '.join(EOS_TOKENS)}); name one with --eos_token")


def _configured_eos(path: str) -> list[str]:
  """The eos_token of a tokenizer_config.json beside the tokenizer.json (HF models say
  their EOS there, not in tokenizer.json)."""
  try:
    with open(os.path.join(os.path.dirname(path), "tokenizer_config.json")) as f:
      eos = json.load(f).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return []
  eos = eos.get("content") if isinstance(eos, dict) else eos
  return [eos] if isinstance(eos, str) else []


def _load_sentencepiece(path: str, eos_token: str | None) -> Spec:
  spm = require("sentencepiece")
  processor = spm.SentencePieceProcessor()
  try:
    processor.Load(path)
  except (OSError, RuntimeError) as e:
    raise InputError(f"--tokenizer={path}: not a SentencePiece model ({e})") from None
  if eos_token:
    eos_id = processor.piece_to_id(eos_token)
    if processor.id_to_piece(eos_id) != eos_token:  # unknown pieces map to unk
      raise InputError(f"--eos_token={eos_token!r} is not in the vocabulary of {path}")
  else:
    eos_id = processor.eos_id()
    if eos_id < 0:
      raise InputError(f"{path}: this SentencePiece model has no EOS (eos_id = -1); train "
                       "it with an eos_id, or name a piece with --eos_token")
  return Spec("sentencepiece", path, processor.get_piece_size(), eos_id)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str) -> Spec:
  """Trains a byte-level BPE (GPT-2's pre-tokenizer, all 256 bytes in its alphabet, so any
  text encodes and decodes back exactly) on `texts`, saves it to `path`."""
  tk = require("tokenizers")
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS],
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                   show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.save(path)
  # A small corpus can run out of merges before vocab_size: the vocabulary is what it is.
  return Spec("bpe", path, tok.get_vocab_size(with_added_tokens=True),
              tok.token_to_id(TRAINED_EOS))


class Encoder:
  """Turns a batch of documents into ids; built once per worker process from a Spec."""

  def __init__(self, spec: Spec):
    self.spec = spec
    if spec.kind in ("bpe", "tokenizer.json"):
      self._tok = require("tokenizers").Tokenizer.from_file(spec.path)
      # Text that spells a special token ("<|endoftext|>" in a file about GPT-2) is
      # encoded as text: EOS must appear only where a document ends.
      self._tok.encode_special_tokens = True
    elif spec.kind == "sentencepiece":
      self._tok = require("sentencepiece").SentencePieceProcessor(model_file=spec.path)

  def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
    """The ids of each text, without EOS, as arrays of spec.dtype."""
    dtype = self.spec.dtype
    if self.spec.kind == "bytes":
      return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(dtype) for t in texts]
    if self.spec.kind == "sentencepiece":
      ids = self._tok.encode(list(texts))
    else:
      ids = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
    return [np.asarray(i, dtype) for i in ids]


# ------------------------------------------------------------------- worker processes

_ENCODER: Encoder | None = None  # each worker process's tokenizer


def _start_worker(spec: Spec) -> None:
  global _ENCODER
  _ENCODER = Encoder(spec)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(the documents' ids each followed by EOS, end to end; their lengths; text bytes)."""
  spec = _ENCODER.spec
  eos = np.array([spec.eos_id], spec.dtype)
  ids = _ENCODER.encode(texts)
  flat = np.concatenate([part for doc in ids for part in (doc, eos)])
  lengths = np.array([len(doc) + 1 for doc in ids], np.int64)
  text_bytes = (lengths - 1 if spec.kind == "bytes" else
                np.array([len(t.encode("utf-8")) for t in texts], np.int64))
  return flat, lengths, text_bytes


def encode_chunks(chunks: Iterator[tuple[list[str], Any]], spec: Spec,
                  workers: int) -> Iterator[tuple]:
  """(tag, flat, lengths, text bytes) of each (texts, tag) chunk, in order; flat holds the
  documents' ids, each followed by EOS, end to end. At most two chunks per worker are in
  flight, so memory does not grow with the corpus (Pool.imap would read all input ahead)."""
  if workers == 0:
    _start_worker(spec)
    for texts, tag in chunks:
      yield tag, *_encode(texts)
    return
  # A fork after tokenizers used its thread pool (training) would hang or warn in the
  # workers; with this set, each worker encodes on one thread.
  saved = os.environ.get("TOKENIZERS_PARALLELISM")
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  try:
    # Spawned, not forked: a fork of a process whose JAX runtime or tokenizers' thread pool
    # is running (prepare called from a program that trains, or from the tests) can hang.
    pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (spec,))
  finally:
    if saved is None:
      del os.environ["TOKENIZERS_PARALLELISM"]
    else:
      os.environ["TOKENIZERS_PARALLELISM"] = saved
  with pool:
    pending = collections.deque()
    for texts, tag in chunks:
      pending.append((tag, pool.apply_async(_encode, (texts,))))
      if len(pending) >= 2 * workers:
        tag, result = pending.popleft()
        yield tag, *result.get()
    while pending:
      tag, result = pending.popleft()
      yield tag, *result.get()
