"""Input pipelines (grain): a synthetic Markov source with a known floor, text, token files,
and prepared corpora (`python -m diloco_jax.prepare`; read by diloco_jax/corpus_reader.py).

Every sequence has L+1 tokens (inputs [:-1], targets [1:]). The replica with local index r
on host h reads shard g = h * replicas_per_host + r of G = hosts * replicas_per_host
disjoint shards, through its own checkpointable grain iterator.
"""

from __future__ import annotations

import dataclasses
import math
import os

import grain
import ml_collections
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.data import prepared as corpus_reader

# A little uniform probability in every context keeps the chain ergodic (a unique
# stationary distribution) while the transitions stay sparse.
UNIFORM_MIX = 0.01


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Attributes: vocab_size; floor, the exact expected loss of the true model (synthetic
  only, else None); unigram_loss, the loss of the best unigram model (nats/token);
  bytes_per_token, UTF-8 text bytes per token of the "train" and "eval" splits (prepared
  corpora only, whose manifest counts both; else None), for bits per byte."""
  vocab_size: int
  floor: float | None
  unigram_loss: float
  bytes_per_token: dict[str, float] | None = None


# ----------------------------------------------------------------------------- Markov chain

def markov_chain(vocab_size: int, order: int, branching: int, seed: int) -> np.ndarray:
  """Transition table P[context, next] with V**order contexts; context = Σ x_i V^(order-1-i)."""
  rng = np.random.default_rng(seed)
  num_contexts = vocab_size ** order
  probs = np.zeros((num_contexts, vocab_size))
  successors = np.argsort(rng.random((num_contexts, vocab_size)), axis=1)[:, :branching]
  weights = rng.dirichlet(np.ones(branching), size=num_contexts)
  np.put_along_axis(probs, successors, weights, axis=1)
  return (1 - UNIFORM_MIX) * probs + UNIFORM_MIX / vocab_size


def _context_transition(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For each context and next token, the index of the following context."""
  c, v = probs.shape
  return (np.arange(c)[:, None] * v) % c + np.arange(v)[None, :], np.arange(c)


def stationary_distribution(probs: np.ndarray, tol: float = 1e-15) -> np.ndarray:
  """The stationary distribution over contexts, by power iteration to machine precision."""
  nxt, _ = _context_transition(probs)
  pi = np.full(probs.shape[0], 1.0 / probs.shape[0])
  for _ in range(100_000):
    new = np.bincount(nxt.ravel(), weights=(pi[:, None] * probs).ravel(),
                      minlength=probs.shape[0])
    if np.abs(new - pi).max() < tol:
      return new
    pi = new
  raise RuntimeError("Markov chain: stationary distribution did not converge")


def _entropy(p: np.ndarray, axis=-1) -> np.ndarray:
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=axis)


def entropy_rate(probs: np.ndarray, pi: np.ndarray) -> float:
  """h = Σ_c π(c) H(P[c, :]) in nats per token."""
  return float(pi @ _entropy(probs))


def loss_floor(probs: np.ndarray, order: int, seq_len: int) -> float:
  """Expected per-token loss of the true conditional on targets 1..L of a sequence whose
  first `order` tokens are a stationary sample: early targets see fewer than `order`
  tokens of context, so they cost H(x_j | x_<j) > h."""
  v = probs.shape[1]
  pi = stationary_distribution(probs)
  joint = pi.reshape((v,) * order)  # stationary law of `order` consecutive tokens
  # H(x_j | x_<j) = H(x_0..x_j) − H(x_0..x_{j−1}) for j = 1 .. order−1.
  cond = [_entropy(joint.sum(axis=tuple(range(j + 1, order))).ravel())
          - _entropy(joint.sum(axis=tuple(range(j, order))).ravel()) for j in range(1, order)]
  h = entropy_rate(probs, pi)
  early = cond[:seq_len]
  return float((sum(early) + (seq_len - len(early)) * h) / seq_len)


def unigram_loss_of_chain(probs: np.ndarray) -> float:
  v = probs.shape[1]
  marginal = stationary_distribution(probs).reshape(v, -1).sum(axis=1)
  return float(_entropy(marginal))


