"""Hugging Face models in: `config.model.init_from = DIR` starts a run from DIR's weights.

DIR is what `save_pretrained` writes (or `huggingface-cli download`): config.json, and
model.safetensors or shards model-0000i-of-0000N.safetensors with their
model.safetensors.index.json. Its config.json decides the model's fields (`resolved`:
family, widths, heads, layers, vocabulary, positions; models/hf.py reads them), over the
config file's; a model flag given on the command line that says otherwise is an error.
Its weights become the anchor and every replica at round 1 (`params`), in float32
whatever the file's dtype; a resumed run reads its checkpoint instead.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import ml_collections
import numpy as np

from diloco_jax import digest
from diloco_jax import errors
from diloco_jax.models import exported
from diloco_jax.models import family
from diloco_jax.models import hf

CONFIG = "config.json"
WEIGHTS = "model.safetensors"  # or its shards, named by WEIGHTS + exported.INDEX
# Buffers some checkpoints carry beside the params: rotary frequencies, GPT-2's causal mask.
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
GPT2_TOP = ("h.", "wte.", "wpe.", "ln_f.")  # GPT2Model's names, saved without "transformer."


class PretrainedError(errors.ConfigError):
  """The model directory cannot be used; the message names the file and what is wrong."""


def read_config(directory: str) -> dict[str, Any]:
  """config.model's fields from DIR/config.json."""
  if not os.path.isdir(directory):
    raise PretrainedError(f"config.model.init_from = {directory}: not a directory")
  path = os.path.join(directory, CONFIG)
  try:
    with open(path) as f:
      config = json.load(f)
    return hf.model_fields(config)
  except hf.UnsupportedError as e:
    raise PretrainedError(f"{path}: {e}") from None
  except FileNotFoundError:
    raise PretrainedError(f"{path}: missing (a Hugging Face model directory holds "
                          "config.json and its weights)") from None
  except (OSError, ValueError, AttributeError) as e:
    raise PretrainedError(f"{path}: not a model's config.json: "
                          f"{' '.join(str(e).split())}") from None


def weight_files(directory: str) -> list[str]:
  """The safetensors files of DIR (and the index naming them), in their order."""
  single, index = os.path.join(directory, WEIGHTS), os.path.join(directory, WEIGHTS
                                                                  + exported.INDEX)
  if os.path.exists(single):
    return [single]
  if not os.path.exists(index):
    raise PretrainedError(f"{directory}: no {WEIGHTS} nor {WEIGHTS + exported.INDEX} (only "
                          "safetensors weights are read)")
  try:
    with open(index) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise PretrainedError(f"{index}: not a safetensors index ({type(e).__name__}: {e})"
                          ) from None
  return [index, *(os.path.join(directory, name) for name in shards)]


def _named(tensors: dict[str, np.ndarray], cfg: family.ModelConfig, config_path: str
           ) -> dict[str, np.ndarray]:
  """The tensors under models/hf.py's names: buffers dropped, GPT2Model's names given
  their "transformer." prefix, a tied head that repeats the embeddings dropped."""
  out = {}
  for name, x in tensors.items():
    if name.endswith(BUFFERS) and not name.endswith(".c_attn.bias"):
      continue
    if cfg.family == "gpt" and name.startswith(GPT2_TOP):
      name = "transformer." + name
    out[name] = x
  embeddings = "model.embed_tokens.weight" if cfg.family == "llama" else "transformer.wte.weight"
  if cfg.tie_embeddings and "lm_head.weight" in out:
    if embeddings in out and not np.array_equal(out["lm_head.weight"], out[embeddings]):
      raise PretrainedError(f"{config_path} says tie_word_embeddings = true, but "
                            f"lm_head.weight differs from {embeddings}")
    del out["lm_head.weight"]
  return out


def params(directory: str, cfg: family.ModelConfig) -> Any:
  """The params of build(cfg) from DIR's weights, float32 numpy arrays (a PretrainedError
  naming the file of a missing, extra or misshapen tensor)."""
  files = weight_files(directory)
  try:
    tensors = exported.read_tensors(os.path.join(directory, WEIGHTS))
    return exported.from_tensors(cfg, _named(tensors, cfg, os.path.join(directory, CONFIG)))
  except exported.ExportError as e:
    where = files[0] if len(files) == 1 else f"{directory} ({len(files) - 1} shards)"
    raise PretrainedError(f"{where}: {e}") from None


def source(directory: str) -> dict[str, Any]:
  """Where the weights came from, for run.json: the directory and each file's sha256."""
  files = [os.path.join(directory, CONFIG), *weight_files(directory)]
  return {"path": os.path.abspath(directory),
          "sha256": {os.path.basename(p): digest.file_sha256(p) for p in files}}


def resolved(config: ml_collections.ConfigDict, given: frozenset[str] = frozenset(),
             announce: bool = True) -> ml_collections.ConfigDict:
  """The config with the model fields of `config.model.init_from`'s config.json (a copy;
  a note lists what changed). `given`: the fields set on the command line
  ("config.model.d_model", ...); one that contradicts the directory is an error."""
  directory, model = config.model.init_from, config.model
  if not directory:
    return config
  if model.module:
    raise PretrainedError(f"config.model.init_from = {directory} and config.model.module = "
                          f"{model.module}: a pretrained model is one of the built-in families")
  fields = read_config(directory)
  path = os.path.join(directory, CONFIG)
  changed = {k: v for k, v in fields.items() if model.get(k) != v}
  for k, v in changed.items():
    if f"config.model.{k}" in given:
      raise PretrainedError(f"--config.model.{k}={model[k]} contradicts {path}, which gives "
                            f"{k} = {v!r} (the model comes from init_from: leave the flag out)")
  if fields["max_positions"] and model.seq_len > fields["max_positions"]:
    raise PretrainedError(f"config.model.seq_len = {model.seq_len}: longer than the "
                          f"{fields['max_positions']} positions of the model in {path}")
  if config.data.vocab_size > fields["vocab_size"]:
    raise PretrainedError(f"{path}: vocab_size = {fields['vocab_size']} is smaller than the "
                          f"data's vocabulary, config.data.vocab_size = "
                          f"{config.data.vocab_size} (prepare the corpus with this model's "
                          "tokenizer: prepare --tokenizer=DIR)")
  if not changed:
    return config
  if announce:
    print(f"config.model.init_from = {directory}: from its config.json, " + ", ".join(
        f"{k} {model.get(k)!r} -> {v!r}" for k, v in changed.items()), flush=True)
  config = copy.deepcopy(config)
  config.model.update(fields)
  return config
