"""python -m diloco_jax.prepare: every input format and tokenizer kind on small generated
corpora, each output checked against an independent reading of the files it wrote; the
no-op re-run, a run killed before its manifest, and each bad input's one line."""

import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from diloco_jax import prepare
from diloco_jax.corpus import format as corpus_format
from diloco_jax.corpus import sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DOCS = 300
# Words with multi-byte characters, and the spellings of special tokens: a document that
# contains "<|endoftext|>" as text must not get an EOS id in its middle.
WORDS = ["the", "quick", "brown", "fox", "héllo", "世界", "naïve", "def", "return", "x = 1",
         "<|endoftext|>", "</s>", "\t", "🙂", "\n"]


def make_texts(n: int = N_DOCS, seed: int = 0) -> list[str]:
  """Distinct documents (each starts with its number) of 1 to 80 words."""
  rng = random.Random(seed)
  return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))
          for i in range(n)]


TEXTS = make_texts()


# -------------------------------------------------------------------------- input files

def write_txt(root, texts):
  """One file per document in two subdirectories (sorted order = document order), plus
  files that must be skipped: hidden, __pycache__, an unknown extension."""
  for i, text in enumerate(texts):
    sub = root / ("a" if i < len(texts) // 2 else "b")
    sub.mkdir(parents=True, exist_ok=True)
    (sub / f"{i:04d}.txt").write_bytes(text.encode())
  (root / ".hidden.txt").write_text("hidden")
  (root / "__pycache__").mkdir()
  (root / "__pycache__" / "x.txt").write_text("cache")
  (root / "notes.csv").write_text("a,b")
  return root


def write_jsonl(path, texts, field="text"):
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as f:
    for i, text in enumerate(texts):
      f.write(json.dumps({"id": i, field: text}) + "\n")
      if i % 50 == 0:
        f.write("\n")  # blank lines are not documents
  return path


def write_parquet(path, texts, field="text"):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path,
                 row_group_size=64)  # several row groups and batches
  return path


def write_saved(path, texts):
  import datasets
  datasets.disable_progress_bars()
  datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path), num_shards=2)
  return path


WRITERS = {"txt": lambda d, t: write_txt(d / "txt", t),
           "jsonl": lambda d, t: write_jsonl(d / "c.jsonl", t),
           "jsonl.gz": lambda d, t: write_jsonl(d / "c.jsonl.gz", t),
           "parquet": lambda d, t: write_parquet(d / "c.parquet", t),
           "save_to_disk": lambda d, t: write_saved(d / "saved", t)}


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
  """SentencePiece models trained on the test text: one with an EOS, one without."""
  import sentencepiece as spm
  d = tmp_path_factory.mktemp("spm")
  lines = [line for t in make_texts(200, seed=1) for line in t.splitlines() if line.strip()]
  for name, eos in [("with_eos", 2), ("no_eos", -1)]:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(d / name),
                                   vocab_size=80, eos_id=eos, minloglevel=2)
  return d / "with_eos.model", d / "no_eos.model"


# ------------------------------------------------------------------------------ reading

def run(*args) -> int:
  return prepare.main([str(a) for a in args])


def is_eval(seed: int, index: int, fraction: float) -> bool:
  """The draw the format spec states: blake2b-64 of f"{seed}:{index}" under the fraction."""
  digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


def read_split(out, manifest, split):
  """Every document of a split (EOS included), counted from the files themselves."""
  docs, entry = [], manifest["splits"][split]
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for shard in entry["shards"]:
    raw = (out / shard["file"]).read_bytes()
    assert shard["sha256"] == hashlib.sha256(raw).hexdigest()
    assert len(raw) == shard["tokens"] * itemsize
    tokens, offsets = corpus_format.load_shard(str(out), shard, manifest["dtype"])
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > 0)
    assert len(offsets) == shard["documents"] + 1
    docs += [np.array(tokens[offsets[d]:offsets[d + 1]]) for d in range(len(offsets) - 1)]
  assert entry["documents"] == len(docs)
  assert entry["tokens"] == sum(len(d) for d in docs)
  return docs


