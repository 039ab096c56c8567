"""Prepared corpora (data.source = "prepared") read by the data pipeline: replicas on
disjoint documents across hosts, windows that are exact slices of a replica's documents,
eval only from the eval split, exact resume of the iterators, bits per byte, and one-line
errors for every bad directory. Training on them: tests/test_prepared_training.py.

Directories are written by `tests/prepared_dirs.write_prepared` (the "bytes" tokenizer), so
these tests do not depend on the tokenizers that `diloco_jax.prepare` uses.
"""

import json
import os

import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.data import files as data_files
from diloco_jax.data import prepared as prepared_corpus
from diloco_jax.loop import trainer
from tests.prepared_dirs import BATCH
from tests.prepared_dirs import EOS
from tests.prepared_dirs import SEQ_LEN
from tests.prepared_dirs import VOCAB
from tests.prepared_dirs import corpus_documents
from tests.prepared_dirs import data_config
from tests.prepared_dirs import draw
from tests.prepared_dirs import host_data
from tests.prepared_dirs import tags
from tests.prepared_dirs import train_config
from tests.prepared_dirs import write_prepared


def expected_stream(documents: list[str], g: int, num_replicas: int,
                    docs_per_shard: int = 70) -> np.ndarray:
  """Replica g's stream, rebuilt from the documents: in each shard, the documents whose
  first token lies at or after round(g T / K) and before round((g + 1) T / K)."""
  parts = []
  for first in range(0, len(documents), docs_per_shard):
    docs = [np.array(list(d.encode()) + [EOS]) for d in documents[first:first + docs_per_shard]]
    starts = np.cumsum([0] + [len(d) for d in docs])
    total = starts[-1]
    lo, hi = round(total * g / num_replicas), round(total * (g + 1) / num_replicas)
    parts += [d for d, s in zip(docs, starts[:-1]) if lo <= s < hi]
  return np.concatenate(parts)


def test_replicas_read_disjoint_documents_and_eval_only_eval(prepared, documents):
  """2 hosts x 2 replicas: no document in two replicas' streams, no eval document in any
  training stream, eval batches only from eval documents; the replicas together cover
  nearly every training document."""
  hosts = [host_data(data_config(prepared), host_index=h, num_hosts=2) for h in range(2)]
  seen = [tags(w) for w in draw(hosts, 300)]  # more than an epoch of any replica
  for a in range(4):
    assert seen[a] and all(t.startswith(b"t") for t in seen[a])
    for b in range(a + 1, 4):
      assert not seen[a] & seen[b], (a, b, sorted(seen[a] & seen[b])[:5])
  assert len(set().union(*seen)) > 0.9 * len(documents[0])
  for d in hosts:
    held_out = tags(d.eval_batches.reshape(-1, SEQ_LEN + 1))
    assert held_out and all(t.startswith(b"e") for t in held_out)
    np.testing.assert_array_equal(d.eval_batches, hosts[0].eval_batches)


