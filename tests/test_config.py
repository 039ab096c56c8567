"""Config validation: every rule rejects its bad value with an error naming the field."""

import importlib.util
import math
import os

import pytest

from diloco_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_default_and_tiny_are_valid():
  config_lib.validate(config_lib.get_default_config())
  config_lib.validate(load_config("tiny"))


def test_gpt_150m_valid_once_given_data(tmp_path):
  config = load_config("gpt_150m")
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.path"):
    config_lib.validate(config)
  config.data.path = str(tmp_path)  # a prepared directory (its files are checked later)
  config_lib.validate(config, num_local_devices=8)


def test_peer_valid_once_given_data(tmp_path):
  """configs/peer.py (bench/peer.py's side-by-side with torchft): text of bytes, one
  replica per host, a flat lr, no biases."""
  config = load_config("peer")
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.path"):
    config_lib.validate(config)
  (tmp_path / "a.py").write_text("x = 1\n" * 1000)
  config.data.path = str(tmp_path)
  config_lib.validate(config, num_hosts=2)
  assert not config.model.use_bias and not config.model.tie_embeddings
  assert config.inner.warmup_steps == 0 and config.inner.final_lr_fraction == 1.0


@pytest.mark.parametrize("name", ["small_text", "eager", "sparseloco", "muloco"])
def test_small_text_family_valid_on_two_hosts(name, tmp_path):
  """configs/small_text.py and the configs built on it (bench/quality.py's methods) pass
  validation on 2 hosts once their prepared corpus is there, each in its own mode."""
  config = load_config(name)
  config.data.path = str(tmp_path)
  config_lib.validate(config, num_hosts=2)
  assert config.mode == ("eager" if name == "eager" else "sync")


# (field, bad value, fragment of the message); one case per rule.
CASES = [
    ("mode", "async", "one of"),
    ("num_rounds", -1, ">= 0 (0: the initial model only)"),
    ("inner_steps", -1, ">= 1"),
    ("replicas_per_host", 0, ">= 1"),
    ("batch_size", 0, ">= 1"),
    ("grad_accum_steps", 0, ">= 1"),
    ("eval_every", 0, ">= 1"),
    ("eval_batches", 0, ">= 1"),
    ("model.num_layers", 0, ">= 1"),
    ("model.d_model", 0, ">= 1"),
    ("model.num_heads", 0, ">= 1"),
    ("model.mlp_dim", 0, ">= 1"),
    ("model.seq_len", 0, ">= 1"),
    ("model.num_heads", 3, "divisible by config.model.num_heads"),
    ("model.dtype", "float64", "one of"),
    ("data.source", "web", "one of"),
    ("data.sharding", "random", "one of"),
    ("data.vocab_size", 1, ">= 2"),
    ("data.eval_fraction", 1.0, "(0, 1)"),
    ("data.markov_order", 0, ">= 1"),
    ("data.branching", 33, "[1, config.data.vocab_size"),
    ("data.markov_order", 5, "2**20"),
    ("data.num_sequences", 10, ">= replicas_per_host x batch_size"),
    ("data.num_eval_sequences", 10, ">= eval_batches x batch_size"),
    ("inner.lr", 0.0, "> 0"),
    ("inner.lr", math.nan, "finite"),
    ("inner.lr", math.inf, "finite"),
    ("inner.warmup_steps", -1, "[0, num_rounds x inner_steps"),
    ("inner.warmup_steps", 10 ** 6, "[0, num_rounds x inner_steps"),
    ("inner.final_lr_fraction", 1.5, "[0, 1]"),
    ("inner.weight_decay", -0.1, ">= 0"),
    ("inner.b1", 1.0, "[0, 1)"),
    ("inner.b2", -0.1, "[0, 1)"),
    ("inner.eps", 0.0, "> 0"),
    ("inner.clip_norm", -1.0, ">= 0"),
    ("outer.lr", -1.0, "> 0"),
    ("outer.momentum", 1.0, "[0, 1)"),
    ("outer.momentum", -0.5, "[0, 1)"),
    ("outer.nesterov", 1, "must be a finite bool"),
    ("model.use_bias", 0, "must be a finite bool"),
    ("num_rounds", 2.5, "must be a finite int"),
    ("num_rounds", True, "must be a finite int"),
    ("data.path", 3, "must be a finite str"),
    ("outer.max_skipped_rounds", 0, ">= 1"),
    ("checkpoint.every", -1, ">= 0"),
    ("checkpoint.keep", 0, ">= 1"),
    ("wire_timeout", 0, ">= 1"),
    ("outer.fragments", 2, "'streaming' only"),
    ("outer.overlap_steps", 1, "'streaming' only"),
    ("outer.merge_alpha", 0.5, "'streaming' only"),
    ("outer.compression", "fp4", "one of"),
    ("outer.topk_fraction", 0.0, "(0, 1]"),
    ("outer.trim", 0.5, "[0, 0.5)"),
    ("outer.aggregation", "mode", "one of"),
    ("outer.aggregation", "trimmed_mean", "K >= 5"),  # K = 4 replicas on one host
]