def check_corpus(out, texts, *, fraction=0.1, seed=0, shard_tokens=None, decode=None,
                 encode=None):
  """Checks the corpus at `out` holds exactly `texts`, each in its drawn split, ending in
  EOS and nowhere else; decode(ids) must give the text back, or encode(text) the ids."""
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["format"] == "diloco_jax.prepared/1"
  assert manifest["dtype"] == ("uint16" if manifest["vocab_size"] <= 65536 else "uint32")
  eos, drawn = manifest["eos_id"], [is_eval(seed, i, fraction) for i in range(len(texts))]
  for split, want in [("train", False), ("eval", True)]:
    docs = read_split(out, manifest, split)
    expected = [t for t, e in zip(texts, drawn) if e == want]
    assert len(docs) == len(expected)
    for doc, text in zip(docs, expected):
      assert doc[-1] == eos and eos not in doc[:-1]
      assert doc.max() < manifest["vocab_size"]
      if decode:
        assert decode(doc[:-1]) == text
      else:
        assert doc[:-1].tolist() == encode(text)
    entry = manifest["splits"][split]
    assert entry["bytes"] == sum(len(t.encode()) for t in expected)
    if shard_tokens:  # cut at the document that brings a shard to shard_tokens
      for shard in entry["shards"][:-1]:
        tokens, offsets = corpus_format.load_shard(str(out), shard, manifest["dtype"])
        assert len(tokens) >= shard_tokens > offsets[-2]
  assert 0 < sum(drawn) < len(texts)  # the draw gave both splits documents
  assert manifest["eval"] == {"fraction": fraction, "max_documents": None, "seed": seed}
  return manifest


def decode_bytes(ids):
  return bytes(ids.astype(np.uint8)).decode()


def bpe_decoder(out):
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  return lambda ids: tok.decode(ids.tolist(), skip_special_tokens=False)


# --------------------------------------------------------------------------- formats

@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize("kind", ["bytes", "train"])
def test_format_and_tokenizer(tmp_path, fmt, kind):
  source = WRITERS[fmt](tmp_path, TEXTS)
  out = tmp_path / "out"
  flags = ["--tokenizer=bytes"] if kind == "bytes" else ["--tokenizer=train",
                                                         "--vocab_size=512"]
  assert run(f"--input={source}", f"--output={out}", *flags, "--eval_fraction=0.1",
             "--shard_tokens=3000") == 0
  decode = decode_bytes if kind == "bytes" else bpe_decoder(out)
  manifest = check_corpus(out, TEXTS, shard_tokens=3000, decode=decode)
  assert len(manifest["splits"]["train"]["shards"]) > 1
  if kind == "bytes":
    assert (manifest["vocab_size"], manifest["eos_id"]) == (257, 256)
    assert manifest["tokenizer"] == {"kind": "bytes", "file": None}
  else:
    assert manifest["tokenizer"] == {"kind": "bpe", "file": "tokenizer.json"}
    assert 257 < manifest["vocab_size"] <= 512 and manifest["eos_id"] == 0
  assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(source), "out"])


def test_tokenizer_json(tmp_path):
  """A tokenizer.json written by a trained tokenizer: the ids are its own encoding's."""
  import tokenizers
  trained = tmp_path / "trained"
  assert run(f"--input={write_jsonl(tmp_path / 'c.jsonl', TEXTS)}", f"--output={trained}",
             "--tokenizer=train", "--vocab_size=400", "--eval_fraction=0.1") == 0
  texts = make_texts(200, seed=3)
  path = tmp_path / "tok" / "tokenizer.json"
  path.parent.mkdir()
  path.write_bytes((trained / "tokenizer.json").read_bytes())
  out = tmp_path / "out"
  assert run(f"--input={write_parquet(tmp_path / 'd.parquet', texts)}", f"--output={out}",
             f"--tokenizer={path}", "--eval_fraction=0.1") == 0
  tok = tokenizers.Tokenizer.from_file(str(path))
  tok.encode_special_tokens = True
  manifest = check_corpus(out, texts, encode=lambda t: tok.encode(t).ids)
  assert manifest["tokenizer"] == {"kind": "tokenizer.json", "file": "tokenizer.json"}
  assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
  assert manifest["eos_id"] == tok.token_to_id("<|endoftext|>")


