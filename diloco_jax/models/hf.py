"""The built-in families in Hugging Face's layouts, both ways: tensor names and config.json.

  llama  `LlamaForCausalLM`: model.embed_tokens.weight [V, D],
         model.layers.{i}.self_attn.{q,k,v,o}_proj.weight and
         model.layers.{i}.mlp.{gate,up,down}_proj.weight (torch Linear weights, [out, in]:
         our kernels transposed), model.layers.{i}.{input,post_attention}_layernorm.weight,
         model.norm.weight, lm_head.weight [V, D] (absent when tied). Our rotary
         embedding is Hugging Face's half-split one: q and k need no permutation.
  gpt    `GPT2LMHeadModel`: transformer.wte.weight [V, D], transformer.wpe.weight [P, D],
         transformer.h.{i}.{ln_1,ln_2}.{weight,bias}, transformer.h.{i}.attn.c_attn (the
         fused qkv: q, k, v, each heads-major, as ours), attn.c_proj, mlp.c_fc, mlp.c_proj
         (GPT-2's Conv1D weights are [in, out], as our kernels: not transposed),
         transformer.ln_f, lm_head.weight [V, D] (absent when tied). GELU is the tanh
         approximation ("gelu_new"). A gpt without biases (`use_bias` False) is written
         with zero biases, which is the same function; a head bias (`head_bias`) has no
         GPT-2 counterpart (`expressible` says so).

`names(cfg)` lists every tensor; `config_json(cfg)` writes a config.json that
`AutoModelForCausalLM` reads; `model_fields(config)` reads one back into config.model's
fields (what `init_from` takes over), refusing what our families do not compute.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

from diloco_jax import errors
from diloco_jax.models import family

ARCHITECTURES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt"}
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # GPT-2's names of what nn.gelu computes


class Tensor(NamedTuple):
  """One tensor of the file: our flax path (None: zeros of `zeros` shape, a bias our model
  lacks), its Hugging Face name, and whether our kernel is its transpose."""
  path: tuple[str, ...] | None
  name: str
  transposed: bool = False
  zeros: tuple[int, ...] = ()


class UnsupportedError(errors.DilocoError, ValueError):
  """A Hugging Face config our families do not compute; the message names the field."""
  prefix = "Unsupported model"


def expressible(cfg: family.ModelConfig) -> str | None:
  """Why `cfg` has no Hugging Face layout (None: it has one)."""
  if cfg.module:
    return f"a model of your own module ({cfg.module}) has no Hugging Face class"
  if cfg.family == "gpt" and cfg.head_bias:
    return "a gpt with a bias in its head (config.model.head_bias) has no GPT-2 counterpart"
  return None


def _llama(cfg: family.ModelConfig) -> list[Tensor]:
  out = [Tensor(("embed", "embedding"), "model.embed_tokens.weight")]
  linear = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "attn_out": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj"}
  norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
  for i in range(cfg.num_layers):
    block, layer = f"block_{i}", f"model.layers.{i}"
    out += [Tensor((block, ours, "kernel"), f"{layer}.{hf}.weight", True)
            for ours, hf in linear.items()]
    out += [Tensor((block, ours, "scale"), f"{layer}.{hf}.weight") for ours, hf in norms.items()]
  out.append(Tensor(("final_norm", "scale"), "model.norm.weight"))
  if not cfg.tie_embeddings:
    out.append(Tensor(("head", "kernel"), "lm_head.weight", True))
  return out


def _gpt(cfg: family.ModelConfig) -> list[Tensor]:
  d, m = cfg.d_model, cfg.mlp_dim

  def bias(path: tuple[str, ...], name: str, width: int) -> Tensor:
    return Tensor(path if cfg.use_bias else None, name, zeros=() if cfg.use_bias else (width,))

  out = [Tensor(("embed", "embedding"), "transformer.wte.weight"),
         Tensor(("pos_embed",), "transformer.wpe.weight")]
  norms = {"ln_attn": "ln_1", "ln_mlp": "ln_2"}
  linear = {"qkv": ("attn.c_attn", 3 * d), "attn_out": ("attn.c_proj", d),
            "mlp_in": ("mlp.c_fc", m), "mlp_out": ("mlp.c_proj", d)}
  for i in range(cfg.num_layers):
    block, layer = f"block_{i}", f"transformer.h.{i}"
    for ours, hf in norms.items():
      out += [Tensor((block, ours, "scale"), f"{layer}.{hf}.weight"),
              bias((block, ours, "bias"), f"{layer}.{hf}.bias", d)]
    for ours, (hf, width) in linear.items():
      out += [Tensor((block, ours, "kernel"), f"{layer}.{hf}.weight"),
              bias((block, ours, "bias"), f"{layer}.{hf}.bias", width)]
  out += [Tensor(("ln_final", "scale"), "transformer.ln_f.weight"),
          bias(("ln_final", "bias"), "transformer.ln_f.bias", d)]
  if not cfg.tie_embeddings:
    out.append(Tensor(("head", "kernel"), "lm_head.weight", True))
  return out


def names(cfg: family.ModelConfig) -> list[Tensor]:
  """Every tensor of `cfg`'s Hugging Face layout (`expressible(cfg)` must be None)."""
  return _llama(cfg) if cfg.family == "llama" else _gpt(cfg)


