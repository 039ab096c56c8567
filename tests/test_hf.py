"""Hugging Face `transformers` as the client, both ways: a random LlamaForCausalLM (sharded)
and GPT2LMHeadModel saved by `save_pretrained` import with their logits, export back bit
for bit and load in `AutoModelForCausalLM` / `AutoTokenizer`; a run continued from the
GPT-2 on a corpus prepared with its tokenizer exports a model whose greedy `generate` is
`diloco_jax.sample --temperature=0`; bad model directories get one line each."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
import safetensors.numpy

from diloco_jax import config as config_lib
from diloco_jax import export as export_lib
from diloco_jax.corpus import tokenizer as tokenizer_lib
from diloco_jax.readback import sampling
from diloco_jax.readback import trained as trained_lib
from diloco_jax.loop import trainer
from diloco_jax.models import exported
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from diloco_jax.models import pretrained
from tests.multihost import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # max |logit difference|, float32 torch vs float32 XLA
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven")


def _texts(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(8, 40))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """A BPE tokenizer (EOS <|endoftext|>) and two random models over its vocabulary plus 4
  unused rows (as real models pad theirs), every weight perturbed so that no norm is 1
  and no bias 0: the llama untied, grouped-query, in 3+ shards; the GPT-2 tied."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("hf")
  spec = tokenizer_lib.train_bpe(_texts(300), 300, str(root / "tokenizer.json"))
  vocab = spec.vocab_size + 4
  torch.manual_seed(0)
  models = {
      "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
          vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
          rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
          bos_token_id=spec.eos_id, eos_token_id=spec.eos_id)),
      "gpt": transformers.GPT2LMHeadModel(transformers.GPT2Config(
          vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
          bos_token_id=spec.eos_id, eos_token_id=spec.eos_id))}
  dirs = {}
  for name, model in models.items():
    with torch.no_grad():
      for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    dirs[name] = str(root / name)
    model.save_pretrained(dirs[name], max_shard_size="60KB" if name == "llama" else "5GB")
    shutil.copy(root / "tokenizer.json", dirs[name])
    with open(os.path.join(dirs[name], "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                 "eos_token": tokenizer_lib.TRAINED_EOS}, f)
  return types.SimpleNamespace(dirs=dirs, eos=spec.eos_id, vocab=vocab,
                               corpus_vocab=spec.vocab_size, torch=torch,
                               transformers=transformers)


def _model(directory: str, corpus_vocab: int) -> family_lib.ModelConfig:
  config = config_lib.get_default_config()
  config.model.init_from, config.model.seq_len = directory, 16
  config.data.vocab_size = corpus_vocab
  config = pretrained.resolved(config, announce=False)
  return family_lib.ModelConfig.from_config(config.model, config.data.vocab_size)


def _hf_logits(hf, directory: str, tokens: np.ndarray) -> np.ndarray:
  model = hf.transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  with hf.torch.no_grad():
    return model(hf.torch.tensor(tokens)).logits.numpy()


def _ours(cfg, params, tokens) -> np.ndarray:
  return np.asarray(family_lib.build(cfg).apply({"params": params}, tokens))


def _saved(directory: str, cfg) -> dict[str, np.ndarray]:
  """The tensors `save_pretrained` wrote, under our names (buffers, a tied head dropped)."""
  tensors = exported.read_tensors(os.path.join(directory, "model.safetensors"))
  return pretrained._named(tensors, cfg, directory)  # pylint: disable=protected-access


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_import_and_export_agree_with_transformers(hf, name, tmp_path):
  directory = hf.dirs[name]
  cfg = _model(directory, hf.corpus_vocab)
  assert (cfg.family, cfg.vocab_size, cfg.tie_embeddings) == (name, hf.vocab, name == "gpt")
  if name == "llama":
    assert (cfg.kv_heads, cfg.rope_base, cfg.norm_eps) == (2, 500.0, 1e-6)
    assert len(pretrained.weight_files(directory)) > 3  # the index and 3+ shards
  params = pretrained.params(directory, cfg)
  tokens = np.random.default_rng(0).integers(0, hf.vocab, (2, 16))
  ours = _ours(cfg, params, tokens)
  diff = float(np.abs(ours - _hf_logits(hf, directory, tokens)).max())
  print(f"{name}: imported, max |transformers - diloco_jax| = {diff:.2e}")
  assert diff <= TOL

  output = str(tmp_path / "model.safetensors")
  exported.write(output, cfg, params, tokenizer=os.path.join(directory, "tokenizer.json"),
                 eos_id=hf.eos)
  saved, written = _saved(directory, cfg), safetensors.numpy.load_file(output)
  assert written.keys() == saved.keys()
  for key, x in saved.items():  # bit for bit
    assert written[key].dtype == x.dtype and np.array_equal(written[key], x), key
  diff = float(np.abs(ours - _hf_logits(hf, str(tmp_path), tokens)).max())
  print(f"{name}: exported, max |transformers - diloco_jax| = {diff:.2e}")
  assert diff <= TOL
  tok = hf.transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = _texts(1, seed=5)[0]
  assert tok.encode(text) == tokenizer_lib.Encoder(tokenizer_lib.load(
      os.path.join(directory, "tokenizer.json"), None)).encode([text])[0].tolist()
  assert tok.eos_token_id == hf.eos == tok.bos_token_id


def _prepare(hf, tmp_path) -> str:
  with open(tmp_path / "corpus.jsonl", "w") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in _texts(400, seed=1))
  out = str(tmp_path / "corpus")
  result = subprocess.run(
      [sys.executable, "-m", "diloco_jax.prepare", f"--input={tmp_path / 'corpus.jsonl'}",
       f"--output={out}", f"--tokenizer={hf.dirs['gpt']}", "--workers=0",
       "--eval_fraction=0.1"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  return out


def _run(hf, corpus: str, workdir: str, rounds: int) -> None:
  config = small_config(num_rounds=rounds, inner_steps=4, eval_batches=1, **{
      "data.source": "prepared", "data.path": corpus, "model.init_from": hf.dirs["gpt"],
      "inner.warmup_steps": 1, "inner.lr": 3e-4, "model.seq_len": 32})
  trainer.train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_continued_pretraining_generates_as_sample(hf, tmp_path):
  """prepare --tokenizer=DIR, train from DIR: 0 rounds exports DIR's tensors bit for bit;
  3 rounds export a model that `generate` decodes greedily into `sample`'s tokens."""
  corpus = _prepare(hf, tmp_path)
  with open(os.path.join(corpus, "manifest.json")) as f:
    assert json.load(f)["vocab_size"] == hf.corpus_vocab
  _run(hf, corpus, str(tmp_path / "zero"), rounds=0)
  export_lib.export(str(tmp_path / "zero"), str(tmp_path / "zero_out" / "model.safetensors"))
  cfg = trained_lib.load(str(tmp_path / "zero")).model
  saved = _saved(hf.dirs["gpt"], cfg)
  written = safetensors.numpy.load_file(tmp_path / "zero_out" / "model.safetensors")
  assert written.keys() == saved.keys()
  assert all(np.array_equal(written[k], x) for k, x in saved.items())

  workdir, out = str(tmp_path / "run"), str(tmp_path / "out")
  _run(hf, corpus, workdir, rounds=3)
  with open(os.path.join(workdir, "run.json")) as f:
    source = json.load(f)["init_from"]
  with open(os.path.join(hf.dirs["gpt"], "model.safetensors"), "rb") as f:
    assert source["sha256"]["model.safetensors"] == hashlib.sha256(f.read()).hexdigest()
  assert source["path"] == os.path.abspath(hf.dirs["gpt"])
  paths = export_lib.export(workdir, os.path.join(out, "model.safetensors"))
  assert {os.path.basename(p) for p in paths} >= {"tokenizer_config.json",
                                                    "special_tokens_map.json",
                                                    "generation_config.json"}
  tok = hf.transformers.AutoTokenizer.from_pretrained(out)
  model = hf.transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  prompt = "alpha river"
  ids = sampling.prompt_ids(sampling.codec_of(trained_lib.load(workdir).config), prompt)
  assert tok.encode(prompt) == ids
  with hf.torch.no_grad():
    theirs = model.generate(hf.torch.tensor([ids]), max_new_tokens=28, do_sample=False,
                            attention_mask=hf.torch.ones(1, len(ids), dtype=hf.torch.long)
                            )[0, len(ids):].tolist()
  run = trained_lib.load(workdir)
  ours = sampling.generate(run.model, jax.device_put(run.params), ids, max_new_tokens=28,
                           temperature=0.0)[0].tolist()
  stop = ours.index(hf.eos) + 1 if hf.eos in ours else len(ours)  # generate stops at EOS
  print(f"greedy: transformers {theirs}, diloco_jax {ours}")
  assert theirs == ours[:stop], (theirs, ours)
  text = sampling.sample(workdir, prompt, max_new_tokens=28, temperature=0.0, top_k=0,
                         seed=0, step=None, num_samples=1)[0]
  assert text == tok.decode(ids + [t for t in theirs if t != hf.eos])


def _dir(tmp_path, name: str, cfg=None, **change) -> str:
  """A model directory written by our export (Hugging Face's layout), config.json changed."""
  cfg = cfg or family_lib.ModelConfig(vocab_size=40, seq_len=16, num_layers=1, d_model=16,
                                     num_heads=2, mlp_dim=32, family="gpt")
  directory = tmp_path / name
  exported.write(str(directory / "model.safetensors"), cfg,
                 model_lib.init_params(cfg, jax.random.key(0)))
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, **change}))
  return str(directory)