def test_sentencepiece(tmp_path, spm_models):
  import sentencepiece as spm
  model = spm_models[0]
  out = tmp_path / "out"
  assert run(f"--input={write_txt(tmp_path / 'txt', TEXTS)}", f"--output={out}",
             f"--tokenizer={model}", "--eval_fraction=0.1", "--workers=2") == 0
  processor = spm.SentencePieceProcessor(model_file=str(model))
  manifest = check_corpus(out, TEXTS, encode=processor.encode)
  assert manifest["tokenizer"] == {"kind": "sentencepiece", "file": "tokenizer.model"}
  assert (manifest["vocab_size"], manifest["eos_id"]) == (80, processor.eos_id())
  assert (out / "tokenizer.model").read_bytes() == model.read_bytes()


def test_eval_cap_and_workers_do_not_change_the_corpus(tmp_path):
  """--eval_max_documents caps the draw (the first drawn documents stay eval); the output
  is the same for any number of workers, in this process or not."""
  source = write_jsonl(tmp_path / "c.jsonl", TEXTS)
  outs = []
  for workers in [0, 1, 3]:
    outs.append(tmp_path / f"out{workers}")
    assert run(f"--input={source}", f"--output={outs[-1]}", "--tokenizer=train",
               "--vocab_size=512", "--eval_fraction=0.2", "--eval_max_documents=7",
               "--shard_tokens=2000", f"--workers={workers}") == 0
  files = sorted(os.listdir(outs[0]))
  for out in outs[1:]:
    assert sorted(os.listdir(out)) == files
    for name in files:
      if name != "manifest.json":
        assert (out / name).read_bytes() == (outs[0] / name).read_bytes(), name
  manifest = json.loads((outs[0] / "manifest.json").read_text())
  drawn = [i for i in range(N_DOCS) if is_eval(0, i, 0.2)][:7]
  eval_docs = read_split(outs[0], manifest, "eval")
  decode = bpe_decoder(outs[0])
  assert [decode(d[:-1]) for d in eval_docs] == [TEXTS[i] for i in drawn]
  assert manifest["eval"]["max_documents"] == 7


def test_saved_dataset_dict_and_directory_walk(tmp_path):
  """A DatasetDict's splits in its own order; hidden files, __pycache__ and unknown
  extensions skipped; a saved dataset met in a directory walk is read as one source."""
  import datasets
  datasets.disable_progress_bars()
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:5]}),
                        "test": datasets.Dataset.from_dict({"text": TEXTS[5:8]})}
                       ).save_to_disk(str(tmp_path / "root" / "dd"))
  write_txt(tmp_path / "root" / "t", TEXTS[8:12])
  found, skipped = sources.find_sources([str(tmp_path / "root")], sources.TEXT_EXTENSIONS)
  assert [os.path.relpath(p, tmp_path / "root") for p in skipped] == [
      "t/__pycache__", "t/.hidden.txt", "t/notes.csv"]  # (relpath drops the dir's "/")
  assert [(os.path.relpath(s.path, tmp_path / "root"), s.kind) for s in found] == [
      ("dd/train", "arrow"), ("dd/test", "arrow"), ("t/a/0000.txt", "text"),
      ("t/a/0001.txt", "text"), ("t/b/0002.txt", "text"), ("t/b/0003.txt", "text")]
  reader = sources.Reader("text")
  assert [d for s in found for d in reader.documents(s)] == TEXTS[:12]
  found, skipped = sources.find_sources([str(tmp_path / "root")], sources.TEXT_EXTENSIONS,
                                        exclude=["dd", "*/t/a/0001.txt", "b"])
  assert [os.path.relpath(s.path, tmp_path / "root") for s in found] == ["t/a/0000.txt"]
  assert [os.path.relpath(p, tmp_path / "root") for p in skipped] == [
      "dd", "t/__pycache__", "t/b", "t/.hidden.txt", "t/notes.csv", "t/a/0001.txt"]


# ---------------------------------------------------------------- re-runs and crashes