def test_every_window_is_a_slice_of_the_replicas_documents(prepared, documents):
  """Each window is tokens [i L, i L + L + 1) of the replica's documents concatenated
  (rebuilt here with numpy from the documents); an epoch draws each window at most once;
  eval batches are the first windows of the eval documents."""
  hosts = [host_data(data_config(prepared), host_index=h, num_hosts=2) for h in range(2)]
  streams = [expected_stream(documents[0], g, 4) for g in range(4)]
  counts = [(len(s) - 1) // SEQ_LEN for s in streams]
  for g, windows in enumerate(draw(hosts, min(counts) // BATCH)):  # the shortest epoch
    stream = streams[g].astype(np.int32)
    expected = {stream[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1].tobytes(): i
                for i in range(counts[g])}
    drawn = [expected[np.asarray(w, np.int32).tobytes()] for w in windows]
    assert len(set(drawn)) == len(drawn)  # one epoch: no window twice
    if counts[g] == min(counts):  # a whole epoch, but for the last partial batch
      assert len(drawn) > counts[g] - BATCH
  eval_stream = np.concatenate([list(d.encode()) + [EOS] for d in documents[1]])
  want = np.stack([eval_stream[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in range(8)])
  np.testing.assert_array_equal(hosts[0].eval_batches.reshape(-1, SEQ_LEN + 1), want)


def test_iterator_state_round_trip(prepared):
  """Batches after set_state(get_state()) equal the original's, across an epoch's end."""
  c = data_config(prepared)
  a = host_data(c, replicas_per_host=1)
  for _ in range(7):
    a.next_batch()
  state = json.loads(json.dumps(a.get_state()))  # as a checkpoint stores it
  want = [a.next_batch() for _ in range(900)]  # more than an epoch of this replica
  b = host_data(c, replicas_per_host=1)
  b.set_state(state)
  for x in want:
    np.testing.assert_array_equal(b.next_batch(), x)
  other_seed = host_data(data_config(prepared, seed=4), replicas_per_host=1)
  assert not np.array_equal(other_seed.next_batch(), host_data(c, replicas_per_host=1)
                            .next_batch())


def test_spec_bytes_per_token_and_unigram(prepared, documents):
  spec = host_data(data_config(prepared)).spec
  for split, docs in zip(("train", "eval"), documents):
    text = sum(len(d.encode()) for d in docs)
    assert spec.bytes_per_token[split] == pytest.approx(text / (text + len(docs)))
  train = np.concatenate([list(d.encode()) + [EOS] for d in documents[0]])
  p = np.bincount(train, minlength=VOCAB) / len(train)
  p = p[p > 0]
  assert spec.unigram_loss == pytest.approx(-(p * np.log(p)).sum())
  assert spec.vocab_size == VOCAB and spec.floor is None


def test_unigram_of_a_large_corpus_is_sampled(prepared, monkeypatch):
  """Past UNIGRAM_SAMPLE tokens, evenly spaced chunks: close to the whole split's figure."""
  whole = host_data(data_config(prepared)).spec.unigram_loss
  monkeypatch.setattr(prepared_corpus, "UNIGRAM_SAMPLE", 64 * 200)
  sampled = host_data(data_config(prepared)).spec.unigram_loss
  assert sampled != whole and sampled == pytest.approx(whole, abs=0.05)


# -------------------------------------------------------------------------------- errors

def error(c, **kw) -> str:
  """The ConfigError of make_host_data: one line, naming config.data.path or a field."""
  with pytest.raises(config_lib.ConfigError) as e:
    host_data(c, **kw)
  message = str(e.value)
  assert "\n" not in message, message
  return message


def edit_manifest(path, **changes):
  with open(os.path.join(path, "manifest.json")) as f:
    manifest = json.load(f)
  manifest.update(changes)
  with open(os.path.join(path, "manifest.json"), "w") as f:
    json.dump(manifest, f)


@pytest.fixture
def copy(tmp_path, documents):
  return write_prepared(tmp_path / "corpus", *documents)


def test_not_a_prepared_directory(tmp_path):
  (tmp_path / "empty").mkdir()
  message = error(data_config(str(tmp_path / "empty")))
  assert message == (f"config.data.path = '{tmp_path}/empty': {tmp_path}/empty/manifest.json "
                     "is missing: not a prepared directory; make one with python -m "
                     f"diloco_jax.prepare --output={tmp_path}/empty")
  assert error(data_config(str(tmp_path / "missing"))) == (
      f"config.data.path = '{tmp_path}/missing': no such directory (a 'prepared' source is a "
      "directory written by python -m diloco_jax.prepare)")


def test_interrupted_prepare(copy, tmp_path):
  """prepare builds DIR in .DIR.partial and renames it when done; a directory with shards
  and no manifest is an interrupted prepare too."""
  os.rename(copy, tmp_path / ".corpus.partial")
  assert error(data_config(copy)) == (
      f"config.data.path = '{copy}': no such directory, but {tmp_path}/.corpus.partial is "
      "there: its prepare was interrupted; run it again")
  os.rename(tmp_path / ".corpus.partial", copy)
  os.remove(os.path.join(copy, "manifest.json"))
  assert error(data_config(copy)).endswith(
      "manifest.json is missing: its prepare was interrupted (the manifest is written last); "
      "run it again")


def test_wrong_format_version(copy):
  edit_manifest(copy, format="diloco_jax.prepared/2")
  assert error(data_config(copy)) == (
      f"config.data.path = '{copy}': {copy}/manifest.json has format "
      "'diloco_jax.prepared/2'; this version of diloco_jax reads 'diloco_jax.prepared/1': "
      "prepare the corpus again with this version")
  with open(os.path.join(copy, "manifest.json"), "w") as f:
    f.write("{not json")
  assert "manifest.json cannot be read: Expecting property name" in error(data_config(copy))
  edit_manifest_raw = {"format": "diloco_jax.prepared/1", "vocab_size": 257}
  with open(os.path.join(copy, "manifest.json"), "w") as f:
    json.dump(edit_manifest_raw, f)
  assert "manifest.json is malformed (KeyError: 'dtype')" in error(data_config(copy))


def test_missing_or_truncated_shard(copy, documents):
  shard = os.path.join(copy, "train-00001.bin")
  size = os.path.getsize(shard)
  with open(shard, "r+b") as f:
    f.truncate(size - 6)
  assert error(data_config(copy)) == (
      f"config.data.path = '{copy}': {shard} is {size - 6:,} bytes, but the manifest says it "
      f"holds {size // 2:,} uint16 tokens = {size:,} bytes: corrupt or truncated; prepare the "
      "corpus again")
  os.remove(shard)
  assert error(data_config(copy)) == (
      f"config.data.path = '{copy}': {shard} is missing (the manifest lists it): the "
      "directory is incomplete; prepare the corpus again")
  write_prepared(copy, *documents)
  os.remove(os.path.join(copy, "eval-00000.idx"))
  assert "eval-00000.idx is missing" in error(data_config(copy))


def test_corrupt_index(copy):
  index = os.path.join(copy, "train-00000.idx")
  offsets = np.fromfile(index, "<u8")
  offsets[-1] += 1
  offsets.tofile(index)
  assert f"{index} does not match its shard" in error(data_config(copy))


def test_vocab_mismatch(prepared):
  assert error(data_config(prepared, vocab_size=16)) == (
      f"config.data.vocab_size = 16, but {prepared}/manifest.json says the tokenizer has 257 "
      "tokens; set --config.data.vocab_size=257")


def test_too_few_tokens(prepared):
  message = error(data_config(prepared), batch_size=1000, num_hosts=2)
  assert message.startswith(f"config.data.path = '{prepared}': {prepared}/manifest.json: "
                            "the train split (") and "fewer than config.batch_size = 1000" \
      in message


def test_a_small_eval_split_is_repeated(prepared, tmp_path, capsys):
  """More eval windows than the split holds: every window, in order, then again; an eval
  split without one whole window is an error."""
  few = host_data(data_config(prepared), num_eval_batches=2)
  many = host_data(data_config(prepared), num_eval_batches=200)
  held = many.eval_batches.reshape(-1, SEQ_LEN + 1)
  windows = len({w.tobytes() for w in held})  # the distinct windows: all the split holds
  assert f"holds {windows:,} windows, fewer than the {200 * BATCH:,}" in capsys.readouterr().out
  np.testing.assert_array_equal(held[:2 * BATCH], few.eval_batches.reshape(-1, SEQ_LEN + 1))
  np.testing.assert_array_equal(held[windows:2 * windows], held[:windows])
  tiny = write_prepared(tmp_path / "tiny", *corpus_documents(num_train=240, num_eval=0))
  message = error(data_config(tiny))
  assert "the eval split (0 tokens, 0 documents) holds no whole window" in message, message


def test_config_needs_a_path():
  c = config_lib.get_default_config()
  c.data.source = "prepared"
  with pytest.raises(config_lib.ConfigError, match="config.data.path = '': must be a "
                     "directory written by python -m diloco_jax.prepare"):
    config_lib.validate(c)


def test_cli_prints_one_line(copy, tmp_path):
  """Through `python -m diloco_jax.train`: one line on stderr, exit 1, nothing trained."""
  from tests import test_errors
  shard = os.path.join(copy, "train-00001.bin")
  with open(shard, "r+b") as f:
    f.truncate(100)
  line = test_errors.error_line(
      test_errors.TINY, f"--workdir={tmp_path / 'work'}", "--config.data.source=prepared",
      f"--config.data.path={copy}")
  assert line.startswith(f"Invalid config: config.data.path = '{copy}': {shard} is 100 bytes,"
                         ), line


def test_the_corpus_brings_its_vocabulary(prepared, tmp_path, capsys):
  """A config written for other data (vocab 16) trains on a prepared corpus (257)."""
  config = train_config(prepared, num_rounds=1, **{"data.vocab_size": 16})
  result = trainer.train_and_evaluate(config, str(tmp_path))
  assert "config.data.vocab_size = 16 replaced by 257" in capsys.readouterr().out
  with open(tmp_path / "run.json") as f:
    assert json.load(f)["config"]["data"]["vocab_size"] == 257
  assert config.data.vocab_size == 16  # the caller's config is not changed
  assert result.records[0]["train_loss"] > 0


def test_text_directories_skip_binary_files(tmp_path):
  (tmp_path / "lib").mkdir()
  (tmp_path / "a.py").write_text("print('hello')\n" * 100)
  (tmp_path / "lib" / "m.so").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(1000))
  (tmp_path / "lib" / "b.txt").write_text("naïve déjà vu\n" * 100)
  (tmp_path / "m.pyc").write_bytes(b"\xa7\r\r\n\x00\x00\x00\x00" + b"x" * 100)
  used, skipped = data_files.text_files(str(tmp_path))
  assert used == [str(tmp_path / "a.py"), str(tmp_path / "lib" / "b.txt")]
  assert skipped == [str(tmp_path / "lib" / "m.so"), str(tmp_path / "m.pyc")]
