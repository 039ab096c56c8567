"""Prepared corpora (data.source = "prepared"): replicas on disjoint documents across
hosts, windows that are exact slices of a replica's documents, eval only from the eval
split, exact resume of the iterators and of training, bits per byte, and one-line errors
for every bad directory.

Directories are written by `write_prepared`, a small writer of the format (the "bytes"
tokenizer: a token per UTF-8 byte, EOS 256), so these tests do not depend on the
tokenizers that `diloco_jax.prepare` uses; one test goes through `prepare` itself.
"""

import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import time

import jax
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.data import files as data_files
from diloco_jax.data import pipeline as data_lib
from diloco_jax.data import prepared as prepared_corpus
from diloco_jax.checkpoints import store
from diloco_jax.loop import trainer
from diloco_jax.models import exported
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from diloco_jax.runtime import preemption
from tests import multihost

EOS, VOCAB = 256, 257
SEQ_LEN, BATCH = 32, 4
TAG = re.compile(rb"<([te])(\d{4})\.\d\d>")
WORDS = ("alpha", "beta", "gamma", "λx", "naïve", "déjà", "Ω", "zeta", "eta", "theta")


def document(kind: str, i: int, rng: random.Random) -> str:
  """Segments of at most 17 bytes, each opening with the document's tag and its own
  number, <t0012.07> (train) or <e0003.00> (eval): every window of L+1 = 33 tokens holds
  a whole one, so windows differ, and show which documents they were cut from."""
  return "".join(f"<{kind}{i:04d}.{j:02d}>{rng.choice(WORDS)} "
                 for j in range(rng.randint(3, 30)))


def corpus_documents(num_train: int = 240, num_eval: int = 40, seed: int = 0):
  rng = random.Random(seed)
  return ([document("t", i, rng) for i in range(num_train)],
          [document("e", i, rng) for i in range(num_eval)])