def test_rerun_is_a_no_op_until_something_changes(tmp_path, capsys):
  source = write_jsonl(tmp_path / "c.jsonl", TEXTS)
  out = tmp_path / "out"
  args = [f"--input={source}", f"--output={out}", "--tokenizer=bytes", "--eval_fraction=0.1"]
  assert run(*args) == 0
  manifest = (out / "manifest.json").read_bytes()
  stamps = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)}
  capsys.readouterr()
  assert run(*args, "--workers=1") == 0  # --workers does not change the corpus
  assert capsys.readouterr().out == f"prepare: {out} is up to date\n"
  assert {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)} == stamps
  assert run(*args, "--seed=1") == 0  # another option: a new corpus
  check_corpus(out, TEXTS, seed=1, decode=decode_bytes)
  capsys.readouterr()
  assert run(*args) == 0  # back to seed 0: made again, the same as the first time
  assert "up to date" not in capsys.readouterr().out
  strip = lambda m: {k: v for k, v in json.loads(m).items() if k != "created"}
  assert strip((out / "manifest.json").read_bytes()) == strip(manifest)
  write_jsonl(source, TEXTS + ["doc 300: one more"])  # another input: a new corpus
  capsys.readouterr()
  assert run(*args) == 0
  assert "up to date" not in capsys.readouterr().out
  check_corpus(out, TEXTS + ["doc 300: one more"], decode=decode_bytes)


KILLED_AFTER_FIRST_SHARD = """
import os, signal, sys
from diloco_jax import prepare
from diloco_jax.corpus import format as corpus_format
close = corpus_format.SplitWriter._close
def close_and_die(self):
  close(self)
  os.kill(os.getpid(), signal.SIGKILL)
corpus_format.SplitWriter._close = close_and_die
sys.exit(prepare.main(sys.argv[1:]))
"""


def test_run_killed_before_its_manifest(tmp_path):
  """A run SIGKILLed after writing a shard leaves no corpus at --output (and the previous
  corpus intact when there was one); the next run clears the partial one and writes the
  same bytes as an uninterrupted run."""
  source = write_jsonl(tmp_path / "c.jsonl", TEXTS)
  ref, out = tmp_path / "ref", tmp_path / "out"
  args = [f"--input={source}", "--tokenizer=train", "--vocab_size=512",
          "--eval_fraction=0.1", "--shard_tokens=2000"]
  assert run(*args, f"--output={ref}") == 0

  def killed(*extra):
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FIRST_SHARD, *args, *extra,
                           f"--output={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = tmp_path / ".out.partial"
    assert (partial / "train-00000.bin").exists() and not (partial / "manifest.json").exists()

  killed()
  assert not out.exists()
  assert run(*args, f"--output={out}") == 0
  assert not (tmp_path / ".out.partial").exists()
  for name in os.listdir(ref):
    if name != "manifest.json":
      assert (out / name).read_bytes() == (ref / name).read_bytes(), name
  strip = lambda m: {k: v for k, v in json.loads(m.read_text()).items() if k != "created"}
  assert strip(out / "manifest.json") == strip(ref / "manifest.json")

  before = (out / "manifest.json").read_bytes()
  killed("--seed=5")  # replacing a complete corpus: it stays until the new one is done
  assert (out / "manifest.json").read_bytes() == before
  check_corpus(out, TEXTS, decode=bpe_decoder(out))
  assert run(*args, "--seed=5", f"--output={out}") == 0
  check_corpus(out, TEXTS, seed=5, decode=bpe_decoder(out))


def test_progress_and_summary_lines(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "diloco_jax.prepare", f"--input={write_txt(tmp_path / 't', TEXTS)}",
       f"--output={tmp_path / 'out'}", "--tokenizer=bytes"], cwd=REPO, capture_output=True,
      text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "prepare: tokenizing: 300 documents" in proc.stderr and "tokens/s" in proc.stderr
  summary = proc.stdout.splitlines()
  assert summary[0].startswith(f"prepare: wrote {tmp_path / 'out'}: ")
  assert "MB/s" in summary[1] and "tokens/s" in summary[1]


# ---------------------------------------------------------------------------- bad input