def set_field(config, dotted, value):
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    node = node[p]
  with node.ignore_type():
    node[leaf] = value


@pytest.mark.parametrize("field, value, message", CASES)
def test_rule(field, value, message):
  config = config_lib.get_default_config()
  set_field(config, field, value)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert f"config.{field}" in str(e.value)
  assert message in str(e.value)


def test_batch_split_over_devices():
  config = config_lib.get_default_config()
  config.batch_size = 6
  config.grad_accum_steps = 1
  config_lib.validate(config, num_local_devices=2)
  with pytest.raises(config_lib.ConfigError, match="local devices"):
    config_lib.validate(config, num_local_devices=4)
  config.grad_accum_steps = 4
  with pytest.raises(config_lib.ConfigError, match=r"config\.batch_size.*grad_accum_steps"):
    config_lib.validate(config)


@pytest.mark.parametrize("source, field, extra", [
    ("text", "config.data.path", {"vocab_size": 256}),
    ("text", "config.data.vocab_size", {"path": REPO}),
    ("tokens", "config.data.path", {}),
    ("tokens", "config.data.token_dtype", {"path": __file__, "token_dtype": "int8"}),
    ("tokens", "config.data.vocab_size", {"path": __file__, "vocab_size": 70000}),
    ("text", "config.data.sharding", {"path": REPO, "vocab_size": 256,
                                      "sharding": "non_iid"}),
])
def test_file_sources(source, field, extra):
  config = config_lib.get_default_config()
  config.data.source = source
  config.data.update(extra)
  with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
    config_lib.validate(config)


def test_all_errors_reported_at_once():
  config = config_lib.get_default_config()
  config.outer.lr = -1.0
  config.inner.eps = 0.0
  config.mode = "bogus"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  for field in ("config.outer.lr", "config.inner.eps", "config.mode"):
    assert field in str(e.value)


def test_unknown_and_missing_fields():
  config = config_lib.get_default_config()
  config.outer.lr_ = 0.5
  del config.inner["eps"]
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert "config.outer.lr_: unknown field; did you mean config.outer.lr?" in str(e.value)
  assert "config.inner.eps: missing" in str(e.value)


@pytest.mark.parametrize("changes, field, message", [
    ({"outer.fragments": 3}, "outer.fragments", "[1, config.model.num_layers = 2]"),
    ({"outer.fragments": 2, "inner_steps": 5}, "inner_steps", "divisible by"),
    ({"outer.fragments": 2, "outer.overlap_steps": 25}, "outer.overlap_steps",
     "[0, inner_steps / fragments = 25)"),
    ({"outer.merge_alpha": 1.0}, "outer.merge_alpha", "[0, 1)"),
    ({"outer.fragment_layout": "random"}, "outer.fragment_layout", "one of"),
])
def test_streaming_rules(changes, field, message):
  config = config_lib.get_default_config()
  config.mode = "streaming"
  config_lib.validate(config)
  for key, value in changes.items():
    set_field(config, key, value)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert f"config.{field}" in str(e.value) and message in str(e.value), str(e.value)