def test_bad_model_directories_one_line_each(tmp_path):
  def error(directory, **fields):
    config = small_config(**{"model.init_from": directory, **fields})
    with pytest.raises(pretrained.PretrainedError) as e:
      config = pretrained.resolved(config, announce=False)
      pretrained.params(directory, family_lib.ModelConfig.from_config(config.model, 16))
    assert "\n" not in str(e.value)
    return str(e.value)

  good = _dir(tmp_path, "good")
  os.remove(os.path.join(_dir(tmp_path, "none"), "config.json"))
  assert error(str(tmp_path / "none")).endswith("none/config.json: missing (a Hugging Face "
                                                "model directory holds config.json and its "
                                                "weights)")
  assert "architecture 'Qwen2ForCausalLM': supported are LlamaForCausalLM, GPT2LMHeadModel" \
      in error(_dir(tmp_path, "qwen", architectures=["Qwen2ForCausalLM"]))
  assert "activation_function = 'relu'" in error(_dir(tmp_path, "relu",
                                                      activation_function="relu"))
  assert "seq_len = 64: longer than the 16 positions" in error(good, **{"model.seq_len": 64})
  assert "vocab_size = 40 is smaller than the data's vocabulary" in error(
      good, **{"data.vocab_size": 50})
  tensors = safetensors.numpy.load_file(os.path.join(good, "model.safetensors"))
  del tensors["transformer.h.0.mlp.c_fc.bias"]
  safetensors.numpy.save_file(tensors, os.path.join(good, "model.safetensors"))
  assert error(good).endswith("model.safetensors: tensor 'transformer.h.0.mlp.c_fc.bias' is "
                              "missing")
  tensors["transformer.h.0.mlp.c_fc.bias"] = np.zeros(31, np.float32)
  safetensors.numpy.save_file(tensors, os.path.join(good, "model.safetensors"))
  assert "tensor 'transformer.h.0.mlp.c_fc.bias' has shape (31,), expected (32,)" in error(good)
  os.remove(os.path.join(good, "model.safetensors"))
  assert "no model.safetensors nor model.safetensors.index.json" in error(good)
  # a model flag on the command line that contradicts config.json: the train command's line
  llama = _dir(tmp_path, "llama", family_lib.ModelConfig(
      vocab_size=300, seq_len=16, num_layers=1, d_model=16, num_heads=2, mlp_dim=32,
      family="llama"))
  result = subprocess.run(
      [sys.executable, "-m", "diloco_jax.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path / 'w'}", f"--config.model.init_from={llama}",
       "--config.model.d_model=64"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stderr.strip().splitlines() == [
      f"Invalid config: --config.model.d_model=64 contradicts {llama}/config.json, which "
      "gives d_model = 16 (the model comes from init_from: leave the flag out)"]
  assert not os.path.exists(tmp_path / "w")