def error_line(*args) -> str:
  """Runs the command, checks it failed with exit 1 and one line on stderr, returns it."""
  proc = subprocess.run([sys.executable, "-m", "diloco_jax.prepare", *map(str, args)],
                        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 1, output
  assert "Traceback" not in output and len(proc.stderr.splitlines()) == 1, output
  return proc.stderr.strip()


def test_missing_text_field(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text('{"text": "a"}\n\n{"body": "b", "id": 2}\n')
  assert error_line(f"--input={path}", f"--output={tmp_path / 'o'}", "--tokenizer=bytes") == (
      f"prepare: {path}, line 3: no field 'text' (it has: body, id); choose one with "
      "--text_field")
  assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()
  parquet = write_parquet(tmp_path / "c.parquet", ["a", "b"], field="body")
  assert error_line(f"--input={parquet}", f"--output={tmp_path / 'o'}",
                    "--tokenizer=bytes") == (
      f"prepare: {parquet}: no column 'text' (it has: id, body); choose one with --text_field")
  nulls = write_parquet(tmp_path / "n.parquet", ["a"] * 100 + [None])
  assert error_line(f"--input={nulls}", f"--output={tmp_path / 'o'}", "--tokenizer=train",
                    "--vocab_size=300") == (
      f"prepare: {nulls}, row 100 (from 0): field 'text' is null, not a string")
  path.write_text('{"text": "a"}\n{"text": 3}\n')
  assert error_line(f"--input={path}", f"--output={tmp_path / 'o'}", "--tokenizer=bytes") == (
      f"prepare: {path}, line 2: field 'text' is 3, not a string")
  path.write_text('{"text": "a"}\n{"text" "b"}\n')
  assert error_line(f"--input={path}", f"--output={tmp_path / 'o'}", "--tokenizer=bytes") == (
      f"prepare: {path}, line 2: not JSON (Expecting ':' delimiter: line 1 column 9 (char 8))")


def test_empty_corpus(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text('{"text": ""}\n{"text": ""}\n')
  assert error_line(f"--input={path}", f"--output={tmp_path / 'o'}", "--tokenizer=bytes") == (
      f"prepare: empty corpus: no document with text in {path} (only 2 empty documents)")
  (tmp_path / "d").mkdir()
  (tmp_path / "d" / "a.txt").write_text("")
  assert error_line(f"--input={tmp_path / 'd'}", f"--output={tmp_path / 'o'}",
                    "--tokenizer=train", "--vocab_size=300") == (
      f"prepare: empty corpus: no document with text in {tmp_path / 'd' / 'a.txt'} "
      "(only 1 empty document)")
  assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_bad_tokenizers(tmp_path, spm_models):
  corpus = write_jsonl(tmp_path / "c.jsonl", TEXTS[:10])
  common = [f"--input={corpus}", f"--output={tmp_path / 'o'}"]
  missing = tmp_path / "nope" / "tokenizer.json"
  assert error_line(*common, f"--tokenizer={missing}") == (
      f"prepare: --tokenizer={missing}: no such file")
  broken = tmp_path / "broken.json"
  broken.write_text('{"version": "1.0", "model": 3}')
  assert error_line(*common, f"--tokenizer={broken}").startswith(
      f"prepare: --tokenizer={broken}: not a HF tokenizers file (")
  broken_model = tmp_path / "broken.model"
  broken_model.write_text("not a model")
  assert error_line(*common, f"--tokenizer={broken_model}") == (
      f"prepare: --tokenizer={broken_model}: not a SentencePiece model (INTERNAL: could not "
      f"parse ModelProto from {broken_model})")
  assert error_line(*common, f"--tokenizer={spm_models[1]}") == (
      f"prepare: {spm_models[1]}: this SentencePiece model has no EOS (eos_id = -1); train it "
      "with an eos_id, or name a piece with --eos_token")
  assert error_line(*common, "--tokenizer=wordpiece") == (
      "prepare: --tokenizer=wordpiece: unknown; use bytes, train (with --vocab_size), a "
      "tokenizer.json path or a SentencePiece .model path")
  assert error_line(*common, "--tokenizer=train") == (
      "prepare: --tokenizer=train needs --vocab_size (>= 257: the 256 bytes and EOS)")
  assert error_line(*common, "--tokenizer=train", "--vocab_size=100") == (
      "prepare: --vocab_size=100: too small for --tokenizer=train, which needs >= 257 (the "
      "256 bytes and EOS)")
  assert error_line(*common, "--tokenizer=bytes", "--vocab_size=1000") == (
      "prepare: --vocab_size is for --tokenizer=train only (--tokenizer=bytes has its own "
      "vocabulary)")
  assert error_line(*common, "--tokenizer=train", "--vocab_size=lots") == (
      "prepare: argument --vocab_size: invalid int value: 'lots'")


def test_tokenizer_json_eos(tmp_path):
  """A tokenizer.json without a known EOS is refused unless --eos_token names one."""
  import tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1, "[END]": 2},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  corpus = write_jsonl(tmp_path / "c.jsonl", ["a a", "a b"] * 50)
  common = [f"--input={corpus}", f"--output={tmp_path / 'o'}", f"--tokenizer={path}"]
  assert error_line(*common) == (
      f"prepare: {path}: no end-of-document token found (tried tokenizer_config.json's "
      "eos_token and <|endoftext|>, </s>, <eos>, <|end_of_text|>, <|eot_id|>, [EOS]); name one "
      "with --eos_token")
  assert error_line(*common, "--eos_token=[STOP]") == (
      f"prepare: --eos_token='[STOP]' is not in the vocabulary of {path}")
  assert run(*common, "--eos_token=[END]", "--eval_fraction=0.1") == 0
  manifest = check_corpus(tmp_path / "o", ["a a", "a b"] * 50,
                          encode=lambda t: tok.encode(t).ids)
  assert manifest["eos_id"] == 2 and manifest["vocab_size"] == 3


def test_bad_inputs_and_outputs(tmp_path):
  corpus = write_jsonl(tmp_path / "c.jsonl", TEXTS[:10])
  bytes_ = "--tokenizer=bytes"
  assert error_line(f"--input={tmp_path}/*.parquet", f"--output={tmp_path / 'o'}",
                    bytes_) == f"prepare: --input={tmp_path}/*.parquet matches no file"
  assert error_line(f"--input={tmp_path / 'nope'}", f"--output={tmp_path / 'o'}",
                    bytes_) == f"prepare: --input={tmp_path / 'nope'}: no such file or directory"
  junk = tmp_path / "junk"
  (junk / ".git").mkdir(parents=True)
  (junk / "data.csv").write_text("a,b")
  assert error_line(f"--input={junk}", f"--output={tmp_path / 'o'}", bytes_) == (
      f"prepare: --input={junk}: no file of a known format (.jsonl, .jsonl.gz, .parquet, a "
      "datasets.save_to_disk directory, or text: " + " ".join(sources.TEXT_EXTENSIONS)
      + f"; --text_extensions changes the last); skipped: {junk}/.git/, {junk}/data.csv")
  taken = tmp_path / "taken"
  taken.mkdir()
  (taken / "notes.txt").write_text("mine")
  assert error_line(f"--input={corpus}", f"--output={taken}", bytes_) == (
      f"prepare: --output={taken} exists and is not a prepared corpus (a directory holding "
      "notes.txt and no diloco_jax.prepared/1 manifest.json); choose another --output, or "
      "add --overwrite to replace it (deleting what it holds)")
  assert (taken / "notes.txt").read_text() == "mine"
  assert run(f"--input={corpus}", f"--output={taken}", bytes_, "--overwrite",
             "--eval_fraction=0.3") == 0
  assert not (taken / "notes.txt").exists()
  check_corpus(taken, TEXTS[:10], fraction=0.3, decode=decode_bytes)
  assert error_line(f"--input={corpus}", bytes_) == (
      "prepare: the following arguments are required: --output")
  assert error_line(f"--input={corpus}", f"--output={tmp_path / 'o'}", bytes_,
                    "--eval_fraction=1") == "prepare: --eval_fraction=1.0: must be >= 0 and < 1"


def test_missing_extra(tmp_path):
  """Without the `prepare` extra installed: one line saying how to install it."""
  script = ("import sys; sys.modules['tokenizers'] = None; from diloco_jax import prepare; "
            "sys.exit(prepare.main(sys.argv[1:]))")
  proc = subprocess.run([sys.executable, "-c", script, "--input=README.md",
                         f"--output={tmp_path / 'o'}", "--tokenizer=train", "--vocab_size=300"],
                        cwd=REPO,
                        capture_output=True, text=True, timeout=120, check=False)
  assert (proc.returncode, proc.stderr) == (1, ("prepare: tokenizers is not installed; run "
                                                "pip install -e '.[prepare]' (in the "
                                                "diloco_jax checkout)\n"))
