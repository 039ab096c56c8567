"""Export: the safetensors file and config.json hold the model. A numpy forward pass written
here from those two files alone (Hugging Face's Llama and GPT-2 conventions) gives the
trainer's logits, for a trained llama run and for perturbed initial params of a tied llama
and of gpts; load_exported gives the params back bit for bit; bad inputs stop the CLI with
one line. (tests/test_hf.py loads the exports in transformers itself.)"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy

from diloco_jax import export as export_lib
from diloco_jax.readback import trained as trained_lib
from diloco_jax.loop import trainer
from diloco_jax.models import exported
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib
from tests.multihost import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5  # max |logit difference|: float64 here vs float32 in flax


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "diloco_jax.export", *args], check=False,
                        cwd=REPO, capture_output=True, text=True, timeout=120)


def _train(tmp_path_factory, name: str, **model) -> str:
  """A tiny run of 2 rounds (vocab 32, 2 layers, d_model 32, 4 heads, seq_len 16)."""
  config = small_config(num_rounds=2, inner_steps=2, eval_batches=1,
                        **{"data.vocab_size": 32, "model.num_layers": 2,
                           "model.num_heads": 4, **{f"model.{k}": v for k, v in model.items()}})
  workdir = str(tmp_path_factory.mktemp(name))
  trainer.train_and_evaluate(config, workdir)
  return workdir


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
  """Grouped-query (4 heads, 2 kv heads), untied, exported through the CLI."""
  workdir = _train(tmp_path_factory, "llama", family="llama", num_kv_heads=2)
  output = str(tmp_path_factory.mktemp("llama_out") / "model.safetensors")
  # a relative --workdir, as a user types it (orbax reads only absolute paths)
  result = _cli(f"--workdir={os.path.relpath(workdir, REPO)}", f"--output={output}")
  assert result.returncode == 0, result.stderr
  return workdir, output


def _read(output: str) -> tuple[dict[str, np.ndarray], dict]:
  with open(os.path.join(os.path.dirname(output), "config.json")) as f:
    return safetensors.numpy.load_file(output), json.load(f)


def _tokens(vocab: int) -> np.ndarray:
  return np.random.default_rng(0).integers(0, vocab, (2, 16))


def _perturbed_init(cfg: family_lib.ModelConfig):
  """Initial params plus noise: no norm weight is 1 and no bias 0, so that every tensor's
  name and layout shows in the logits."""
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda x: np.asarray(x + rng.normal(0, 0.1, x.shape), np.float32),
                      model_lib.init_params(cfg, jax.random.key(0)))


def _trainer_logits(cfg: family_lib.ModelConfig, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(family_lib.build(cfg).apply({"params": params}, tokens))


# The reference forward passes: numpy, float64, from the exported files only.

def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH):
  h, l = q_BxLxNxH.shape[-1], q_BxLxNxH.shape[1]
  scores = np.einsum("bqnh,bknh->bnqk", q_BxLxNxH, k_BxLxNxH) / np.sqrt(h)
  scores = np.where(np.tril(np.ones((l, l), bool)), scores, -np.inf)
  return np.einsum("bnqk,bknh->bqnh", _softmax(scores), v_BxLxNxH)


def _hf_llama_forward(t: dict[str, np.ndarray], c: dict, tokens: np.ndarray) -> np.ndarray:
  """LlamaForCausalLM's forward as modeling_llama computes it: RMSNorm (weight times the
  normalised state), rotary embedding with rotate_half, k/v heads repeated for GQA, causal
  softmax attention, SwiGLU, final norm, lm_head (or the tied embeddings)."""
  w = {k: v.astype(np.float64) for k, v in t.items()}
  n, kv = c["num_attention_heads"], c["num_key_value_heads"]
  h = c["hidden_size"] // n
  b, l = tokens.shape

  def rms(x, weight):
    return weight * x / np.sqrt((x * x).mean(-1, keepdims=True) + c["rms_norm_eps"])

  inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, h, 2) / h)
  emb = np.concatenate([np.outer(np.arange(l), inv_freq)] * 2, -1)[None, :, None, :]

  def rotate(x):  # x [B, L, heads, H]
    rotated = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)

  x = w["model.embed_tokens.weight"][tokens]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    y = rms(x, w[p + "input_layernorm.weight"])
    q = rotate((y @ w[p + "self_attn.q_proj.weight"].T).reshape(b, l, n, h))
    k = rotate((y @ w[p + "self_attn.k_proj.weight"].T).reshape(b, l, kv, h))
    v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(b, l, kv, h)
    k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
    x = x + _attention(q, k, v).reshape(b, l, n * h) @ w[p + "self_attn.o_proj.weight"].T
    y = rms(x, w[p + "post_attention_layernorm.weight"])
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  x = rms(x, w["model.norm.weight"])
  head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
  return x @ head.T


def _gpt2_forward(t: dict[str, np.ndarray], c: dict, tokens: np.ndarray) -> np.ndarray:
  """GPT2LMHeadModel's forward as modeling_gpt2 computes it: LayerNorm with
  layer_norm_epsilon, learned positions, Conv1D (x @ weight + bias, weight [in, out]),
  c_attn split into q, k, v then heads, tanh-approximated GELU ("gelu_new"), a head
  without bias (the embeddings when tied)."""
  w = {k: v.astype(np.float64) for k, v in t.items()}
  n, d = c["n_head"], c["n_embd"]
  b, l = tokens.shape

  def ln(x, name):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + c["layer_norm_epsilon"]) * w[name + ".weight"]
            + w[name + ".bias"])

  def conv1d(x, name):
    return x @ w[name + ".weight"] + w[name + ".bias"]

  x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:l]
  for i in range(c["n_layer"]):
    p = f"transformer.h.{i}."
    q, k, v = np.split(conv1d(ln(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
    heads = [y.reshape(b, l, n, d // n) for y in (q, k, v)]
    x = x + conv1d(_attention(*heads).reshape(b, l, d), p + "attn.c_proj")
    y = conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")
    y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
    x = x + conv1d(y, p + "mlp.c_proj")
  head = w["transformer.wte.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
  return ln(x, "transformer.ln_f") @ head.T


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_llama_names_shapes_and_config(llama_run):
  workdir, output = llama_run
  tensors, config = _read(output)
  layer = {"self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
           "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
           "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
           "mlp.down_proj.weight": (32, 64), "input_layernorm.weight": (32,),
           "post_attention_layernorm.weight": (32,)}
  expected = {"model.embed_tokens.weight": (32, 32), "model.norm.weight": (32,),
              "lm_head.weight": (32, 32),
              **{f"model.layers.{i}.{k}": s for i in range(2) for k, s in layer.items()}}
  assert {k: v.shape for k, v in tensors.items()} == expected
  assert {v.dtype for v in tensors.values()} == {np.dtype(np.float32)}
  hf = {k: config[k] for k in ("architectures", "model_type", "hidden_size",
                               "intermediate_size", "num_attention_heads",
                               "num_hidden_layers", "num_key_value_heads", "vocab_size",
                               "max_position_embeddings", "tie_word_embeddings",
                               "hidden_act", "attention_bias", "mlp_bias", "torch_dtype")}
  assert hf == {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 32,
                "max_position_embeddings": 16, "tie_word_embeddings": False,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "torch_dtype": "float32"}
  assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-5, 10000.0)
  ours = config["diloco_jax"]
  assert (ours["mode"], ours["round"], ours["finished"]) == ("sync", 2, True)
  assert ours["workdir"] == os.path.abspath(workdir)
  assert ours["model"]["dtype"] == "float32" and ours["model"]["num_kv_heads"] == 2


def test_llama_numpy_forward_equals_trainer(llama_run):
  workdir, output = llama_run
  tensors, config = _read(output)
  trained = trained_lib.load(workdir)
  tokens = _tokens(32)
  diff = _max_diff(_hf_llama_forward(tensors, config, tokens),
                   _trainer_logits(trained.model, trained.params, tokens))
  print(f"llama (GQA, untied, trained): max |numpy - trainer| = {diff:.2e}")
  assert diff <= TOL


def test_tied_llama_numpy_forward_tokenizer_and_round_trip(tmp_path):
  """Tied embeddings, other rope_theta and eps, perturbed initial params; with a corpus's
  tokenizer and EOS id."""
  cfg = family_lib.ModelConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=32,
                              num_heads=4, mlp_dim=64, family="llama", num_kv_heads=2,
                              rope_base=500.0, norm_eps=1e-6, tie_embeddings=True)
  params = _perturbed_init(cfg)
  (tmp_path / "corpus").mkdir()
  (tmp_path / "out").mkdir()
  tokenizer = tmp_path / "corpus" / "tokenizer.json"
  tokenizer.write_text('{"model": {}}')
  output = str(tmp_path / "out" / "model.safetensors")
  exported.write(output, cfg, params, tokenizer=str(tokenizer), eos_id=3)
  tensors, config = _read(output)
  assert "lm_head.weight" not in tensors and config["tie_word_embeddings"] is True
  assert (config["bos_token_id"], config["eos_token_id"]) == (3, 3)
  assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'
  tokens = _tokens(32)
  diff = _max_diff(_hf_llama_forward(tensors, config, tokens),
                   _trainer_logits(cfg, params, tokens))
  print(f"llama (GQA, tied, perturbed init): max |numpy - trainer| = {diff:.2e}")
  assert diff <= TOL
  assert_round_trip(output, cfg, params)
  os.remove(output)
  os.remove(tmp_path / "out" / "config.json")
  with pytest.raises(exported.ExportError, match="tokenizer.json exists"):
    exported.write(output, cfg, params, tokenizer=str(tokenizer), overwrite=False)


def assert_round_trip(output: str, cfg, params):
  """load_exported gives back `cfg` and `params` bit for bit; returns the module."""
  module, loaded = model_lib.load_exported(output)
  assert module.cfg == cfg
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  return module


@pytest.mark.parametrize("model", [{}, {"use_bias": False, "tie_embeddings": True,
                                             "norm_eps": 1e-6, "max_positions": 24}])
def test_gpt2_numpy_forward_and_round_trip(tmp_path, model):
  """As GPT2LMHeadModel: untied with biases; tied without (zero biases in the file), a
  position table longer than seq_len."""
  cfg = family_lib.ModelConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=32,
                              num_heads=4, mlp_dim=64, family="gpt", **model)
  params = _perturbed_init(cfg)
  output = str(tmp_path / "gpt.safetensors")
  exported.write(output, cfg, params)
  tensors, config = _read(output)
  assert config["diloco_jax"]["format"] == exported.HF_GPT2
  assert (config["architectures"], config["n_positions"], config["n_inner"]) == (
      ["GPT2LMHeadModel"], cfg.positions, 64)
  umask = os.umask(0)
  os.umask(umask)
  for name in ("gpt.safetensors", "config.json"):  # as any file written here would be
    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask
  assert sorted(os.listdir(tmp_path)) == ["config.json", "gpt.safetensors"]
  assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D [in, out]
  assert ("lm_head.weight" in tensors) == (not cfg.tie_embeddings)
  assert bool(np.any(tensors["transformer.h.0.mlp.c_fc.bias"])) == cfg.use_bias
  tokens = _tokens(32)
  diff = _max_diff(_gpt2_forward(tensors, config, tokens),
                   _trainer_logits(cfg, params, tokens))
  print(f"gpt {model} (perturbed init): max |numpy - trainer| = {diff:.2e}")
  assert diff <= TOL
  assert type(assert_round_trip(output, cfg, params)).__name__ == "GPT"


def test_flax_names_where_hugging_face_has_no_layout(tmp_path):
  """A gpt with a head bias (the gpt of earlier versions) keeps flax's names; an export
  written before head_bias existed loads as the model it was (head bias, eps 1e-6)."""
  cfg = family_lib.ModelConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=32,
                              num_heads=4, mlp_dim=64, family="gpt", head_bias=True)
  params = _perturbed_init(cfg)
  output = str(tmp_path / "gpt.safetensors")
  exported.write(output, cfg, params)
  tensors, config = _read(output)
  assert config["format"] == config["diloco_jax"]["format"] == exported.FLAX
  assert "architectures" not in config and "head.bias" in tensors
  assert tensors["block_1.qkv.kernel"].shape == (32, 96)  # flax's [in, out]
  assert_round_trip(output, cfg, params)
  for field in ("head_bias", "max_positions"):  # as an earlier version wrote it
    del config["diloco_jax"]["model"][field]
  (tmp_path / "config.json").write_text(json.dumps(config))
  module, loaded = model_lib.load_exported(output)
  assert (module.cfg.head_bias, module.cfg.norm_eps) == (True, 1e-6)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_bfloat16_and_shards_with_an_index(tmp_path):
  """--dtype=bfloat16 writes every tensor in bf16 (config.json says so) and loads back as
  the float32 of those bf16 values; above max_shard_bytes the tensors go to numbered files
  with Hugging Face's index, read back bit for bit; an export in the other layout is not
  left beside a new one (refused without overwrite, removed with it)."""
  cfg = family_lib.ModelConfig(vocab_size=32, seq_len=16, num_layers=2, d_model=32,
                              num_heads=4, mlp_dim=64, family="llama", num_kv_heads=2)
  params = _perturbed_init(cfg)
  output = str(tmp_path / "model.safetensors")
  exported.write(output, cfg, params, dtype="bfloat16")
  tensors, config = _read(output)
  assert {str(x.dtype) for x in tensors.values()} == {"bfloat16"}
  assert config["torch_dtype"] == config["diloco_jax"]["tensor_dtype"] == "bfloat16"
  _, loaded = model_lib.load_exported(output)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      a, np.asarray(b).astype(jax.numpy.bfloat16).astype(np.float32)), loaded, params)

  one_layer = 4 * (32 * 32 + 32 * 64)  # float32 bytes of a block's q and gate kernels
  os.remove(tmp_path / "config.json")  # so that the refusal is the stale single file's
  with pytest.raises(exported.ExportError, match="model.safetensors exists"):
    exported.write(output, cfg, params, max_shard_bytes=one_layer, overwrite=False)
  paths = exported.write(output, cfg, params, max_shard_bytes=one_layer, overwrite=True)
  shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))
  count = len(shards)
  assert count > 2 and shards[0] == f"model-00001-of-{count:05d}.safetensors"
  assert not os.path.exists(output)  # the single file of the bf16 export is gone
  with open(output + ".index.json") as f:
    index = json.load(f)
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(
      x.nbytes for x in exported.to_tensors(cfg, params).values())
  for name in shards:  # each file holds what the index says, none over the limit
    part = safetensors.numpy.load_file(tmp_path / name)
    assert {n for n, f in index["weight_map"].items() if f == name} == set(part)
    assert sum(x.nbytes for x in part.values()) <= one_layer or len(part) == 1
  assert output + ".index.json" in paths
  assert_round_trip(output, cfg, params)
  exported.write(output, cfg, params, overwrite=True)  # one file again: no shards left
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_load_exported_names_what_is_wrong(tmp_path):
  cfg = family_lib.ModelConfig(vocab_size=32, seq_len=16, num_layers=1, d_model=32,
                              num_heads=4, mlp_dim=64, family="llama")
  output = str(tmp_path / "model.safetensors")
  exported.write(output, cfg, model_lib.init_params(cfg, jax.random.key(0)))
  tensors = safetensors.numpy.load_file(output)
  del tensors["model.layers.0.mlp.up_proj.weight"]
  safetensors.numpy.save_file(tensors, output)
  with pytest.raises(exported.ExportError, match="'model.layers.0.mlp.up_proj.weight' is "
                     "missing"):
    model_lib.load_exported(output)
  os.remove(tmp_path / "config.json")
  with pytest.raises(exported.ExportError, match="not the config.json of an export"):
    model_lib.load_exported(output)


def test_load_exported_gives_the_trained_params(llama_run):
  workdir, output = llama_run
  trained = trained_lib.load(workdir)
  module, params = model_lib.load_exported(output)
  assert module.cfg == trained.model and type(module).__name__ == "Llama"
  assert jax.tree.structure(params) == jax.tree.structure(trained.params)
  jax.tree.map(np.testing.assert_array_equal, params, trained.params)


def test_corpus_files_from_the_manifest(tmp_path):
  config = small_config(**{"data.source": "prepared", "data.path": str(tmp_path)})
  (tmp_path / "manifest.json").write_text(json.dumps(
      {"eos_id": 7, "tokenizer": {"kind": "sentencepiece", "file": "tokenizer.model"}}))
  assert export_lib.corpus_files(config) == (None, 7)  # the file is not there
  (tmp_path / "tokenizer.model").write_bytes(b"sp")
  assert export_lib.corpus_files(config) == (str(tmp_path / "tokenizer.model"), 7)
  assert export_lib.corpus_files(small_config()) == (None, None)


def _one_line_error(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 1, (result.returncode, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
  return lines[0]


def test_cli_errors(llama_run, tmp_path):
  workdir, output = llama_run
  assert _cli("--help").returncode == 0
  line = _one_line_error(_cli(f"--workdir={tmp_path}",
                              f"--output={tmp_path / 'model.safetensors'}"))
  assert "no checkpoints/ directory" in line
  assert output in _one_line_error(_cli(f"--workdir={workdir}", f"--output={output}"))
  line = _one_line_error(_cli(f"--workdir={workdir}", f"--output={tmp_path / 'model.bin'}"))
  assert "must end in .safetensors" in line
  line = _one_line_error(_cli(f"--workdir={workdir}", f"--output={tmp_path / 'm.safetensors'}",
                              "--max_shard_size=5PB"))
  assert "--max_shard_size=5PB" in line and not os.path.exists(tmp_path / "m.safetensors")
  assert "dtype" in _one_line_error(_cli(f"--workdir={workdir}", "--output=x.safetensors",
                                         "--dtype=float16"))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(exported.ExportError, match="a_file is a file, not a directory"):
    export_lib.export(workdir, str(tmp_path / "a_file" / "model.safetensors"))
  new = tmp_path / "new" / "dir" / "model.safetensors"  # made, as `mkdir -p` would
  assert export_lib.export(workdir, str(new))[0] == str(new) and new.is_file()
  (tmp_path / "config.json").write_text("{}")  # config.json is not replaced either
  with pytest.raises(exported.ExportError, match="config.json exists"):
    export_lib.export(workdir, str(tmp_path / "other.safetensors"))