def config_json(cfg: family.ModelConfig, eos_id: int | None, dtype: str) -> dict[str, Any]:
  """Hugging Face's config fields of `cfg` (LlamaConfig or GPT2Config). Documents are
  packed, each followed by EOS, so EOS is also what precedes a document's first token:
  it is the BOS too (None, unknown, rather than the classes' defaults, which mean nothing
  for our vocabularies)."""
  common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": dtype, "bos_token_id": eos_id, "eos_token_id": eos_id}
  if cfg.family == "llama":
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.d_model // cfg.num_heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.positions,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
            "attention_bias": False, "mlp_bias": False, **common}
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
          "n_embd": cfg.d_model, "n_inner": cfg.mlp_dim, "n_layer": cfg.num_layers,
          "n_head": cfg.num_heads, "n_positions": cfg.positions,
          "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
          "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
          "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
          "attn_pdrop": 0.0, **common}


def _rope_theta(c: dict[str, Any]) -> float:
  """The rotary base of a Llama config: `rope_theta` (transformers 4) or
  `rope_parameters` (5), refusing scaled variants (llama3, yarn, ...), which ours is not."""
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or {}
  kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
  if kind != "default":
    raise UnsupportedError(f"rope type {kind!r}: only the unscaled rotary embedding is "
                           "computed")
  return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _require(c: dict[str, Any], field: str, allowed: tuple, default: Any) -> None:
  value = c.get(field, default)
  if value not in allowed:
    raise UnsupportedError(f"{field} = {value!r}: only {' or '.join(map(repr, allowed))} is "
                           "computed")


def model_fields(c: dict[str, Any]) -> dict[str, Any]:
  """config.model's fields from a Hugging Face config.json (UnsupportedError for a config
  our families compute differently, naming the field)."""
  arch = (c.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise UnsupportedError(f"architecture {arch!r}: supported are "
                           f"{', '.join(ARCHITECTURES)}")
  try:
    if ARCHITECTURES[arch] == "llama":
      heads = int(c["num_attention_heads"])
      if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise UnsupportedError(f"head_dim = {c['head_dim']}: only hidden_size / "
                               f"num_attention_heads = {c['hidden_size'] // heads} is computed")
      _require(c, "hidden_act", ("silu",), "silu")
      _require(c, "attention_bias", (False,), False)
      _require(c, "mlp_bias", (False,), False)
      return {"family": "llama", "vocab_size": int(c["vocab_size"]),
              "d_model": int(c["hidden_size"]), "num_layers": int(c["num_hidden_layers"]),
              "num_heads": heads, "num_kv_heads": int(c.get("num_key_value_heads") or heads),
              "mlp_dim": int(c["intermediate_size"]), "norm_eps": float(c["rms_norm_eps"]),
              "rope_base": _rope_theta(c),
              "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
              "max_positions": int(c.get("max_position_embeddings", 0)), "module": ""}
    _require(c, "activation_function", GELU_TANH, "gelu_new")
    _require(c, "scale_attn_weights", (True,), True)
    _require(c, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(c, "add_cross_attention", (False,), False)
    d = int(c["n_embd"])
    return {"family": "gpt", "vocab_size": int(c["vocab_size"]), "d_model": d,
            "num_layers": int(c["n_layer"]), "num_heads": int(c["n_head"]),
            "mlp_dim": int(c.get("n_inner") or 4 * d),
            "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
            "max_positions": int(c["n_positions"]), "use_bias": True, "head_bias": False,
            "module": ""}
  except KeyError as e:
    raise UnsupportedError(f"no field {e.args[0]!r} (needed by {arch})") from None
  except (TypeError, ValueError) as e:
    if isinstance(e, UnsupportedError):
      raise
    raise UnsupportedError(f"a field of {arch} is not a number: {e}") from None
