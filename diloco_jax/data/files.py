"""Training text from files: `text` (a file or a directory of them, as bytes) and `tokens` (a
flat token file), cut into windows of L+1 tokens, and the checks that they are enough."""

from __future__ import annotations

import math
import os

import ml_collections
import numpy as np

from diloco_jax import errors


class WindowSource:
  """Non-overlapping windows of L+1 tokens (stride L) over a flat token array."""

  def __init__(self, tokens: np.ndarray, seq_len: int, start: int, stop: int):
    self.tokens, self.seq_len, self.start, self.stop = tokens, seq_len, start, stop

  def __len__(self) -> int:
    return self.stop - self.start

  def __getitem__(self, i: int) -> np.ndarray:
    if not 0 <= i < len(self):
      raise IndexError(i)
    begin = (self.start + i) * self.seq_len
    return np.asarray(self.tokens[begin:begin + self.seq_len + 1], np.int32)


class IndexedSource:
  """The items `indices` of another source (one replica's shard)."""

  def __init__(self, base, indices: np.ndarray):
    self.base, self.indices = base, indices

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i: int) -> np.ndarray:
    return self.base[int(self.indices[i])]


def text_files(path: str) -> tuple[list[str], list[str]]:
  """(files read, paths skipped) of a 'text' path: the file itself, or every file under
  the directory in sorted order but hidden files and directories, __pycache__ and binary
  files (bytecode, editor and VCS files, shared libraries, images are not text to learn
  from)."""
  if not os.path.isdir(path):
    return [path], []
  used, skipped = [], []
  for root, dirs, files in os.walk(path):
    skipped += [os.path.join(root, d) for d in dirs if _skipped(d)]
    dirs[:] = [d for d in dirs if not _skipped(d)]  # os.walk does not descend into these
    for name in files:
      full = os.path.join(root, name)
      if _skipped(name) or (os.path.isfile(full) and _binary(full)):
        skipped.append(full)
      elif os.path.isfile(full):
        used.append(full)
  return sorted(used), sorted(skipped)


def _skipped(name: str) -> bool:
  return name.startswith(".") or name == "__pycache__"


def _binary(path: str) -> bool:
  """A NUL byte in the first 8,000 bytes: binary (git's and grep's rule; text has none)."""
  with open(path, "rb") as f:
    return b"\0" in f.read(8000)


def _read_text(path: str) -> np.ndarray:
  data = b"".join(open(f, "rb").read() for f in text_files(path)[0])
  return np.frombuffer(data, np.uint8)


def flat_tokens(config: ml_collections.ConfigDict) -> np.ndarray:
  if not os.path.exists(config.path):
    raise errors.ConfigError(
        f"config.data.path = {config.path!r}: no such file or directory")
  if config.source == "text":
    return _read_text(config.path)
  tokens = np.memmap(config.path, dtype=np.dtype(config.token_dtype), mode="r")
  if tokens.size and int(tokens.max()) >= config.vocab_size:
    raise errors.ConfigError(
        f"config.data.path = {config.path!r}: token id {int(tokens.max())} is >= "
        f"config.data.vocab_size = {config.vocab_size}")
  return tokens


def min_windows(num_train: int, num_eval: int, eval_fraction: float) -> int:
  """The fewest windows W that `make_host_data`'s split turns into >= num_train training
  and >= num_eval held-out sequences: int(W * eval_fraction) held out, the rest train."""
  def fits(w):
    held_out = int(w * eval_fraction)
    return held_out >= num_eval and w - held_out >= num_train

  # Both counts grow with W (by at most 1 per window), so the answer is near the larger
  # of the two closed-form bounds; step over float rounding from there.
  w = max(num_train + num_eval, math.ceil(num_eval / eval_fraction),
          math.ceil(num_train / (1 - eval_fraction)))
  while w > 1 and fits(w - 1):
    w -= 1
  while not fits(w):
    w += 1
  return w


def check_file_data(config: ml_collections.ConfigDict, *, seq_len: int, batch_size: int,
                    num_shards: int, num_eval_batches: int) -> None:
  """Raises a ConfigError naming config.data.path if the 'text' or 'tokens' data cannot
  give every replica one batch and the held-out set its batches; from the files' sizes
  alone, before anything is read."""
  path = config.path
  if not os.path.exists(path):
    raise errors.ConfigError(f"config.data.path = {path!r}: no such file or directory")
  if config.source == "text":
    files, skipped = text_files(path)
    if not files:
      found = "it is empty"
      if skipped:
        names = [os.path.relpath(f, path) for f in skipped]
        found = (f"found only {', '.join(names[:5])}" + (f" and {len(names) - 5} more"
                                                         if len(names) > 5 else ""))
      raise errors.ConfigError(
          f"config.data.path = {path!r}: a directory with no text files to read ({found}; "
          "hidden files and directories, __pycache__ and binary files are skipped)")
    size = sum(os.path.getsize(f) for f in files)
    num_tokens = size
    held = (f"holds {size:,} bytes of text" + (f" in {len(files)} file"
                                               + ("s" * (len(files) > 1))
                                               if os.path.isdir(path) else "")
            + " (a token per byte)")
  else:
    size, itemsize = os.path.getsize(path), np.dtype(config.token_dtype).itemsize
    if size % itemsize:
      raise errors.ConfigError(
          f"config.data.path = {path!r}: {size:,} bytes is not a whole number of "
          f"{config.token_dtype} tokens ({itemsize} bytes each); is config.data.token_dtype "
          "right?")
    num_tokens = size // itemsize
    held = f"holds {size:,} bytes = {num_tokens:,} {config.token_dtype} tokens"
  num_train, num_eval = num_shards * batch_size, num_eval_batches * batch_size
  windows = min_windows(num_train, num_eval, config.eval_fraction)
  need = windows * seq_len + 1
  if num_tokens < need:
    raise errors.ConfigError(
        f"config.data.path = {path!r}: {held}; needs at least {need:,} tokens: {windows:,} "
        f"windows of config.model.seq_len = {seq_len} (+1), config.data.eval_fraction = "
        f"{config.eval_fraction} of them giving {num_eval:,} held-out sequences "
        f"(config.eval_batches {num_eval_batches} x config.batch_size {batch_size}), the "
        f"rest {num_train:,} training ones ({num_shards} replica{'s' * (num_shards > 1)} x "
        f"config.batch_size {batch_size})")


# ------------------------------------------------------------------------------ host data
