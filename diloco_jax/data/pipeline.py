"""Input pipelines (grain): each replica's stream from a synthetic Markov source
(`synthetic.py`), text or token files (`files.py`) or a prepared corpus (`prepared.py`,
written by `python -m diloco_jax.prepare`).

Every sequence has L+1 tokens (inputs [:-1], targets [1:]). The replica with local index r
on host h reads shard g = h * replicas_per_host + r of G = hosts * replicas_per_host
disjoint shards, through its own checkpointable grain iterator.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from diloco_jax.data import files
from diloco_jax.data import prepared
from diloco_jax.data import synthetic
from diloco_jax.runtime import imports

with imports.without("orbax.checkpoint"):  # grain's handler for orbax, not used here
  import grain  # pylint: disable=g-import-not-at-top


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
  if config.source == "prepared":
    return _prepared_host_data(config, seq_len=seq_len, batch_size=batch_size,
                               replicas_per_host=replicas_per_host,
                               num_eval_batches=num_eval_batches, host_index=host_index,
                               num_hosts=num_hosts)
  num_shards = num_hosts * replicas_per_host
  if config.source == "synthetic":
    spec, base, held_out, order = _synthetic(config, seq_len)
  else:
    files.check_file_data(config, seq_len=seq_len, batch_size=batch_size,
                          num_shards=num_shards, num_eval_batches=num_eval_batches)
    spec, base, held_out, order = _from_files(config, seq_len, num_eval_batches * batch_size)
  num_train = len(base)
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
    iterators.append(_replica_iterator(files.IndexedSource(base, shard), config.seed, g,
                                       batch_size))
  return HostData(spec, iterators, eval_batches)


def _synthetic(config: ml_collections.ConfigDict, seq_len: int):
  """(spec, training sequences, held-out sequences, the order shards are cut from)."""
  probs = synthetic.markov_chain(config.vocab_size, config.markov_order, config.branching,
                                 config.seed)
  train = synthetic.sample_sequences(probs, config.markov_order, config.num_sequences,
                                     seq_len + 1, seed=config.seed + 1)
  held_out = synthetic.sample_sequences(probs, config.markov_order, config.num_eval_sequences,
                                        seq_len + 1, seed=config.seed + 2)
  spec = DataSpec(config.vocab_size, synthetic.loss_floor(probs, config.markov_order, seq_len),
                  synthetic.unigram_loss_of_chain(probs))
  if config.sharding == "non_iid":
    # Sorted by each sequence's most frequent token, then cut into contiguous blocks:
    # replicas see different parts of the chain's state space.
    mode = np.array([np.bincount(s, minlength=config.vocab_size).argmax() for s in train])
    order = np.argsort(mode, kind="stable")
  else:
    order = np.random.default_rng(config.seed).permutation(len(train))
  return spec, train, held_out, order


def _from_files(config: ml_collections.ConfigDict, seq_len: int, num_held_out: int):
  """(spec, training windows, held-out windows, the order shards are cut from): the last
  `eval_fraction` of the file's windows are held out."""
  tokens = files.flat_tokens(config)
  num_windows = (len(tokens) - 1) // seq_len
  num_train = num_windows - int(num_windows * config.eval_fraction)
  base = files.WindowSource(tokens, seq_len, 0, num_train)
  held_out_src = files.WindowSource(tokens, seq_len, num_train, num_windows)
  held_out = np.stack([held_out_src[i] for i in range(min(len(held_out_src), num_held_out))]
                      ) if len(held_out_src) else np.zeros((0, seq_len + 1), np.int32)
  counts = np.bincount(np.asarray(tokens[:num_train * seq_len + 1]),
                       minlength=config.vocab_size)
  spec = DataSpec(config.vocab_size, None, float(synthetic.entropy(counts / counts.sum())))
  return spec, base, held_out, np.random.default_rng(config.seed).permutation(num_train)


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
  """A prepared corpus (prepared.py): replica g's windows are those of its own
  documents, packed across document boundaries (attention is not masked there); eval
  batches are the first eval_batches x batch_size windows of the "eval" split, never of
  training documents (repeated when the split holds fewer). Nothing is read whole: windows
  come from memory-mapped shards."""
  corpus = prepared.open_corpus(config.path)
  num_replicas = num_hosts * replicas_per_host
  prepared.check_sizes(corpus, vocab_size=config.vocab_size, seq_len=seq_len,
                            batch_size=batch_size, num_replicas=num_replicas,
                            num_eval_batches=num_eval_batches)
  held_out = prepared.Windows(corpus.eval_stream(), seq_len)
  need = num_eval_batches * batch_size
  if len(held_out) < need and host_index == 0:  # a small corpus: every window, some twice
    print(f"note: the eval split of {config.path} holds {len(held_out):,} windows, fewer than "
          f"the {need:,} of config.eval_batches x batch_size; they are repeated", flush=True)
  eval_batches = np.stack([held_out[i % len(held_out)] for i in range(need)]).reshape(
      num_eval_batches, batch_size, seq_len + 1)
  iterators = []
  for r in range(replicas_per_host):
    g = host_index * replicas_per_host + r
    windows = prepared.Windows(corpus.replica_stream(g, num_replicas), seq_len)
    iterators.append(_replica_iterator(windows, config.seed, g, batch_size))
  spec = DataSpec(corpus.vocab_size, None, corpus.unigram_loss(), corpus.bytes_per_token())
  return HostData(spec, iterators, eval_batches)