def write_prepared(directory, train: list[str], eval_: list[str],
                   docs_per_shard: int = 70) -> str:
  """A prepared directory in the format of docs/prepared_format.md (bytes tokenizer)."""
  os.makedirs(directory, exist_ok=True)
  splits = {}
  for split, docs in (("train", train), ("eval", eval_)):
    shards = []
    for n, first in enumerate(range(0, len(docs), docs_per_shard)):
      encoded = [list(d.encode()) + [EOS] for d in docs[first:first + docs_per_shard]]
      tokens = np.array([t for e in encoded for t in e], "<u2")
      index = np.array([0, *np.cumsum([len(e) for e in encoded])], "<u8")
      name = f"{split}-{n:05d}"
      tokens.tofile(os.path.join(directory, name + ".bin"))
      index.tofile(os.path.join(directory, name + ".idx"))
      shards.append({"file": name + ".bin", "index": name + ".idx", "documents": len(encoded),
                     "tokens": len(tokens),
                     "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
    splits[split] = {"documents": len(docs), "tokens": sum(s["tokens"] for s in shards),
                     "bytes": sum(len(d.encode()) for d in docs), "shards": shards}
  manifest = {"format": "diloco_jax.prepared/1", "vocab_size": VOCAB, "eos_id": EOS,
              "dtype": "uint16", "tokenizer": {"kind": "bytes", "file": None},
              "splits": splits, "eval": {"fraction": 0.15, "max_documents": None, "seed": 0},
              "sources": [], "args": {"tokenizer": "bytes"},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
  with open(os.path.join(directory, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  return str(directory)


@pytest.fixture(scope="module")
def documents():
  return corpus_documents()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, documents):
  return write_prepared(tmp_path_factory.mktemp("prepared"), *documents)


def data_config(path: str, **overrides):
  c = config_lib.get_default_config().data
  c.update(dict(source="prepared", path=path, vocab_size=VOCAB, seed=3))
  c.update(overrides)
  return c


def host_data(c, **kw):
  args = dict(seq_len=SEQ_LEN, batch_size=BATCH, replicas_per_host=2, num_eval_batches=2)
  args.update(kw)
  return data_lib.make_host_data(c, **args)


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


def draw(hosts: list[data_lib.HostData], num_batches: int) -> list[list[np.ndarray]]:
  """The windows of `num_batches` batches of every replica (host-major order: g)."""
  batches = [[], [], [], []]
  for _ in range(num_batches):
    for h, d in enumerate(hosts):
      for r, batch in enumerate(d.next_batch()):
        batches[2 * h + r] += list(batch)
  return batches


def tags(windows, decode=None) -> set[bytes]:
  """The documents (b"t0012", b"e0003") that windows of tokens were cut from."""
  decode = decode or (lambda w: bytes(np.asarray(w)[np.asarray(w) != EOS].astype(np.uint8)))
  return {b"".join(m) for w in windows for m in TAG.findall(decode(w))}


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


# ------------------------------------------------------------------------------ training

def train_config(path: str, **overrides):
  return multihost.small_config(**{"data.source": "prepared", "data.path": path,
                                   "data.vocab_size": VOCAB, **overrides})


def test_trainer_trains_on_prepared_data(prepared, tmp_path, capsys):
  config = train_config(prepared, num_rounds=4, **{"inner.lr": 1e-2})
  result = trainer.train_and_evaluate(config, str(tmp_path))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals
  bpt = result.records[0]["train_loss"] / result.records[0]["train_bpb"] / math.log(2)
  assert bpt == pytest.approx(host_data(data_config(prepared)).spec.bytes_per_token["train"])
  assert all("train_bpb" in r and "eval_bpb" in r for r in result.records)
  out = capsys.readouterr().out
  assert re.search(r"train \d+\.\d{4} \(\d\.\d{3} bpb\) \| eval \d+\.\d{4} \(\d\.\d{3} bpb\)",
                   out), out[-2000:]
  assert "bits/byte" in out.splitlines()[-1]
  with open(tmp_path / "metrics.jsonl") as f:
    assert all("eval_bpb" in json.loads(line) for line in f)
  assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_preempted_run_resumes_bit_identically(prepared, tmp_path, monkeypatch, capsys):
  """Stop after round 2 of 4, run again: the same params and records as a run never
  stopped (the data iterators' state is in the checkpoint). The second run resumed from
  checkpoint 2: a silent start from round 1 would reproduce the reference too."""
  config = train_config(prepared, num_rounds=4, **{"checkpoint.every": 0})
  reference = trainer.train_and_evaluate(config, str(tmp_path / "ref"))
  with monkeypatch.context() as m:
    m.setattr(preemption.Preemption, "reached", lambda self, r: r == 2)
    first = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert first.preempted_at == 2
  capsys.readouterr()
  resumed = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  out = capsys.readouterr().out
  assert "resumed from checkpoint 2 (" in out and "continuing at round 3 of 4" in out, out
  assert re.findall(r"^round +(\d+)/4 ", out, re.M) == ["3", "4"], out  # not 1 and 2 again
  with open(tmp_path / "run" / "run.json") as f:
    assert json.load(f)["start"]["round"] == 2
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference.params),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  keys = ("round", "train_loss", "eval_loss", "train_bpb", "eval_bpb")
  assert ([[r[k] for k in keys] for r in resumed.records]
          == [[r[k] for k in keys] for r in reference.records])


# A pretrained model of its own shape, and a vocabulary of 3 more tokens than the corpus's.
GPT2 = family_lib.ModelConfig(vocab_size=VOCAB + 3, seq_len=16, num_layers=2, d_model=32,
                             num_heads=2, mlp_dim=64, family="gpt", tie_embeddings=True)


def pretrained_gpt(directory) -> str:
  """A GPT2LMHeadModel directory of GPT2's shape (Hugging Face's layout, by our export)."""
  params = model_lib.init_params(GPT2, jax.random.key(7))
  exported.write(os.path.join(directory, "model.safetensors"), GPT2, params)
  return str(directory)


def launch(workdir, path, max_restarts=0, init_from=None):
  return multihost.start([
      sys.executable, "launch/local.py", "--hosts=2", f"--max_restarts={max_restarts}", "--",
      f"--workdir={workdir}", "--config=configs/tiny.py", "--config.replicas_per_host=1",
      "--config.num_rounds=8", "--config.inner_steps=5", "--config.inner.warmup_steps=5",
      "--config.batch_size=4", "--config.model.seq_len=16", "--config.eval_batches=2",
      "--config.data.source=prepared", f"--config.data.path={path}",
      f"--config.data.vocab_size={VOCAB}", "--config.debug_checks=True",
      *([f"--config.model.init_from={init_from}"] if init_from else []),
      "--heartbeat_timeout=20"])


def host_pid(launcher, host: int) -> int:
  for pid in multihost.children(launcher.pid):
    with open(f"/proc/{pid}/cmdline") as f:
      if f"--host_id={host}" in f.read().replace("\0", " "):
        return pid
  raise AssertionError(f"host {host} not running")


def records(workdir):
  with open(os.path.join(multihost.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.multihost
def test_sigkill_restart_resumes_bit_identically(prepared, tmp_path):
  """Host 1 killed (SIGKILL) after checkpoint 3 of a 2-host run started from a pretrained
  model (config.model.init_from, its own shape); the launcher restarts both, which resume
  and end where an uninterrupted run ends, anchor hashes included (compared across hosts
  after every round, the first too: debug_checks)."""
  model = pretrained_gpt(tmp_path / "gpt")
  text = launch(tmp_path / "ref", prepared, init_from=model).communicate(timeout=300)[0]
  assert "final eval loss" in text, text[-4000:]
  assert f"config.model.init_from = {model}: from its config.json, vocab_size 0 -> 260" in text
  with open(multihost.host_dir(tmp_path / "ref") / "run.json") as f:
    run = json.load(f)
  assert run["init_from"]["path"] == model
  assert run["num_params"] == model_lib.num_params_of(GPT2)
  launcher = launch(tmp_path / "run", prepared, max_restarts=1, init_from=model)
  ckpts = lambda: multihost.host_dir(tmp_path / "run") / store.CHECKPOINTS  # noqa: E731
  deadline = time.monotonic() + 180
  while not (ckpts().is_dir() and any(d.isdigit() and int(d) >= 3 for d in os.listdir(ckpts()))):
    assert launcher.poll() is None and time.monotonic() < deadline, \
        launcher.communicate()[0][-4000:]
    time.sleep(0.05)
  time.sleep(random.uniform(0, 0.3))
  os.remove(os.path.join(model, "model.safetensors"))  # a resumed run reads only config.json
  os.kill(host_pid(launcher, 1), signal.SIGKILL)
  text = launcher.communicate(timeout=300)[0]
  assert launcher.returncode == 0, text[-4000:]
  assert "restart 1/1" in text and "resumed from checkpoint" in text, text[-4000:]
  assert f"config.model.init_from = {model}: its weights are not used" in text
  got, want = records(tmp_path / "run"), records(tmp_path / "ref")
  assert [r["round"] for r in got] == list(range(1, 9))
  for key in ("anchor_hash", "train_loss", "eval_loss", "train_bpb", "eval_bpb"):
    assert [r.get(key) for r in got] == [r.get(key) for r in want], key


@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("train", marks=pytest.mark.slow)])
def test_through_prepare(tmp_path, documents, tokenizer):
  """`python -m diloco_jax.prepare` on a JSONL of the tagged documents (small shards, so
  replicas take blocks of several): 2 hosts x 2 replicas on disjoint documents, none of
  them drawn for eval by prepare, eval batches from those; training lowers the eval loss."""
  with open(tmp_path / "corpus.jsonl", "w") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in documents[0] + documents[1])
  out = tmp_path / "prepared"
  options = [f"--tokenizer={tokenizer}", "--workers=0", "--shard_tokens=8000",
             "--eval_fraction=0.15", *(["--vocab_size=320"] if tokenizer == "train" else [])]
  proc = multihost.start([sys.executable, "-m", "diloco_jax.prepare",
                          f"--input={tmp_path / 'corpus.jsonl'}", f"--output={out}", *options])
  text = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, text[-3000:]
  manifest = json.loads((out / "manifest.json").read_text())
  assert len(manifest["splits"]["train"]["shards"]) > 2
  decode = None  # bytes
  if tokenizer == "train":
    import tokenizers  # prepare's dependency, needed here only
    decoder = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    def decode(w):
      return decoder.decode([int(t) for t in w]).encode()
  c = data_config(str(out), vocab_size=manifest["vocab_size"])
  hosts = [host_data(c, host_index=h, num_hosts=2) for h in range(2)]
  seen = [tags(w, decode) for w in draw(hosts, 100)]
  eval_split = np.concatenate([np.fromfile(out / s["file"], manifest["dtype"])
                               for s in manifest["splits"]["eval"]["shards"]])
  held_out = tags([eval_split], decode)  # prepare's draw: every eval document
  assert held_out and tags(hosts[0].eval_batches.reshape(-1, SEQ_LEN + 1), decode) <= held_out
  for a in range(4):
    assert seen[a] and not seen[a] & held_out
    for b in range(a + 1, 4):
      assert not seen[a] & seen[b]
  config = train_config(str(out), num_rounds=4, **{"inner.lr": 1e-2,
                                                   "data.vocab_size": manifest["vocab_size"]})
  result = trainer.train_and_evaluate(config, str(tmp_path / "work"))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals
  assert all(r["eval_bpb"] > 0 for r in result.records)


@pytest.mark.parametrize("fmt, tokenizer", [("parquet", "bytes"), ("save_to_disk", "bytes"),
                                             ("jsonl.gz", "tokenizer.json"),
                                             pytest.param("txt", "sentencepiece",
                                                          marks=pytest.mark.slow)])
def test_trains_on_every_input_format_and_tokenizer(tmp_path, fmt, tokenizer):
  """prepare, then train, for each kind of input and of tokenizer file: the eval loss falls
  (tests/test_prepare.py checks the corpora themselves, token by token)."""
  from tests import test_prepare as tp
  texts = tp.make_texts(400, seed=5)
  option = "--tokenizer=bytes"
  if tokenizer == "tokenizer.json":  # a BPE trained on other text, as a user's own file
    assert tp.run(f"--input={tp.write_jsonl(tmp_path / 'o.jsonl', tp.make_texts(200))}",
                  f"--output={tmp_path / 'bpe'}", "--tokenizer=train",
                  "--vocab_size=320") == 0
    option = f"--tokenizer={tmp_path / 'bpe' / 'tokenizer.json'}"
  elif tokenizer == "sentencepiece":
    import sentencepiece as spm
    lines = [line for t in tp.make_texts(200) for line in t.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), eos_id=2, minloglevel=2,
                                   model_prefix=str(tmp_path / "spm"), vocab_size=80)
    option = f"--tokenizer={tmp_path / 'spm.model'}"
  source = tp.WRITERS[fmt](tmp_path, texts)
  out = tmp_path / "prepared"
  assert tp.run(f"--input={source}", f"--output={out}", option, "--eval_fraction=0.1",
                "--workers=0") == 0
  vocab = json.loads((out / "manifest.json").read_text())["vocab_size"]
  config = train_config(str(out), num_rounds=4, **{"inner.lr": 1e-2, "data.vocab_size": vocab})
  result = trainer.train_and_evaluate(config, str(tmp_path / "work"))
  evals = [r["eval_loss"] for r in result.records]
  assert evals[-1] < evals[0] - 0.3, evals


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
