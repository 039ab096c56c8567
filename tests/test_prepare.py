"""python -m diloco_jax.prepare: every input format and tokenizer kind on small generated
corpora, each output checked against an independent reading of the files it wrote
(tests/corpora.py); the no-op re-run and a run killed before its manifest. Each bad
input's one line: tests/test_prepare_errors.py."""

import json
import os
import signal
import subprocess
import sys

import pytest

from diloco_jax.corpus import sources
from tests.corpora import N_DOCS
from tests.corpora import REPO
from tests.corpora import TEXTS
from tests.corpora import WRITERS
from tests.corpora import bpe_decoder
from tests.corpora import check_corpus
from tests.corpora import decode_bytes
from tests.corpora import is_eval
from tests.corpora import make_texts
from tests.corpora import read_split
from tests.corpora import run
from tests.corpora import write_jsonl
from tests.corpora import write_parquet
from tests.corpora import write_txt


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