def sample_sequences(probs: np.ndarray, order: int, num: int, length: int,
                     seed: int) -> np.ndarray:
  """`num` sequences of `length` tokens, vectorised over sequences, stationary start."""
  c, v = probs.shape
  rng = np.random.default_rng(seed)
  pi = stationary_distribution(probs)
  ctx = np.searchsorted(np.cumsum(pi), rng.random(num) * np.cumsum(pi)[-1], side="right")
  ctx = np.minimum(ctx, c - 1)
  out = np.empty((num, length), np.int32)
  for i in range(order):  # Unpack the starting context into its tokens.
    out[:, i] = (ctx // v ** (order - 1 - i)) % v
  cdf = np.cumsum(probs, axis=1)
  for t in range(order, length):
    u = rng.random(num) * cdf[ctx, -1]
    tok = np.minimum((cdf[ctx] < u[:, None]).sum(axis=1), v - 1)
    out[:, t] = tok
    ctx = (ctx * v) % c + tok
  return out


# ------------------------------------------------------------------------------- sources

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


def _flat_tokens(config: ml_collections.ConfigDict) -> np.ndarray:
  if not os.path.exists(config.path):
    raise config_lib.ConfigError(
        f"config.data.path = {config.path!r}: no such file or directory")
  if config.source == "text":
    return _read_text(config.path)
  tokens = np.memmap(config.path, dtype=np.dtype(config.token_dtype), mode="r")
  if tokens.size and int(tokens.max()) >= config.vocab_size:
    raise config_lib.ConfigError(
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
    raise config_lib.ConfigError(f"config.data.path = {path!r}: no such file or directory")
  if config.source == "text":
    files, skipped = text_files(path)
    if not files:
      found = "it is empty"
      if skipped:
        names = [os.path.relpath(f, path) for f in skipped]
        found = (f"found only {', '.join(names[:5])}" + (f" and {len(names) - 5} more"
                                                         if len(names) > 5 else ""))
      raise config_lib.ConfigError(
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
      raise config_lib.ConfigError(
          f"config.data.path = {path!r}: {size:,} bytes is not a whole number of "
          f"{config.token_dtype} tokens ({itemsize} bytes each); is config.data.token_dtype "
          "right?")
    num_tokens = size // itemsize
    held = f"holds {size:,} bytes = {num_tokens:,} {config.token_dtype} tokens"
  num_train, num_eval = num_shards * batch_size, num_eval_batches * batch_size
  windows = min_windows(num_train, num_eval, config.eval_fraction)
  need = windows * seq_len + 1
  if num_tokens < need:
    raise config_lib.ConfigError(
        f"config.data.path = {path!r}: {held}; needs at least {need:,} tokens: {windows:,} "
        f"windows of config.model.seq_len = {seq_len} (+1), config.data.eval_fraction = "
        f"{config.eval_fraction} of them giving {num_eval:,} held-out sequences "
        f"(config.eval_batches {num_eval_batches} x config.batch_size {batch_size}), the "
        f"rest {num_train:,} training ones ({num_shards} replica{'s' * (num_shards > 1)} x "
        f"config.batch_size {batch_size})")


# ------------------------------------------------------------------------------ host data

class HostData:
  """The data of one host: a checkpointable grain iterator per local replica, plus fixed
  held-out eval batches [E, B, L+1]."""

  def __init__(self, spec: DataSpec, iterators: list, eval_batches: np.ndarray):
    self.spec, self._iterators, self.eval_batches = spec, iterators, eval_batches

  def next_batch(self) -> np.ndarray:
    """int32 [R, B, L+1]: the next batch of every local replica."""
    return np.stack([next(it) for it in self._iterators])

  def get_state(self) -> list[dict]:
    return [it.get_state() for it in self._iterators]

  def set_state(self, states: list[dict]) -> None:
    if len(states) != len(self._iterators):
      raise ValueError(f"data state has {len(states)} replicas, this host has "
                       f"{len(self._iterators)}")
    for it, s in zip(self._iterators, states):
      it.set_state(s)


def make_host_data(config: ml_collections.ConfigDict, *, seq_len: int, batch_size: int,
                   replicas_per_host: int, num_eval_batches: int, host_index: int = 0,
                   num_hosts: int = 1) -> HostData:
  """The data of host `host_index` of `num_hosts`: its replicas' iterators and the eval
  batches (the same on every host). Bad files or sizes raise a ConfigError naming them."""
  num_shards = num_hosts * replicas_per_host
  if config.source == "prepared":
    return _prepared_host_data(config, seq_len=seq_len, batch_size=batch_size,
                               replicas_per_host=replicas_per_host,
                               num_eval_batches=num_eval_batches, host_index=host_index,
                               num_hosts=num_hosts)
  if config.source != "synthetic":
    check_file_data(config, seq_len=seq_len, batch_size=batch_size, num_shards=num_shards,
                    num_eval_batches=num_eval_batches)
  rng = np.random.default_rng(config.seed)
  if config.source == "synthetic":
    probs = markov_chain(config.vocab_size, config.markov_order, config.branching, config.seed)
    train = sample_sequences(probs, config.markov_order, config.num_sequences, seq_len + 1,
                             seed=config.seed + 1)
    held_out = sample_sequences(probs, config.markov_order, config.num_eval_sequences,
                                seq_len + 1, seed=config.seed + 2)
    spec = DataSpec(config.vocab_size, loss_floor(probs, config.markov_order, seq_len),
                    unigram_loss_of_chain(probs))
    base, num_train = train, len(train)
    if config.sharding == "non_iid":
      # Sorted by each sequence's most frequent token, then cut into contiguous blocks:
      # replicas see different parts of the chain's state space.
      mode = np.array([np.bincount(s, minlength=config.vocab_size).argmax() for s in train])
      order = np.argsort(mode, kind="stable")
    else:
      order = rng.permutation(num_train)
  else:
    tokens = _flat_tokens(config)
    num_windows = (len(tokens) - 1) // seq_len
    num_eval = int(num_windows * config.eval_fraction)
    num_train = num_windows - num_eval
    base = WindowSource(tokens, seq_len, 0, num_train)
    held_out_src = WindowSource(tokens, seq_len, num_train, num_windows)
    held_out = np.stack([held_out_src[i] for i in range(min(len(held_out_src),
                                                            num_eval_batches * batch_size))]
                        ) if len(held_out_src) else np.zeros((0, seq_len + 1), np.int32)
    counts = np.bincount(np.asarray(tokens[:num_train * seq_len + 1]),
                         minlength=config.vocab_size)
    spec = DataSpec(config.vocab_size, None, float(_entropy(counts / counts.sum())))
    order = rng.permutation(num_train)

  per_shard = num_train // num_shards
  if per_shard < batch_size:
    raise ValueError(f"{num_train} training sequences of {seq_len + 1} tokens give "
                     f"{per_shard} per replica for {num_shards} replicas: fewer than "
                     f"batch_size = {batch_size}")
  need = num_eval_batches * batch_size
  if len(held_out) < need:
    raise ValueError(f"{len(held_out)} held-out sequences, but eval_batches * batch_size "
                     f"= {need} are needed")
  eval_batches = np.asarray(held_out[:need], np.int32).reshape(num_eval_batches, batch_size, -1)

  iterators = []
  for r in range(replicas_per_host):
    g = host_index * replicas_per_host + r
    if config.source == "synthetic" and config.sharding == "non_iid":
      shard = order[g * per_shard:(g + 1) * per_shard]
    else:
      shard = order[g::num_shards][:per_shard]
    iterators.append(_replica_iterator(IndexedSource(base, shard), config.seed, g, batch_size))
  return HostData(spec, iterators, eval_batches)


def _replica_iterator(source, seed: int, g: int, batch_size: int):
  """Replica g's checkpointable iterator: `source` shuffled anew each epoch (seeded by the
  data seed and g), in batches."""
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # items are cheap slices
  return iter(grain.MapDataset.source(source)
              .shuffle(seed=seed * 1_000_003 + g).repeat(reseed_each_epoch=True)
              .batch(batch_size, drop_remainder=True).to_iter_dataset(read))


def _prepared_host_data(config: ml_collections.ConfigDict, *, seq_len: int, batch_size: int,
                        replicas_per_host: int, num_eval_batches: int, host_index: int,
                        num_hosts: int) -> HostData:
  """A prepared corpus (corpus_reader.py): replica g's windows are those of its own
  documents, packed across document boundaries (attention is not masked there); eval
  batches are the first eval_batches x batch_size windows of the "eval" split, never of
  training documents (repeated when the split holds fewer). Nothing is read whole: windows
  come from memory-mapped shards."""
  corpus = corpus_reader.open_corpus(config.path)
  num_replicas = num_hosts * replicas_per_host
  corpus_reader.check_sizes(corpus, vocab_size=config.vocab_size, seq_len=seq_len,
                            batch_size=batch_size, num_replicas=num_replicas,
                            num_eval_batches=num_eval_batches)
  held_out = corpus_reader.Windows(corpus.eval_stream(), seq_len)
  need = num_eval_batches * batch_size
  if len(held_out) < need and host_index == 0:  # a small corpus: every window, some twice
    print(f"note: the eval split of {config.path} holds {len(held_out):,} windows, fewer than "
          f"the {need:,} of config.eval_batches x batch_size; they are repeated", flush=True)
  eval_batches = np.stack([held_out[i % len(held_out)] for i in range(need)]).reshape(
      num_eval_batches, batch_size, seq_len + 1)
  iterators = []
  for r in range(replicas_per_host):
    g = host_index * replicas_per_host + r
    windows = corpus_reader.Windows(corpus.replica_stream(g, num_replicas), seq_len)
    iterators.append(_replica_iterator(windows, config.seed, g, batch_size))
  spec = DataSpec(corpus.vocab_size, None, corpus.unigram_loss(), corpus.bytes_per_token())
  return HostData(spec, iterators, eval_batches)
