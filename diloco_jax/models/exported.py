"""Models as files: a model and its params as safetensors with a config.json beside it,
what `python -m diloco_jax.export` writes and `model.load_exported` reads back.

Files, in the output's directory:
  PATH.safetensors  the params, float32 or bfloat16 (`dtype`). Above `max_shard_bytes` they
                    are cut into PATH-00001-of-0000N.safetensors ... with an index,
                    PATH.safetensors.index.json ({"metadata": {"total_size": bytes},
                    "weight_map": {tensor name: file}}), as Hugging Face writes them.
  config.json       the model's config (below).
  tokenizer.json    for a run on a prepared corpus: the corpus's tokenizer file, under its
  (or .model)       own name, when the corpus directory holds one.
Nothing is overwritten without --overwrite.

Tensor names and layouts:
  llama family  Hugging Face's `LlamaForCausalLM`, and
  gpt family    `GPT2LMHeadModel` (models/hf.py lists the names): config.json holds the Hugging
                Face config's fields, so a directory whose file is named model.safetensors
                loads with `AutoModelForCausalLM.from_pretrained(dir)`.
  your module,  the flax param path joined with "." (block_0.qkv.kernel, embed.embedding,
  a gpt with    pos_embed, ln_final.scale, ...) in flax's layouts (Dense kernels [in, out];
  a head bias   gpt's fused qkv output is [3, N, H] in that order, see gpt.py).
  tokenizer_config.json, special_tokens_map.json, generation_config.json: beside a
                tokenizer.json, what `AutoTokenizer` and `generate` read (EOS, BOS).

config.json's "diloco_jax" object holds what `load` needs to rebuild the model: "format"
(FLAX, HF_LLAMA or HF_GPT2: the naming above), "model" (every ModelConfig field, dtype by
name), and the run's mode, round, finished and workdir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from diloco_jax import errors
from diloco_jax.models import family
from diloco_jax.models import hf

Params = Any
CONFIG = "config.json"
FLAX = "diloco_jax.flax/1"  # tensor names: flax paths joined with "."
HF_LLAMA = "huggingface.llama/1"  # tensor names: Hugging Face's LlamaForCausalLM
HF_GPT2 = "huggingface.gpt2/1"  # tensor names: Hugging Face's GPT2LMHeadModel
SUFFIX = ".safetensors"
INDEX = ".index.json"  # PATH.safetensors.index.json: the shards of PATH.safetensors
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
# What the gpt family computed before `head_bias` existed (its head had a bias with
# use_bias, its LayerNorms flax's epsilon): exports and checkpoints of then load as trained.
EARLIER_GPT = {"norm_eps": 1e-6}


class ExportError(errors.DilocoError, ValueError):
  """What is being exported or loaded is not usable; the message says why, in one line."""
  prefix = "Cannot export"


def _format(cfg: family.ModelConfig) -> str:
  if hf.expressible(cfg) is not None:
    return FLAX
  return HF_LLAMA if cfg.family == "llama" else HF_GPT2


def _path(keys) -> tuple[str, ...]:
  """A jax key path as names (dict keys; list indices, should your module have lists)."""
  return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def _paths(params: Params) -> dict[tuple[str, ...], Any]:
  """{flax path: leaf} of a params tree."""
  return {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _mapping(cfg: family.ModelConfig) -> list[hf.Tensor]:
  """Every tensor of build(cfg)'s file, checked against its param tree so that a family
  whose params change cannot export half a model."""
  paths = _paths(family.param_shapes(cfg))
  if _format(cfg) == FLAX:
    mapping = [hf.Tensor(path, ".".join(path)) for path in paths]
    if len({t.name for t in mapping}) < len(mapping):  # names holding a "."
      raise ExportError("the param paths of this module do not stay apart when joined "
                        "with '.'")
    return mapping
  mapping = hf.names(cfg)
  ours = {t.path for t in mapping if t.path is not None}
  if ours != set(paths):
    raise ExportError(f"the {cfg.family} param tree and models/hf.py's names differ at "
                      f"{sorted(set(paths) ^ ours)}")
  return mapping


def to_tensors(cfg: family.ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """{tensor name: float32 array} of `params` (the module docstring's names, layouts)."""
  leaves, mapping = _paths(params), _mapping(cfg)
  if set(leaves) != {t.path for t in mapping if t.path is not None}:
    raise ExportError(f"the params are not those of this model: they differ at "
                      f"{sorted(set(leaves) ^ {t.path for t in mapping})}")
  out = {}
  for t in mapping:
    if t.path is None:
      out[t.name] = np.zeros(t.zeros, np.float32)
      continue
    x = np.asarray(leaves[t.path], np.float32)
    out[t.name] = np.ascontiguousarray(x.T if t.transposed else x)
  return out


def from_tensors(cfg: family.ModelConfig, tensors: dict[str, np.ndarray]) -> Params:
  """The params tree of build(cfg) from `to_tensors`' output (an ExportError naming the
  first missing, extra or misshapen tensor, or a nonzero one the model has no param for)."""
  mapping = _mapping(cfg)
  extra = set(tensors) - {t.name for t in mapping}
  if extra:
    raise ExportError(f"tensors {sorted(extra)[:4]} are not params of this model")
  for t in mapping:
    if t.path is None and t.name in tensors and np.any(tensors[t.name]):
      raise ExportError(f"tensor {t.name!r} is not zero: config.model.use_bias = False "
                        "has no such bias")
  by_path = {t.path: t for t in mapping if t.path is not None}

  def leaf(path, shape):
    t = by_path[_path(path)]
    if t.name not in tensors:
      raise ExportError(f"tensor {t.name!r} is missing")
    x = tensors[t.name].T if t.transposed else tensors[t.name]
    if x.shape != shape.shape:
      raise ExportError(f"tensor {t.name!r} has shape {tensors[t.name].shape}, expected "
                        f"{shape.shape[::-1] if t.transposed else shape.shape}")
    return np.ascontiguousarray(x, np.float32)

  return jax.tree_util.tree_map_with_path(leaf, family.param_shapes(cfg))


def model_fields(cfg: family.ModelConfig) -> dict[str, Any]:
  """Every ModelConfig field, JSON-ready (the dtype by name)."""
  fields = dataclasses.asdict(cfg)
  fields["dtype"] = jnp.dtype(cfg.dtype).name
  return fields


def config_json(cfg: family.ModelConfig, run: dict[str, Any] | None = None,
                eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
  """config.json: Hugging Face's config fields where the model has its layout, and always
  the "diloco_jax" object (`run`: mode, round, finished, workdir; the tensors' dtype)."""
  ours = {"format": _format(cfg), "model": model_fields(cfg), "tensor_dtype": dtype,
          **(run or {})}
  if _format(cfg) == FLAX:
    return {"format": ours["format"], "diloco_jax": ours}
  return {**hf.config_json(cfg, eos_id, dtype), "diloco_jax": ours}


def check_output(output: str) -> None:
  """An ExportError unless `output` names a .safetensors file whose directory exists or
  can be made (`write` makes it)."""
  if not output.endswith(SUFFIX):
    raise ExportError(f"--output={output}: must end in {SUFFIX} (the file written; "
                      f"{CONFIG} goes beside it)")
  existing = os.path.dirname(output) or "."
  while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "."
  if not os.path.isdir(existing):
    raise ExportError(f"--output={output}: {existing} is a file, not a directory")
  if os.path.isdir(output):
    raise ExportError(f"--output={output} is a directory")


def check_free(paths: list[str], overwrite: bool) -> None:
  for path in paths:
    if os.path.exists(path) and not overwrite:
      raise ExportError(f"{path} exists; pass --overwrite to replace it")


def _replace(path: str, write) -> None:
  """`write(tmp)` then a rename: an interrupted export leaves no half-written file. The
  file gets the mode of any new file (safetensors makes its files private to their owner)."""
  tmp = os.path.join(os.path.dirname(path) or ".",
                     f".{os.path.basename(path)}.{os.getpid()}.partial")
  umask = os.umask(0)
  os.umask(umask)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _write_text(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def shards(tensors: dict[str, np.ndarray], max_bytes: int | None) -> list[dict]:
  """The tensors in order, cut into files of at most `max_bytes` (a tensor bigger than
  that alone in its file); one file when `max_bytes` is None."""
  out: list[dict] = [{}]
  size = 0
  for name, x in tensors.items():
    if max_bytes is not None and out[-1] and size + x.nbytes > max_bytes:
      out.append({})
      size = 0
    out[-1][name] = x
    size += x.nbytes
  return out


def shard_paths(output: str, count: int) -> list[str]:
  """Where `count` shards of `output` go: `output` itself for one."""
  stem = output[:-len(SUFFIX)]
  return [output] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}{SUFFIX}"
                                      for i in range(1, count + 1)]


def _stale(output: str, keep: list[str]) -> list[str]:
  """Files of an earlier export of `output` in the other layout (one file or shards), which
  a reader could take for this one's."""
  directory, stem = os.path.dirname(output) or ".", os.path.basename(output)[:-len(SUFFIX)]
  names = [n for n in os.listdir(directory) if n == os.path.basename(output)
           or n == os.path.basename(output) + INDEX
           or (n.startswith(stem + "-") and "-of-" in n and n.endswith(SUFFIX))]
  return sorted(os.path.join(directory, n) for n in names
                if os.path.join(directory, n) not in keep)


def token_text(tokenizer_json: str, token_id: int) -> str | None:
  """The text of token `token_id` in a Hugging Face tokenizer.json (its added tokens, else
  its model's vocabulary); None where the file does not say."""
  try:
    with open(tokenizer_json) as f:
      spec = json.load(f)
    for token in spec.get("added_tokens") or []:
      if token.get("id") == token_id:
        return token["content"]
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {text: id}
      return next((text for text, i in vocab.items() if i == token_id), None)
    if isinstance(vocab, list) and 0 <= token_id < len(vocab):  # Unigram: [[text, score]]
      return vocab[token_id][0]
  except (OSError, ValueError, TypeError, KeyError, IndexError):
    pass
  return None


def tokenizer_files(cfg: family.ModelConfig, tokenizer: str | None,
                    eos_id: int | None) -> dict[str, dict[str, Any]]:
  """{file name: its JSON} of what Hugging Face reads beside a tokenizer.json:
  tokenizer_config.json and special_tokens_map.json (`AutoTokenizer`: the fast tokenizer
  of that file, EOS also as BOS, as config.json says) and generation_config.json
  (`generate`'s defaults). Nothing for other tokenizers or a model of flax names."""
  if not tokenizer or os.path.basename(tokenizer) != "tokenizer.json" or _format(cfg) == FLAX:
    return {}
  eos = None if eos_id is None else token_text(tokenizer, eos_id)
  special = {"bos_token": eos, "eos_token": eos} if eos is not None else {}
  return {
      "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                "model_max_length": cfg.positions,
                                "clean_up_tokenization_spaces": False, **special},
      "special_tokens_map.json": special,
      "generation_config.json": {"bos_token_id": eos_id, "eos_token_id": eos_id}}


