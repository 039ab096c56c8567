"""python -m diloco_jax.prepare on bad input: each a one-line error and exit 1, nothing
left at --output (missing fields, an empty corpus, bad tokenizers, bad inputs and outputs,
the `prepare` extra not installed). Good input: tests/test_prepare.py."""

import subprocess
import sys

from diloco_jax.corpus import sources
from tests.corpora import REPO
from tests.corpora import TEXTS
from tests.corpora import check_corpus
from tests.corpora import decode_bytes
from tests.corpora import run
from tests.corpora import write_jsonl
from tests.corpora import write_parquet


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
