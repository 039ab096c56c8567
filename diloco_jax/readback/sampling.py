"""Sampling from a trained run: what `python -m diloco_jax.sample` (sample.py, its flags
and errors) runs, and what `diloco_jax.sample.<name>` still finds.

Samples text from the model a run trained (the params it evaluates, from the newest
checkpoint or a given step's; see trained.py), with the run's own tokenizer: bytes for
data.source "text", the corpus manifest's tokenizer for "prepared"; for "synthetic" and
"tokens" data, which have no text, the prompt and the output are token ids.

The built-in families decode with a KV cache: one call prefills the prompt, then one token
per step. Your own module (model.module) has no cache: every step recomputes the whole
window. The cache, and the gpt family's learned positions, cover model.seq_len tokens, so
the prompt and the new tokens together must fit in seq_len.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import errors
from diloco_jax.corpus import sources
from diloco_jax.corpus import tokenizer as tokenizer_lib
from diloco_jax.data import prepared
from diloco_jax.readback import trained as trained_lib
from diloco_jax.models import family

Params = Any


class SampleError(errors.DilocoError, ValueError):
  """A prompt, flag or tokenizer that cannot be sampled from; the message says why."""
  prefix = "Cannot sample"


# ------------------------------------------------------------------------- generation


def _pick(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """The next token of each row: the argmax at temperature 0, else a draw from
  softmax(logits / temperature) restricted to the top_k likeliest (0: all)."""
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  if top_k:
    kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV / temperature).astype(jnp.int32)


def _empty_cache(model, tokens_BxP: jax.Array) -> Params:
  """A zero "cache" collection for `tokens_BxP`'s batch: keys and values of every block
  and the position counter at 0 (their shapes from an abstract init: nothing computed)."""
  tokens = jax.ShapeDtypeStruct(tokens_BxP.shape, tokens_BxP.dtype)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# Each path is one jitted program: the prefill and a lax.scan over the new tokens, so a
# sample is one dispatch with the cache kept on the device as the loop's carry (a Python
# loop over a jitted step would pay a host round trip per token, which dominates for small
# models). It compiles once per prompt length and max_new_tokens; the CLI samples once.
@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_k"))
def _generate_cached(params: Params, prompt_BxP: jax.Array, key: jax.Array, *,
                     cfg: family.ModelConfig, max_new_tokens: int, temperature: float,
                     top_k: int) -> jax.Array:
  model = family.build(cfg, decode=True)
  pick = functools.partial(_pick, temperature=temperature, top_k=top_k)
  cache = _empty_cache(model, prompt_BxP)
  logits_BxPxV, state = model.apply({"params": params, "cache": cache}, prompt_BxP,
                                    mutable=["cache"])
  first_B = pick(logits_BxPxV[:, -1], jax.random.fold_in(key, 0))

  def step(carry, n):  # feeds new token n − 1, picks new token n
    token_B, cache = carry
    logits_Bx1xV, state = model.apply({"params": params, "cache": cache}, token_B[:, None],
                                      mutable=["cache"])
    token_B = pick(logits_Bx1xV[:, 0], jax.random.fold_in(key, n))
    return (token_B, state["cache"]), token_B

  _, rest_NxB = jax.lax.scan(step, (first_B, state["cache"]), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([first_B[:, None], rest_NxB.T], axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_k"))
def _generate_window(params: Params, prompt_BxP: jax.Array, key: jax.Array, *,
                     cfg: family.ModelConfig, max_new_tokens: int, temperature: float,
                     top_k: int) -> jax.Array:
  """Without a cache: the whole seq_len window every step (a fixed shape, so the model is
  compiled once; causal attention makes the zeros after position t irrelevant to it)."""
  model = family.build(cfg)
  pick = functools.partial(_pick, temperature=temperature, top_k=top_k)
  b, p = prompt_BxP.shape
  window_BxL = jnp.zeros((b, cfg.seq_len), jnp.int32).at[:, :p].set(prompt_BxP)

  def step(window_BxL, t):  # picks the token at position t from the logits at t − 1
    logits_BxLxV = model.apply({"params": params}, window_BxL)
    logits_BxV = jax.lax.dynamic_index_in_dim(logits_BxLxV, t - 1, axis=1, keepdims=False)
    token_B = pick(logits_BxV, jax.random.fold_in(key, t - p))  # the cached path's keys
    return jax.lax.dynamic_update_slice(window_BxL, token_B[:, None], (0, t)), token_B

  _, tokens_NxB = jax.lax.scan(step, window_BxL, p + jnp.arange(max_new_tokens))
  return tokens_NxB.T


def check_length(cfg: family.ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """A SampleError unless the prompt and the new tokens fit in the model's window (past
  it the cache's writes would be clamped onto its last slots and the gpt family's position
  lookups read NaN, silently)."""
  if prompt_len + max_new_tokens > cfg.seq_len:
    room = cfg.seq_len - prompt_len
    fix = (f"use --max_new_tokens={room} or less" if room > 0 else
           f"shorten the prompt to at most {cfg.seq_len - 1} tokens")
    raise SampleError(f"the prompt ({prompt_len} tokens) + --max_new_tokens={max_new_tokens} "
                      f"= {prompt_len + max_new_tokens} tokens, more than model.seq_len = "
                      f"{cfg.seq_len} (the model's window): {fix}")


def generate(cfg: family.ModelConfig, params: Params, prompt_ids: Sequence[int], *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             num_samples: int = 1, use_cache: bool = True) -> np.ndarray:
  """[num_samples, max_new_tokens] int32: the tokens that follow `prompt_ids` (not
  included). `use_cache`: decode with the KV cache (built-in families; your own module
  always recomputes the window). Both paths draw with the same keys: equal logits give
  equal samples."""
  prompt = np.asarray(prompt_ids, np.int32)
  if prompt.ndim != 1 or not prompt.size:
    raise SampleError("the prompt must be a non-empty sequence of token ids")
  if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
    bad = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)][0]
    raise SampleError(f"--prompt: token {bad} is not in the model's vocabulary "
                      f"(ids 0..{cfg.vocab_size - 1})")
  check_length(cfg, prompt.size, max_new_tokens)
  if not cfg.module:  # sampling keeps no activations for a backward pass
    cfg = dataclasses.replace(cfg, remat="none")
  run = _generate_cached if use_cache and not cfg.module else _generate_window
  prompt_BxP = jnp.asarray(np.tile(prompt, (num_samples, 1)))
  tokens_BxN = run(params, prompt_BxP, jax.random.key(seed), cfg=cfg,
                   max_new_tokens=max_new_tokens, temperature=float(temperature),
                   top_k=min(top_k, cfg.vocab_size))
  return np.asarray(tokens_BxN)


# ------------------------------------------------------------------------- tokenizers


@dataclasses.dataclass(frozen=True)
class Codec:
  """The run's prompt ↔ ids. text: whether prompts and samples are text (else token ids);
  eos_id: the end-of-document token a sample stops at (None: data without one)."""
  name: str
  encode: Callable[[str], list[int]]
  decode: Callable[[list[int]], str]
  text: bool = True
  eos_id: int | None = None


def _bytes_codec(eos_id: int | None) -> Codec:
  # surrogateescape: a prompt given as non-UTF-8 bytes on the command line keeps its bytes.
  encode = lambda text: list(text.encode("utf-8", "surrogateescape"))
  decode = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")
  return Codec("bytes", encode, decode, eos_id=eos_id)


def _parse_ids(text: str) -> list[int]:
  try:
    return [int(word) for word in text.split()]
  except ValueError:
    raise SampleError(f"--prompt={text!r}: this run's data has no text (data.source "
                      "synthetic or tokens): give space-separated token ids") from None


def _ids_codec() -> Codec:
  return Codec("token ids", _parse_ids, lambda ids: " ".join(map(str, ids)), text=False)


def _prepared_codec(path: str, vocab_size: int) -> Codec:
  """The tokenizer named by the manifest of the prepared corpus at `path`."""
  where = f"config.data.path = {path!r}"
  manifest_path = os.path.join(path, prepared.MANIFEST)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    kind, name = manifest["tokenizer"]["kind"], manifest["tokenizer"]["file"]
    eos_id, corpus_vocab = int(manifest["eos_id"]), int(manifest["vocab_size"])
  except FileNotFoundError:
    raise SampleError(f"{where}: {manifest_path} is missing: the prepared corpus the run "
                      "trained on moved or was deleted, and its tokenizer with it") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SampleError(f"{where}: {manifest_path} cannot be read ({type(e).__name__}: {e})"
                      ) from None
  if corpus_vocab != vocab_size:
    raise SampleError(f"{where}: {manifest_path} has vocab_size {corpus_vocab}, the model "
                      f"{vocab_size}: the corpus was prepared again with another tokenizer")
  if kind == "bytes":
    return _bytes_codec(eos_id)
  file = os.path.join(path, name or "")
  if not name or not os.path.isfile(file):
    raise SampleError(f"{where}: the tokenizer file {file} ({kind}, named by {manifest_path}) "
                      "is missing")
  package = "sentencepiece" if kind == "sentencepiece" else "tokenizers"
  sources.require(package)  # not installed: how to install it, in one line
  try:
    encoder = tokenizer_lib.Encoder(tokenizer_lib.Spec(kind, file, vocab_size, eos_id))
    if kind == "sentencepiece":
      decode = sources.require(package).SentencePieceProcessor(model_file=file).decode
    else:
      decode = sources.require(package).Tokenizer.from_file(file).decode
  except Exception as e:  # noqa: BLE001 -- both libraries raise plain exceptions
    detail = (str(e).splitlines() or [type(e).__name__])[0]
    raise SampleError(f"{where}: the tokenizer file {file} cannot be read ({detail})"
                      ) from None
  # `prepare`'s encoding (Encoder), so a prompt is tokenized as the training text was.
  encode = lambda text: encoder.encode([text])[0].tolist()
  return Codec(kind, encode, lambda ids: decode([int(i) for i in ids]), eos_id=eos_id)


def codec_of(config) -> Codec:
  """The tokenizer of a run's config (as its checkpoint recorded it)."""
  data = config.data
  if data.source == "text":
    return _bytes_codec(None)
  if data.source == "prepared":
    return _prepared_codec(data.path, data.vocab_size)
  return _ids_codec()


