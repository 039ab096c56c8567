"""Reading a prepared corpus (docs/prepared_format.md) for training: data.source "prepared".

The directory holds `manifest.json` (written last: its presence means the directory is
complete), token shards `<split>-NNNNN.bin` (documents one after another, each followed by
the EOS id, never split across shards) and their document indexes `<split>-NNNNN.idx`
(uint64 token offsets of each document's start, the shard's token count last).

Replicas read disjoint documents: each train shard is cut at document boundaries into K
contiguous blocks of about equal token counts, and replica g (of K, across all hosts) takes
block g of every shard. A replica's stream is therefore one token range per shard, so what
it keeps in memory grows with the number of shards, not the corpus; tokens are read from
the shards through np.memmap when a window is asked for. The eval stream is every eval
document in order. Streams are cut into windows of L+1 tokens at stride L that run across
document boundaries (packing): a window may hold the end of one document, EOS, and the
start of the next, and attention is not masked at those boundaries.
"""

from __future__ import annotations

import bisect
import collections
import copy
import json
import os
from typing import Any

import ml_collections
import numpy as np

from diloco_jax import errors

FORMAT = "diloco_jax.prepared/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
INDEX_DTYPE = np.dtype("<u8")
# Shards kept mapped at once: each np.memmap holds a file descriptor, and a large corpus
# has thousands of shards (2**26 tokens each).
OPEN_SHARDS = 64
# Tokens read to estimate the unigram loss printed at start-up (evenly spaced chunks).
UNIGRAM_SAMPLE = 2 ** 22
UNIGRAM_CHUNKS = 64
READ_CHUNK = 2 ** 16


def _error(path: str, message: str) -> errors.ConfigError:
  return errors.ConfigError(f"config.data.path = {path!r}: {message}")


class Shards:
  """One split's shard files, mapped on first read, at most OPEN_SHARDS at a time."""

  def __init__(self, directory: str, dtype: np.dtype, files: list[str]):
    self.directory, self.dtype, self.files = directory, dtype, files
    self._open: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()

  def tokens(self, shard: int) -> np.memmap:
    m = self._open.get(shard)
    if m is None:
      m = np.memmap(os.path.join(self.directory, self.files[shard]), dtype=self.dtype,
                    mode="r")
      self._open[shard] = m
      if len(self._open) > OPEN_SHARDS:
        self._open.popitem(last=False)
    else:
      self._open.move_to_end(shard)
    return m


class TokenStream:
  """The concatenation of token ranges [(shard, begin, end)] of a split's shards."""

  def __init__(self, shards: Shards, ranges: list[tuple[int, int, int]]):
    self.shards = shards
    self.ranges = [r for r in ranges if r[2] > r[1]]
    lengths = [end - begin for _, begin, end in self.ranges]
    self.starts = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]  # stream offsets

  def __len__(self) -> int:
    return self.starts[-1]

  def read(self, begin: int, n: int) -> np.ndarray:
    """int32 tokens [begin, begin + n) of the stream (which may span several ranges)."""
    out = np.empty(n, np.int32)
    k, filled = bisect.bisect_right(self.starts, begin) - 1, 0
    while filled < n:
      shard, first, last = self.ranges[k]
      offset = first + begin + filled - self.starts[k]
      take = min(last - offset, n - filled)
      out[filled:filled + take] = self.shards.tokens(shard)[offset:offset + take]
      filled, k = filled + take, k + 1
    return out


class Windows:
  """A grain source: window i is tokens [i L, i L + L + 1) of a stream."""

  def __init__(self, stream: TokenStream, seq_len: int, count: int | None = None):
    self.stream, self.seq_len = stream, seq_len
    self.count = (len(stream) - 1) // seq_len if count is None else count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> np.ndarray:
    if not 0 <= i < self.count:
      raise IndexError(i)
    return self.stream.read(i * self.seq_len, self.seq_len + 1)