def test_robust_aggregation_needs_enough_replicas_across_hosts():
  """K counts every host's replicas: 2 hosts x 4 = 8 replicas trim one from each end."""
  config = config_lib.get_default_config()
  config.outer.aggregation = "trimmed_mean"
  with pytest.raises(config_lib.ConfigError, match="K = 4 replicas"):
    config_lib.validate(config)
  config_lib.validate(config, num_hosts=2)
  config.outer.aggregation = "median"
  config.replicas_per_host = 2
  with pytest.raises(config_lib.ConfigError, match="K >= 3"):
    config_lib.validate(config)


@pytest.mark.parametrize("changes, field", [
    ({"mode": "eager", "outer.aggregation": "median"}, "outer.aggregation"),
    ({"mode": "ddp", "outer.compression": "int8"}, "outer.compression"),
])
def test_wire_settings_refused_where_they_would_do_nothing_or_be_wrong(changes, field):
  config = config_lib.get_default_config()
  for key, value in changes.items():
    set_field(config, key, value)
  with pytest.raises(config_lib.ConfigError, match=rf"config\.{field}"):
    config_lib.validate(config)


def test_live_membership_takes_every_wire_format_and_rule():
  """A job whose hosts come and go sends what a fixed one does: compression, robust
  aggregation (checked at the job's full K; a round with fewer falls back to the mean)
  and balance 'speed' (weights over the hosts present)."""
  for changes in ({"outer.compression": "chunk_topk", "outer.error_feedback": True,
                   "outer.error_feedback_decay": 0.9},
                  {"outer.compression": "4bit", "mode": "eager"},
                  {"outer.aggregation": "trimmed_mean", "outer.trim": 0.25},
                  {"balance": "speed"}):
    config = config_lib.get_default_config()
    for key, value in changes.items():
      set_field(config, key, value)
    config_lib.validate(config, num_hosts=2)


@pytest.mark.parametrize("changes, message", [
    ({"balance": "window"}, "is not built"),
    ({"balance": "speed", "mode": "ddp"}, "ddp's hosts all-reduce every step"),
    ({"balance": "speed", "mode": "streaming"}, "streaming's fragments sync"),
    ({"balance": "speed", "outer.aggregation": "median"}, "no token-weighted form"),
    ({"balance_every": 0}, ">= 1"),
    ({"balance_tolerance": 1.0}, "[0, 1)"),
    ({"balance_max_factor": 0}, ">= 1"),
])
def test_balance_rules(changes, message):
  """Each bad use of config.balance is one line naming the field."""
  config = config_lib.get_default_config()
  for key, value in changes.items():
    set_field(config, key, value)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config, num_hosts=8)  # 32 replicas: enough for a median
  lines = str(e.value).splitlines()
  assert len(lines) == 1 and lines[0].startswith("config.balance"), lines
  assert message in lines[0], lines


def test_a_checkpoint_of_an_earlier_gpt_reads_as_it_was_trained():
  """A saved config without model.head_bias (earlier versions) had a gpt head bias with
  use_bias and flax's LayerNorm epsilon; one with the field is taken as saved."""
  earlier = config_lib.from_saved({"model": {"family": "gpt", "use_bias": True}})
  assert (earlier.model.head_bias, earlier.model.norm_eps) == (True, 1e-6)
  unbiased = config_lib.from_saved({"model": {"family": "gpt", "use_bias": False}})
  assert (unbiased.model.head_bias, unbiased.model.norm_eps) == (False, 1e-6)
  llama = config_lib.from_saved({"model": {"family": "llama", "norm_eps": 1e-5}})
  assert (llama.model.head_bias, llama.model.norm_eps) == (False, 1e-5)
  now = config_lib.get_default_config().to_dict()
  assert config_lib.from_saved(now).to_dict() == now
