"""Sampling: the KV cache gives the tokens a full recompute gives, seeded draws repeat, the
CLI continues a prompt with the run's tokenizer (bytes text, a prepared corpus), and bad
inputs stop with one line."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from diloco_jax.corpus import tokenizer as tokenizer_lib
from diloco_jax.loop import trainer
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from diloco_jax.readback import sampling
from diloco_jax.readback import trained
from tests.multihost import small_config
from tests.prepared_dirs import corpus_documents
from tests.prepared_dirs import write_prepared

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=32, seq_len=32, num_layers=2, d_model=32, num_heads=4, mlp_dim=64)
PROMPT = [1, 2, 3, 4, 5]
TEXT = "the quick brown fox jumps over the lazy dog. " * 120


def run_sample(*args, text=True):
  return subprocess.run([sys.executable, "-m", "diloco_jax.sample", *map(str, args)],
                        cwd=REPO, capture_output=True, text=text, timeout=120)


def error_line(*args) -> str:
  proc = run_sample(*args)
  assert proc.returncode == 1, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  return lines[0]


def train_tiny(workdir, **data) -> str:
  config = small_config(num_rounds=2, inner_steps=4, **{"model.seq_len": 32},
                        **{f"data.{k}": v for k, v in data.items()})
  trainer.train_and_evaluate(config, str(workdir))
  return str(workdir)


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "fox.txt"
  path.write_text(TEXT)
  return train_tiny(tmp_path_factory.mktemp("bytes_run"), source="text", path=str(path),
                    vocab_size=256)


@pytest.mark.parametrize("family,kv_heads,module", [("gpt", 0, ""), ("llama", 2, ""),
                                                    ("gpt", 0, "diloco_jax.models.gpt:GPT")])
def test_cache_equals_recompute(family, kv_heads, module):
  """Greedy decoding with the KV cache = recomputing the window every step, token for
  token (a module of your own, here the gpt family by name, always recomputes)."""
  cfg = family_lib.ModelConfig(**TINY, family=family, num_kv_heads=kv_heads)
  params = model_lib.init_params(cfg, jax.random.key(0))
  cached = sampling.generate(cfg, params, PROMPT, max_new_tokens=20, temperature=0)
  recomputed = sampling.generate(family_lib.ModelConfig(**TINY, family=family,
                                                     num_kv_heads=kv_heads, module=module),
                               params, PROMPT, max_new_tokens=20, temperature=0,
                               use_cache=False)
  assert cached.shape == (1, 20)
  np.testing.assert_array_equal(cached, recomputed)
  assert len(set(cached[0].tolist())) > 1  # not a degenerate constant


def test_seeded_sampling_repeats():
  cfg = family_lib.ModelConfig(**TINY, family="llama", num_kv_heads=2)
  params = model_lib.init_params(cfg, jax.random.key(0))
  draw = lambda seed: sampling.generate(cfg, params, PROMPT, max_new_tokens=20,
                                      temperature=1.0, top_k=5, seed=seed, num_samples=3)
  a, b, c = draw(7), draw(7), draw(8)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert not np.array_equal(a[0], a[1])  # each sample its own draw


def test_top_k_and_greedy():
  logits_BxV = jax.random.normal(jax.random.key(0), (256, 32))
  top5_Bx5 = np.argsort(np.asarray(logits_BxV), axis=-1)[:, -5:]
  drawn_B = np.asarray(sampling._pick(logits_BxV, jax.random.key(1), 5.0, 5))
  assert all(t in row for t, row in zip(drawn_B, top5_Bx5))
  assert len(set(drawn_B.tolist())) > 5  # the rows draw different tokens
  greedy_B = sampling._pick(logits_BxV, jax.random.key(1), 0.0, 5)
  np.testing.assert_array_equal(greedy_B, top5_Bx5[:, -1])


def test_cli_bytes_run(bytes_run):
  proc = run_sample(f"--workdir={bytes_run}", "--prompt=the quick", "--max_new_tokens=10",
                    "--temperature=0", text=False)  # bytes: no newline translation
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(b"the quick") and proc.stdout.endswith(b"\n"), proc.stdout
  new = proc.stdout[len(b"the quick"):-1].decode("utf-8")
  # 10 bytes, an invalid sequence of 1 to 3 of them shown as one U+FFFD
  valid, replaced = len(new.replace("\ufffd", "").encode()), new.count("\ufffd")
  assert valid + replaced <= 10 <= valid + 3 * replaced, new
  print(repr(proc.stdout.decode()))


def test_cli_errors(bytes_run, tmp_path):
  line = error_line(f"--workdir={bytes_run}", "--prompt=" + "x" * 30, "--max_new_tokens=5")
  assert "30 tokens" in line and "--max_new_tokens=5" in line and "seq_len = 32" in line
  assert "--max_new_tokens=2 or less" in line, line
  line = error_line(f"--workdir={bytes_run}", "--prompt=")
  assert "--prompt is empty" in line, line
  line = error_line(f"--workdir={tmp_path}")
  assert "no checkpoints/ directory" in line, line
  assert run_sample("--help").returncode == 0


@pytest.mark.slow
def test_cli_prepared_run(tmp_path):
  corpus = write_prepared(tmp_path / "corpus", *corpus_documents())
  workdir = train_tiny(tmp_path / "run", source="prepared", path=corpus, vocab_size=257)
  proc = run_sample(f"--workdir={workdir}", "--prompt=<t0001.", "--max_new_tokens=8",
                    "--temperature=0", "--num_samples=2")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert len(lines) == 4 and "sample 1 of 2" in lines[0] and "sample 2 of 2" in lines[2]
  assert lines[1].startswith("<t0001.") and lines[1] == lines[3]  # greedy: the same twice
  config = trained.load(workdir).config
  assert sampling.prompt_ids(sampling.codec_of(config), "") == [256]  # EOS starts a document
  os.rename(corpus, corpus + ".moved")
  with pytest.raises(sampling.SampleError, match=f"{corpus}/manifest.json is missing"):
    sampling.codec_of(config)


def test_prepared_bpe_codec(tmp_path):
  """A trained BPE: the prompt encodes as `prepare` encodes, the continuation stops at EOS
  and is decoded with the prompt; a lost tokenizer file is named."""
  spec = tokenizer_lib.train_bpe([TEXT, "naïve déjà vu"] * 4, 300, str(tmp_path / "t.json"))
  os.makedirs(tmp_path / "corpus")
  os.rename(spec.path, tmp_path / "corpus" / "tokenizer.json")
  (tmp_path / "corpus" / "manifest.json").write_text(
      f'{{"vocab_size": {spec.vocab_size}, "eos_id": {spec.eos_id}, '
      '"tokenizer": {"kind": "bpe", "file": "tokenizer.json"}}')
  codec = sampling._prepared_codec(str(tmp_path / "corpus"), spec.vocab_size)
  ids = sampling.prompt_ids(codec, "the quick")
  assert codec.decode(ids) == "the quick"
  rest = codec.encode(" brown fox naïve")
  assert sampling.continuation(codec, ids, rest + [spec.eos_id] + rest) == " brown fox naïve"
  assert sampling.prompt_ids(codec, "") == [spec.eos_id]
  (tmp_path / "corpus" / "tokenizer.json").write_text("{")
  with pytest.raises(sampling.SampleError, match="tokenizer.json cannot be read"):
    sampling._prepared_codec(str(tmp_path / "corpus"), spec.vocab_size)
  os.remove(tmp_path / "corpus" / "tokenizer.json")
  with pytest.raises(sampling.SampleError, match="tokenizer.json .* is missing"):
    sampling._prepared_codec(str(tmp_path / "corpus"), spec.vocab_size)


def test_prepared_sentencepiece_codec(tmp_path):
  import sentencepiece as spm
  lines = [f"the {w} fox jumps over the lazy {w}" for w in TEXT.split()] * 3
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(
      tmp_path / "tokenizer"), vocab_size=36, eos_id=2, minloglevel=2)
  (tmp_path / "manifest.json").write_text(
      '{"vocab_size": 36, "eos_id": 2, "tokenizer": {"kind": "sentencepiece", '
      '"file": "tokenizer.model"}}')
  codec = sampling._prepared_codec(str(tmp_path), 36)
  ids = sampling.prompt_ids(codec, "the quick")
  rest = np.array(codec.encode("the lazy dog") + [2, 5], np.int32)  # as generate returns
  assert sampling.continuation(codec, ids, rest) == " the lazy dog"


def test_ids_prompt_checked():
  codec = sampling.codec_of(small_config().lock())
  assert sampling.prompt_ids(codec, " 3 4  5") == [3, 4, 5]
  with pytest.raises(sampling.SampleError, match="--prompt is empty"):
    sampling.prompt_ids(codec, "")
  with pytest.raises(sampling.SampleError, match="token ids"):
    sampling.prompt_ids(codec, "hello")
  cfg = family_lib.ModelConfig(**TINY)
  with pytest.raises(sampling.SampleError, match="token 40 is not in the model's vocabulary"):
    sampling.generate(cfg, {}, [1, 40], max_new_tokens=3)
  with pytest.raises(sampling.SampleError, match="--max_new_tokens=30 or less"):
    sampling.generate(cfg, {}, [1, 2], max_new_tokens=31)