def write(output: str, cfg: family.ModelConfig, params: Params, *,
          run: dict[str, Any] | None = None, tokenizer: str | None = None,
          eos_id: int | None = None, overwrite: bool = False, dtype: str = "float32",
          max_shard_bytes: int | None = None) -> list[str]:
  """Writes `params` of `cfg` to `output` (in `dtype`; in shards with an index above
  `max_shard_bytes`), config.json, `tokenizer`'s copy and `tokenizer_files` beside it;
  returns the paths written."""
  check_output(output)
  if dtype not in DTYPES:
    raise ExportError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
  if max_shard_bytes is not None and max_shard_bytes < 1:
    raise ExportError(f"max_shard_bytes={max_shard_bytes}: must be at least 1")
  directory = os.path.dirname(output) or "."
  tensors = {name: x if dtype == "float32" else np.asarray(x.astype(DTYPES[dtype]))
             for name, x in to_tensors(cfg, params).items()}
  files = shards(tensors, max_shard_bytes)
  names = shard_paths(output, len(files))
  index = [output + INDEX] if len(files) > 1 else []
  config_path = os.path.join(directory, CONFIG)
  copy = [os.path.join(directory, os.path.basename(tokenizer))] if tokenizer else []
  side = {os.path.join(directory, name): content
          for name, content in tokenizer_files(cfg, tokenizer, eos_id).items()}
  paths = [*names, *index, config_path, *copy, *side]
  check_free(paths, overwrite)
  os.makedirs(directory, exist_ok=True)
  stale = _stale(output, paths)
  check_free(stale, overwrite)
  text = json.dumps(config_json(cfg, run, eos_id, dtype), indent=2) + "\n"
  for path, part in zip(names, files):
    # Hugging Face refuses a file whose metadata "format" is not one of its frameworks'
    # ("pt" for a PyTorch model); the bytes are the same whichever reads them.
    _replace(path, lambda p, part=part: safetensors.numpy.save_file(part, p, {"format": "pt"}))
  if index:
    table = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
             "weight_map": {name: os.path.basename(path)
                            for path, part in zip(names, files) for name in part}}
    _replace(index[0], lambda p: _write_text(p, json.dumps(table, indent=2) + "\n"))
  _replace(config_path, lambda p: _write_text(p, text))
  if tokenizer:
    _replace(copy[0], lambda p: shutil.copyfile(tokenizer, p))
  for path, content in side.items():
    _replace(path, lambda p, c=content: _write_text(p, json.dumps(c, indent=2) + "\n"))
  for path in stale:  # only with overwrite: check_free refused them otherwise
    os.remove(path)
  return paths


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of `path`, or of the shards its index (`path` + INDEX) names."""
  if os.path.exists(path) or not os.path.exists(path + INDEX):
    try:
      return safetensors.numpy.load_file(path)
    except Exception as e:  # noqa: BLE001 -- safetensors' errors, one line
      raise ExportError(f"{path}: cannot be read: {type(e).__name__}: {e}") from None
  try:
    with open(path + INDEX) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ExportError(f"{path + INDEX}: not a safetensors index ({type(e).__name__}: "
                      f"{e})") from None
  tensors = {}
  for name in files:
    tensors.update(read_tensors(os.path.join(os.path.dirname(path) or ".", name)))
  missing = set(weight_map) - set(tensors)
  if missing:
    raise ExportError(f"{path + INDEX}: tensors {sorted(missing)[:3]} are in none of its "
                      "files")
  return tensors


def load(path: str) -> tuple[Any, Params]:
  """(module, params) of a model written by `write`: see model.load_exported."""
  config_path = os.path.join(os.path.dirname(path) or ".", CONFIG)
  try:
    with open(config_path) as f:
      ours = json.load(f)["diloco_jax"]
    fields = dict(ours["model"])
    fields["dtype"] = jnp.dtype(fields["dtype"])
    if "head_bias" not in fields and fields.get("family") == "gpt" and not fields["module"]:
      fields.update(EARLIER_GPT, head_bias=fields["use_bias"])
    cfg = family.ModelConfig(**fields)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ExportError(f"{config_path}: not the config.json of an export ({type(e).__name__}: "
                      f"{e})") from None
  if ours.get("format") != _format(cfg):
    raise ExportError(f"{config_path}: format {ours.get('format')!r}, expected "
                      f"{_format(cfg)!r} for this model")
  tensors = read_tensors(path)
  try:
    params = from_tensors(cfg, tensors)
  except ExportError as e:
    raise ExportError(f"{path}: {e}") from None
  return family.build(cfg), params
