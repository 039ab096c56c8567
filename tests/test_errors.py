"""Errors at start-up: one line on stderr that names the field or file, exit status 1, no
traceback, before anything is compiled; --help and --print_config exit 0. Every error the
package defines has one base, which ends `train` in one line too."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax.checkpoints import store
from diloco_jax.data import files as data_files
from diloco_jax.data import pipeline as data_lib
from diloco_jax.device import mesh
from diloco_jax.loop import pacing
from diloco_jax.models import family
from diloco_jax.models import layers
from diloco_jax.models import model as model_lib
from diloco_jax.modes import registry
from diloco_jax.wire import integrity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "--config=configs/tiny.py"


def run_cli(*args, platforms="cpu"):
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "diloco_jax.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": platforms})
  return proc, time.perf_counter() - start


def error_line(*args) -> str:
  """Runs the CLI, checks that it failed with one line on stderr, and returns the line."""
  proc, _ = run_cli(*args)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 1, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, output[-3000:]
  return lines[0]


# ----------------------------------------------------------------------- flags and files

def test_misspelled_field():
  assert error_line(TINY, "--workdir=/tmp/unused", "--config.outer.lrr=0.5") == (
      "Invalid config: config.outer.lrr: unknown field; did you mean config.outer.lr?")


def test_misspelled_group():
  assert error_line(TINY, "--config.outr.lr=0.5") == (
      "Invalid config: config.outr.lr: unknown field; did you mean config.outer.lr?")


@pytest.mark.parametrize("override, expected", [
    ("--config.inner_steps=abc", "config.inner_steps = 'abc': must be an int"),
    ("--config.outer.lr=fast", "config.outer.lr = 'fast': must be a number"),
    ("--config.outer.nesterov=maybe", "config.outer.nesterov = 'maybe': must be true or false"),
])
def test_malformed_value(override, expected):
  assert error_line(TINY, "--workdir=/tmp/unused", override) == f"Invalid config: {expected}"


def test_bad_value_from_validation(tmp_path):
  assert error_line(TINY, f"--workdir={tmp_path}", "--config.outer.lr=-1") == (
      "Invalid config: config.outer.lr = -1.0: must be > 0")


def test_missing_config_file():
  assert error_line("--config=configs/nope.py", "--workdir=/tmp/unused") == (
      "Config file not found: configs/nope.py")
  # With an override, ml_collections fails while parsing rather than at first use.
  assert error_line("--config=configs/nope.py", "--config.seed=1") == (
      "Config file not found: configs/nope.py")


def test_config_file_that_fails(tmp_path):
  path = tmp_path / "broken.py"
  path.write_text("def get_config():\n  return undefined_name\n")
  assert error_line(f"--config={path}") == (
      f"Config file {path}, line 2: NameError: name 'undefined_name' is not defined")


def test_required_flags():
  assert error_line("--workdir=/tmp/unused").startswith("Missing --config:")
  assert error_line(TINY).startswith("Missing --workdir:")


def test_help_exits_0_and_lists_the_flags():
  proc, _ = run_cli("--help")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for flag in ("--config", "--workdir", "--print_config", "--num_hosts"):
    assert flag in proc.stdout


def test_print_config():
  # An unknown platform: any use of a JAX device would fail.
  proc, _ = run_cli(TINY, "--print_config", "--config.outer.lr=0.5", platforms="nodevice")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  docs = config_lib.field_docs()
  for name in config_lib.flatten(config_lib.get_default_config()):
    line = next(line for line in lines if line.startswith(f"{name} = "))
    assert line.rstrip().endswith(docs[name][0]) or f"# {docs[name][0]} (default" in line
  assert "config.model.d_model = 64" in proc.stdout  # configs/tiny.py's value
  assert any(line.startswith("config.outer.lr = 0.5 ") and line.endswith("(default: 0.7)")
             for line in lines)
  assert "# Streaming DiLoCo" in proc.stdout  # section notes head their fields


@pytest.mark.parametrize("args", [
    ("diloco_jax.train", "--help"), ("diloco_jax.train", TINY, "--print_config"),
    ("diloco_jax.prepare", "--help"), ("diloco_jax.sample", "--help"),
    ("diloco_jax.export", "--help")], ids=["train", "print_config", "prepare", "sample", "export"])
def test_help_imports_no_jax(args):
  """--help and --print_config answer at once: jax, orbax and the trainer (a second and
  more to import) come in only when a command runs (measured: 1.3-4.5 s before, 0.1-0.6 s
  after, on 2 busy cores)."""
  proc = subprocess.run([sys.executable, "-X", "importtime", "-m", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  imported = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines()
              if line.startswith("import time:")}
  assert "diloco_jax" in imported  # the importtime lines were read
  heavy = imported & {"jax", "flax", "orbax.checkpoint", "diloco_jax.loop.trainer"}
  assert not heavy, heavy


# ----------------------------------------------------------------------------- data

def _data_args(tmp_path, source, path, *extra):
  return (TINY, f"--workdir={tmp_path / 'work'}", f"--config.data.source={source}",
          f"--config.data.path={path}", *extra)


def test_empty_text_file(tmp_path):
  path = tmp_path / "empty.txt"
  path.write_bytes(b"")
  line = error_line(*_data_args(tmp_path, "text", path, "--config.data.vocab_size=256"))
  assert line.startswith(f"Invalid config: config.data.path = '{path}': holds 0 bytes of "
                         "text (a token per byte); needs at least 163,841 tokens: 2,560 "
                         "windows of config.model.seq_len = 64"), line


def test_empty_directory(tmp_path):
  (tmp_path / "data").mkdir()
  line = error_line(*_data_args(tmp_path, "text", tmp_path / "data",
                                "--config.data.vocab_size=256"))
  assert "config.data.path" in line and "no text files to read (it is empty" in line, line


def test_directory_of_skipped_files(tmp_path):
  data = tmp_path / "data"
  (data / "__pycache__").mkdir(parents=True)
  (data / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"x" * 10**6)
  (data / ".git").mkdir()
  (data / ".git" / "HEAD").write_bytes(b"x" * 10**6)
  (data / ".notes").write_bytes(b"x" * 10**6)
  line = error_line(*_data_args(tmp_path, "text", data, "--config.data.vocab_size=256"))
  assert (f"config.data.path = '{data}': a directory with no text files to read (found "
          "only .git, .notes, __pycache__;") in line, line


def test_token_file_too_short(tmp_path):
  path = tmp_path / "tokens.bin"
  np.arange(1000, dtype=np.int32).tofile(path)
  line = error_line(*_data_args(tmp_path, "tokens", path, "--config.data.token_dtype=int32",
                                "--config.data.vocab_size=1000"))
  assert f"config.data.path = '{path}': holds 4,000 bytes = 1,000 int32 tokens; needs at " \
         "least 163,841 tokens" in line, line


def test_token_file_of_another_dtype(tmp_path):
  path = tmp_path / "tokens.bin"
  path.write_bytes(b"\0" * 4001)
  line = error_line(*_data_args(tmp_path, "tokens", path, "--config.data.token_dtype=int32",
                                "--config.data.vocab_size=1000"))
  assert "4,001 bytes is not a whole number of int32 tokens" in line, line


@pytest.mark.parametrize("extra", [0, -1])
def test_minimum_data_is_exact(tmp_path, extra):
  """The size the check asks for is what make_host_data needs: one token less fails."""
  c = config_lib.get_default_config().data
  c.update(dict(source="tokens", token_dtype="int32", vocab_size=1000, eval_fraction=0.1))
  args = dict(seq_len=8, batch_size=4, replicas_per_host=3, num_eval_batches=2)
  need = data_files.min_windows(3 * 4, 2 * 4, 0.1) * 8 + 1
  c.path = str(tmp_path / "tokens.bin")
  (np.arange(need + extra) % 1000).astype(np.int32).tofile(c.path)
  if extra == 0:
    data_lib.make_host_data(c, **args)
  else:
    with pytest.raises(config_lib.ConfigError, match=f"needs at least {need} tokens"):
      data_lib.make_host_data(c, **args)


def test_text_files_skip_hidden_and_pycache(tmp_path):
  for name in ("a.txt", "sub/b.txt", "sub/.swp", ".git/config", "__pycache__/m.pyc"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("text")
  used, skipped = data_files.text_files(str(tmp_path))
  assert used == [str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.txt")]
  assert skipped == [str(tmp_path / n) for n in (".git", "__pycache__", "sub/.swp")]


# ----------------------------------------------------------------------------- memory

def test_huge_vocab_refused_before_allocation(tmp_path):
  path = tmp_path / "tokens.bin"
  (np.arange(200_000) % 1000).astype(np.int32).tofile(path)
  proc, seconds = run_cli(*_data_args(tmp_path, "tokens", path, "--config.data.token_dtype=int32",
                                      "--config.data.vocab_size=1000000000"))
  output = proc.stdout + proc.stderr
  assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
  assert len(proc.stderr.splitlines()) == 1, output[-3000:]
  assert proc.stderr.startswith("Invalid config: config.model / config.data.vocab_size"), output
  assert "of memory" in proc.stderr and "128,000,104,192 params" in proc.stderr, output
  assert seconds < 30  # before: killed by the kernel after about a minute, no message


@pytest.mark.parametrize("vocab_size", [16, 1000])
def test_param_count_from_shapes(vocab_size):
  cfg = family.ModelConfig(vocab_size=vocab_size, seq_len=8, num_layers=2, d_model=16,
                            num_heads=2, mlp_dim=24)
  params = model_lib.init_params(cfg, jax.random.key(0))
  assert model_lib.num_params_of(cfg) == model_lib.count_params(params)


def test_memory_check_figures(monkeypatch):
  config = config_lib.get_default_config()
  profile = lambda: registry.driver(config.mode).memory_profile(config)  # sync DiLoCo's
  mesh.check_memory(config, config.data.vocab_size, 1, profile())  # small: fits this machine
  config.model.update(num_layers=8, d_model=1024, mlp_dim=4096)  # 101M params
  config.replicas_per_host = 64
  n = model_lib.num_params_of(family.ModelConfig.from_config(config.model, 32))
  monkeypatch.setattr(mesh, "device_memory_limit", lambda: 60 * 2**30)
  monkeypatch.setattr(mesh, "host_memory_available", lambda: 1000 * 2**30)
  with pytest.raises(config_lib.ConfigError) as e:
    mesh.check_memory(config, 32, 1, profile())
  (line,) = str(e.value).splitlines()
  state = 64 * 12 * n / 2**30  # 64 replicas' float32 params and two AdamW moments
  assert line.startswith("config.model / config.replicas_per_host: needs about ")
  assert f"more than the 60.0 GiB a device has: {n:,} params" in line
  assert f"state {state:.1f} GiB (64 x params + 2 AdamW moments, float32)" in line
  monkeypatch.setattr(mesh, "device_memory_limit", lambda: 1000 * 2**30)
  monkeypatch.setattr(mesh, "host_memory_available", lambda: 2**30)
  with pytest.raises(config_lib.ConfigError, match=r"of host memory, more than the 1\.0 GiB"):
    mesh.check_memory(config, 32, 1, profile())  # the outer state of 64 replicas, on the host
  # Most params in the embedding: the vocabulary is named, the model's own where it has
  # one (a pretrained model's), else the data's.
  monkeypatch.setattr(mesh, "host_memory_available", lambda: 1000 * 2**30)
  monkeypatch.setattr(mesh, "device_memory_limit", lambda: 2**30)
  config.model.update(num_layers=1, d_model=512, mlp_dim=512)
  config.replicas_per_host = 1
  for model_vocab, named in ((0, "config.data.vocab_size"), (200_000, "config.model.vocab_size")):
    config.model.vocab_size = model_vocab
    with pytest.raises(config_lib.ConfigError, match=f"^config.model / {named} / "):
      mesh.check_memory(config, 200_000, 1, profile())


def test_every_field_documented():
  docs = config_lib.field_docs()
  for name in config_lib.flatten(config_lib.get_default_config()):
    assert docs.get(name, ("",))[0], f"{name}: no trailing comment in get_default_config()"


# ------------------------------------------------------------------ the package's errors


def test_every_error_the_package_defines_has_one_base():
  """The entry points catch `errors.DilocoError` alone: an exception class of the package
  outside it would end in a traceback."""
  import importlib  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel
  import pkgutil  # pylint: disable=import-outside-toplevel

  import diloco_jax  # pylint: disable=import-outside-toplevel
  inside, outside = set(), set()
  for info in pkgutil.walk_packages(diloco_jax.__path__, "diloco_jax."):
    for c in vars(importlib.import_module(info.name)).values():
      if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == info.name:
        (inside if issubclass(c, errors.DilocoError) else outside).add(c.__name__)
  assert outside == set(), outside
  assert {"ConfigError", "CheckpointError", "AnchorMismatchError", "BalanceError",
          "InputError", "SampleError", "ExportError", "PlanError"} <= inside, inside


def test_describe_puts_the_prefix_on_every_line():
  assert errors.describe(config_lib.ConfigError("config.a = 1: bad\nconfig.b: unknown")) == (
      "Invalid config: config.a = 1: bad\nInvalid config: config.b: unknown")
  assert errors.describe(pacing.BalanceError("round 1: differ")) == "Stopped: round 1: differ"
  assert errors.describe(store.CheckpointError("gone")) == "Checkpoint error: gone"
  assert errors.describe(store.CheckpointError("gone"), "sample") == "sample: gone"
  assert errors.describe(store.CheckpointError("gone"), "") == "gone"
  assert isinstance(pacing.BalanceError("x"), RuntimeError)  # callers still catch these
  assert isinstance(layers.AttentionError("x"), ValueError)


def test_anchor_mismatch_ends_in_one_line(tmp_path):
  """An error no entry point names (the hosts' outer states differ) ends `train` in one
  line with its prefix, exit status 1, no traceback."""
  hashes = {0: "aa" * 32, 1: "bb" * 32, 2: "aa" * 32}
  script = ("import sys\n"
            "from absl import app\n"
            "from diloco_jax import train\n"
            "from diloco_jax.loop import trainer\n"
            "from diloco_jax.wire import integrity\n"
            "def diverged(*args, **kwargs):\n"
            f"  raise integrity.AnchorMismatchError(integrity.mismatch_message(2, {hashes}))\n"
            "trainer.train_and_evaluate = diverged\n"
            "app.run(train.main, flags_parser=train.parse_flags)\n")
  proc = subprocess.run([sys.executable, "-c", script, TINY, f"--workdir={tmp_path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert (proc.returncode, proc.stderr) == (
      1, f"Stopped: {integrity.mismatch_message(2, hashes)}\n"), proc.stdout + proc.stderr
  assert "host 1 diverged from the others" in proc.stderr