def prompt_ids(codec: Codec, prompt: str) -> list[int]:
  """The prompt's ids; an empty prompt starts a document (EOS) where the data has one."""
  ids = codec.encode(prompt)
  if ids:
    return ids
  if codec.eos_id is not None:
    return [codec.eos_id]
  what = "text" if codec.text else "token ids"
  raise SampleError(f"--prompt is empty: give {what} to continue (this run's data, "
                    f"{codec.name}, has no end-of-document token to start from)")


def continuation(codec: Codec, prompt: list[int], new: Sequence[int]) -> str:
  """What the new tokens add to the prompt's text, cut at the first EOS (the document
  ended). Decoded together with the prompt, so a character or word split across the
  boundary comes out whole."""
  new = list(new)
  if codec.eos_id is not None and codec.eos_id in new:
    new = new[:new.index(codec.eos_id)]
  if not codec.text:
    return codec.decode(new)
  head, whole = codec.decode(prompt), codec.decode(prompt + new)
  return whole[len(head):] if whole.startswith(head) else codec.decode(new)


def sample(workdir: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int,
           seed: int, step: int | None, num_samples: int) -> list[str]:
  """The samples as printed: the prompt followed by what the model wrote."""
  run = trained_lib.load(workdir, step)
  codec = codec_of(run.config)
  ids = prompt_ids(codec, prompt)
  new_SxN = generate(run.model, jax.device_put(run.params), ids,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     seed=seed, num_samples=num_samples)
  # A prompt of non-UTF-8 bytes (surrogates in argv) is echoed as its decoding: printing
  # the surrogates themselves would fail.
  shown = prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
  sep = "" if codec.text else " "
  return [shown + sep + continuation(codec, ids, new) for new in new_SxN]