class Corpus:
  """A prepared directory, checked: `open_corpus(path)` makes one."""

  def __init__(self, path: str, manifest: dict[str, Any]):
    self.path, self.manifest = path, manifest
    self.vocab_size, self.eos_id = int(manifest["vocab_size"]), int(manifest["eos_id"])
    self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    self.splits = manifest["splits"]
    self.shards = {s: Shards(path, self.dtype, [sh["file"] for sh in self.splits[s]["shards"]])
                   for s in SPLITS}
    self._cuts: dict[int, np.ndarray] = {}

  def bytes_per_token(self) -> dict[str, float] | None:
    """UTF-8 text bytes per token of each split (tokens include each document's EOS)."""
    out = {s: self.splits[s]["bytes"] / self.splits[s]["tokens"] for s in SPLITS
           if self.splits[s]["tokens"] and self.splits[s].get("bytes")}
    return out if len(out) == len(SPLITS) else None

  def _index(self, split: str, shard: int) -> np.ndarray:
    name = self.splits[split]["shards"][shard]["index"]
    return np.memmap(os.path.join(self.path, name), dtype=INDEX_DTYPE, mode="r")

  def block_cuts(self, num_replicas: int) -> np.ndarray:
    """[shards, K + 1] token offsets: block g of train shard s is [cuts[s, g], cuts[s, g+1]),
    cut at the first document starting at or after g/K of the shard's tokens."""
    if num_replicas not in self._cuts:
      cuts = np.zeros((len(self.splits["train"]["shards"]), num_replicas + 1), np.int64)
      for s, shard in enumerate(self.splits["train"]["shards"]):
        index, total = self._index("train", s), int(shard["tokens"])
        targets = [round(total * q / num_replicas) for q in range(num_replicas + 1)]
        cuts[s] = index[np.searchsorted(index, targets)]
      self._cuts[num_replicas] = cuts
    return self._cuts[num_replicas]

  def replica_stream(self, g: int, num_replicas: int) -> TokenStream:
    """Replica g's stream: block g of K of every train shard (one range per shard)."""
    cuts = self.block_cuts(num_replicas)
    return TokenStream(self.shards["train"], [(s, int(c[g]), int(c[g + 1]))
                                              for s, c in enumerate(cuts)])

  def eval_stream(self) -> TokenStream:
    return TokenStream(self.shards["eval"], [(s, 0, int(sh["tokens"])) for s, sh in
                                             enumerate(self.splits["eval"]["shards"])])

  def unigram_loss(self) -> float:
    """The best unigram model's loss (nats/token) on the train split: all of it up to
    UNIGRAM_SAMPLE tokens, else UNIGRAM_CHUNKS evenly spaced chunks of that many in all."""
    stream = self.replica_stream(0, 1)
    n, chunk = len(stream), UNIGRAM_SAMPLE // UNIGRAM_CHUNKS
    spans = ([(0, n)] if n <= UNIGRAM_SAMPLE else
             [(int(b), chunk) for b in np.linspace(0, n - chunk, UNIGRAM_CHUNKS)])
    counts = np.zeros(self.vocab_size, np.int64)
    for begin, size in spans:
      for at in range(begin, begin + size, READ_CHUNK):  # bounded memory
        piece = stream.read(at, min(READ_CHUNK, begin + size - at))
        counts += np.bincount(piece, minlength=self.vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def open_corpus(path: str) -> Corpus:
  """Reads and checks the manifest, and every shard's presence and size (not its bytes:
  that would read the corpus); a ConfigError naming the file otherwise."""
  if not os.path.isdir(path):
    # prepare builds DIR as .DIR.partial beside it and renames it when complete.
    head, tail = os.path.split(os.path.normpath(path))
    partial = os.path.join(head, f".{tail}.partial")
    if os.path.isdir(partial):
      raise _error(path, f"no such directory, but {partial} is there: its prepare was "
                   "interrupted; run it again")
    raise _error(path, "no such directory (a 'prepared' source is a directory written by "
                 "python -m diloco_jax.prepare)")
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.isfile(manifest_path):
    shards = any(n.endswith((".bin", ".idx")) for n in os.listdir(path))
    raise _error(path, f"{manifest_path} is missing: "
                 + ("its prepare was interrupted (the manifest is written last); run it "
                    "again" if shards else "not a prepared directory; make one with "
                    f"python -m diloco_jax.prepare --output={path}"))
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
  except (OSError, ValueError) as e:
    raise _error(path, f"{manifest_path} cannot be read: {e}") from None
  if fmt != FORMAT:
    raise _error(path, f"{manifest_path} has format {fmt!r}; this version of diloco_jax "
                 f"reads {FORMAT!r}: prepare the corpus again with this version")
  try:
    _check_manifest(path, manifest)
  except errors.ConfigError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise _error(path, f"{manifest_path} is malformed ({type(e).__name__}: {e}); "
                 "prepare the corpus again") from None
  return Corpus(path, manifest)


def _check_manifest(path: str, manifest: dict[str, Any]) -> None:
  itemsize = np.dtype(manifest["dtype"]).itemsize
  if int(manifest["vocab_size"]) > np.iinfo(np.dtype(manifest["dtype"])).max + 1:
    raise ValueError(f"vocab_size {manifest['vocab_size']} does not fit {manifest['dtype']}")
  if not 0 <= int(manifest["eos_id"]) < int(manifest["vocab_size"]):
    raise ValueError(f"eos_id {manifest['eos_id']} is not below vocab_size")
  for split in SPLITS:
    info = manifest["splits"][split]
    for shard in info["shards"]:
      _check_file(path, shard["file"], int(shard["tokens"]) * itemsize,
                  f"{int(shard['tokens']):,} {manifest['dtype']} tokens")
      index_file = os.path.join(path, shard["index"])
      _check_file(path, shard["index"], (int(shard["documents"]) + 1) * INDEX_DTYPE.itemsize,
                  f"{int(shard['documents']):,} documents (+1 uint64 offsets)")
      index = np.memmap(index_file, dtype=INDEX_DTYPE, mode="r")
      if index[0] != 0 or index[-1] != int(shard["tokens"]):
        raise _error(path, f"{index_file} does not match its shard (it starts at "
                     f"{int(index[0])} and ends at {int(index[-1]):,}, not 0 and "
                     f"{int(shard['tokens']):,}): corrupt; prepare the corpus again")
    if sum(int(s["tokens"]) for s in info["shards"]) != int(info["tokens"]):
      raise ValueError(f"the {split} split's shards do not add up to its tokens")


def _check_file(path: str, name: str, size: int, holds: str) -> None:
  full = os.path.join(path, name)
  if not os.path.isfile(full):
    raise _error(path, f"{full} is missing (the manifest lists it): the directory is "
                 "incomplete; prepare the corpus again")
  if os.path.getsize(full) != size:
    raise _error(path, f"{full} is {os.path.getsize(full):,} bytes, but the manifest says "
                 f"it holds {holds} = {size:,} bytes: corrupt or truncated; prepare the "
                 "corpus again")


def check_sizes(corpus: Corpus, *, vocab_size: int, seq_len: int, batch_size: int,
                num_replicas: int, num_eval_batches: int) -> None:
  """ConfigErrors for a vocabulary other than the model's, a replica's stream shorter than
  one batch, or an eval split without one window; the same on every host."""
  path, manifest = corpus.path, os.path.join(corpus.path, MANIFEST)
  if vocab_size != corpus.vocab_size:
    raise errors.ConfigError(
        f"config.data.vocab_size = {vocab_size}, but {manifest} says the tokenizer has "
        f"{corpus.vocab_size} tokens; set --config.data.vocab_size={corpus.vocab_size}")
  window = f"windows of config.model.seq_len = {seq_len} (+1) tokens"
  train = corpus.splits["train"]
  for g in range(num_replicas):
    stream = corpus.replica_stream(g, num_replicas)
    windows = max(len(stream) - 1, 0) // seq_len
    if windows < batch_size:
      raise _error(path, f"{manifest}: the train split ({train['tokens']:,} tokens, "
                   f"{train['documents']:,} documents) gives replica {g} of {num_replicas} "
                   f"{len(stream):,} tokens = {windows:,} {window}, fewer than "
                   f"config.batch_size = {batch_size}; use a larger corpus or fewer replicas")
  split = corpus.splits["eval"]
  if max(split["tokens"] - 1, 0) // seq_len == 0:  # fewer windows than needed: repeated
    raise _error(path, f"{manifest}: the eval split ({split['tokens']:,} tokens, "
                 f"{split['documents']:,} documents) holds no whole {window[:-1]}: prepare "
                 "with a larger eval fraction")


def resolved(config: ml_collections.ConfigDict, announce: bool = True
             ) -> ml_collections.ConfigDict:
  """The config as the run uses it: a prepared corpus brings its vocabulary, so
  `data.vocab_size` becomes its manifest's (a copy; a note says so when the config said
  otherwise), and a config written for other data trains on it unchanged. A corpus that
  cannot be opened is left to `make_host_data`, which names what is wrong."""
  if config.data.source != "prepared":
    return config
  try:
    vocab = open_corpus(config.data.path).vocab_size
  except errors.ConfigError:
    return config
  if vocab == config.data.vocab_size:
    return config
  if announce:
    print(f"config.data.vocab_size = {config.data.vocab_size} replaced by {vocab}, the "
          f"vocabulary of {config.data.path}/manifest.json", flush=True)
  config = copy.deepcopy(config)
  config.data.vocab_size = vocab
  return config
