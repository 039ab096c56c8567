"""Data: the exact loss floor, disjoint shards, exact resume, text and token files."""

import itertools

import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.data import synthetic


def data_config(**overrides):
  c = config_lib.get_default_config().data
  c.update(dict(num_sequences=256, num_eval_sequences=32))
  c.update(overrides)
  return c


def host_data(c, **kw):
  args = dict(seq_len=8, batch_size=4, replicas_per_host=2, num_eval_batches=2)
  args.update(kw)
  return data_lib.make_host_data(c, **args)


def test_floor_equals_brute_force():
  """Enumerate every sequence of a tiny chain and average the true conditional's loss."""
  v, order, seq_len = 3, 2, 4
  probs = synthetic.markov_chain(v, order, branching=2, seed=5)
  pi = synthetic.stationary_distribution(probs)
  np.testing.assert_allclose(  # π is stationary: the law of the next context is π again.
      np.bincount(((np.arange(v * v)[:, None] * v) % (v * v) + np.arange(v)).ravel(),
                  weights=(pi[:, None] * probs).ravel(), minlength=v * v), pi, atol=1e-12)
  total = 0.0
  for seq in itertools.product(range(v), repeat=seq_len + 1):
    p = pi[seq[0] * v + seq[1]]
    for t in range(2, seq_len + 1):
      p *= probs[seq[t - 2] * v + seq[t - 1], seq[t]]
    # Target 1 is predicted from x0 alone: p(x1 | x0) = π(x0, x1) / Σ_b π(x0, b).
    nll = -np.log(pi[seq[0] * v + seq[1]] / pi[seq[0] * v: seq[0] * v + v].sum())
    for t in range(2, seq_len + 1):
      nll -= np.log(probs[seq[t - 2] * v + seq[t - 1], seq[t]])
    total += p * nll / seq_len
  assert abs(synthetic.loss_floor(probs, order, seq_len) - total) <= 1e-9


def test_samples_match_floor_and_unigram():
  c = data_config(vocab_size=8, branching=3)
  probs = synthetic.markov_chain(8, 2, 3, seed=0)
  seqs = synthetic.sample_sequences(probs, 2, 20000, 17, seed=1)
  nll = -np.log(probs[seqs[:, :-2] * 8 + seqs[:, 1:-1], seqs[:, 2:]]).mean()
  # Positions 2..16 of 20000 sequences: ~3e5 draws; the std error of the mean is < 0.003.
  assert abs(nll - synthetic.entropy_rate(probs, synthetic.stationary_distribution(probs))) < 0.01
  spec = host_data(c).spec
  assert spec.unigram_loss > spec.floor > 0
  freq = np.bincount(seqs.ravel(), minlength=8) / seqs.size
  assert abs(-(freq * np.log(freq)).sum() - spec.unigram_loss) < 0.01


@pytest.mark.parametrize("sharding", ["iid", "non_iid"])
def test_shards_disjoint(sharding):
  c = data_config(sharding=sharding)
  shards = []
  for host in range(2):  # 2 hosts x 2 replicas, 256 sequences: 64 per shard = 16 batches.
    d = host_data(c, host_index=host, num_hosts=2)
    batches = np.stack([d.next_batch() for _ in range(16)])  # [16, R, B, L+1]
    shards += [batches[:, r].reshape(-1, 9) for r in range(2)]
  rows = [set(map(bytes, s.astype(np.int32))) for s in shards]
  assert all(len(r) == 64 for r in rows)  # each shard read once per epoch, no repeats
  for a, b in itertools.combinations(rows, 2):
    assert not a & b
  if sharding == "non_iid":  # the most frequent token differs across replicas
    modes = [np.bincount(s.ravel(), minlength=32).argmax() for s in shards]
    assert len(set(modes)) > 1


def test_resume_exact():
  c = data_config()
  d = host_data(c)
  for _ in range(5):
    d.next_batch()
  state = d.get_state()
  expected = [d.next_batch() for _ in range(40)]  # crosses an epoch boundary
  fresh = host_data(c)
  fresh.set_state(state)
  for e in expected:
    np.testing.assert_array_equal(fresh.next_batch(), e)


def test_deterministic_and_host_dependent():
  c = data_config()
  a, b = host_data(c), host_data(c)
  np.testing.assert_array_equal(a.next_batch(), b.next_batch())
  np.testing.assert_array_equal(a.eval_batches, b.eval_batches)
  other = host_data(c, host_index=1, num_hosts=2)
  assert not np.array_equal(host_data(c, num_hosts=2).next_batch(), other.next_batch())


def test_text_directory(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_bytes(bytes(range(1, 256)) * 3)  # no NUL: not a binary file
  (tmp_path / "sub" / "b.txt").write_bytes(np.random.default_rng(0).bytes(500)
                                           .replace(b"\0", b"\1"))
  raw = np.frombuffer((tmp_path / "a.txt").read_bytes() + (tmp_path / "sub" / "b.txt")
                      .read_bytes(), np.uint8)
  c = data_config(source="text", path=str(tmp_path), vocab_size=256, eval_fraction=0.2)
  d = host_data(c, replicas_per_host=1, num_eval_batches=1)
  windows = {bytes(raw[i * 8:i * 8 + 9]) for i in range((len(raw) - 1) // 8)}
  batch = d.next_batch()[0]
  assert all(bytes(row.astype(np.uint8)) in windows for row in batch)
  train = {bytes(row.astype(np.uint8)) for _ in range(20) for row in d.next_batch()[0]}
  held_out = {bytes(row.astype(np.uint8)) for row in d.eval_batches.reshape(-1, 9)}
  assert not train & held_out
  assert d.spec.floor is None and d.spec.unigram_loss > 0


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_file(tmp_path, dtype):
  tokens = np.arange(4000) % 1000
  path = tmp_path / "tokens.bin"
  tokens.astype(dtype).tofile(path)
  c = data_config(source="tokens", path=str(path), token_dtype=dtype, vocab_size=1000)
  batch = host_data(c).next_batch()
  assert batch.dtype == np.int32
  np.testing.assert_array_equal(np.diff(batch, axis=-1) % 1000, 1)  # consecutive tokens
  c.vocab_size = 999
  with pytest.raises(ValueError, match="token id 999"):
    host_data(c)


def test_bad_inputs(tmp_path):
  with pytest.raises(ValueError, match="no such file"):
    host_data(data_config(source="tokens", path=str(tmp_path / "missing.bin")))
  with pytest.raises(ValueError, match="fewer than batch_size"):
    host_data(data_config(num_sequences=20), batch_size=16)
  with pytest.raises(ValueError, match="held-out"):
    host_data(data_config(num_eval_sequences=4))
