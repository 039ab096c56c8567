"""compile_cache: a program kept whole is run again without a trace, with the same bits,
and never once anything it was built from has changed."""

import importlib
import os
import pickle
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax import compile_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """Programs kept whole in tmp_path/executables: JAX's cache directory set to tmp_path, as
  the entry point sets it (compile_cache.use), for the session's, which the environment
  names (conftest.py), keeps none."""
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  session = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  yield tmp_path / "executables"
  jax.config.update("jax_compilation_cache_dir", session)


def program(traces: list):
  """`lower`, which traces a new function at each call (JAX's trace cache would hide a
  second trace of one function object: `traces` counts them all), and its arguments."""
  def lower():
    def f(x, y):
      traces.append(1)  # at trace time only
      return {"out": jnp.tanh(x @ y) * 1.7, "sum": jnp.sum(y)}
    return jax.jit(f).lower(x, y)
  x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
  y = jnp.cos(jnp.arange(8, dtype=jnp.float32)).reshape(4, 2)
  return lower, (x, y)


def test_a_kept_program_runs_again_without_a_trace_and_computes_the_same_bits(cache):
  traces = []
  lower, args = program(traces)
  first = compile_cache.compiled("f", {"v": 1}, lower, facts=lambda p: {"flops": 3})
  assert traces == [1] and first.facts == {"flops": 3}
  assert len(os.listdir(cache)) == 1
  again = compile_cache.compiled("f", {"v": 1}, lower, facts=lambda p: {"flops": -1})
  assert traces == [1]  # loaded: neither traced nor compiled
  assert again.facts == {"flops": 3}  # the writer's facts, not computed again
  a, b = first.program(*args), again.program(*args)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  with pytest.raises(TypeError):  # the loaded program checks its arguments as any does
    again.program(args[1], args[0])


def test_another_spec_devices_cpu_or_an_edited_source_file_miss(cache, tmp_path, monkeypatch):
  module = tmp_path / "kept_program_source.py"
  module.write_text("SCALE = 2.0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.import_module("kept_program_source")  # loaded when the entry is written
  try:
    lower, _ = program([])
    compile_cache.compiled("f", {"v": 1}, lower)
    assert compile_cache.load("f", {"v": 1}) is not None
    assert compile_cache.load("f", {"v": 2}) is None
    assert compile_cache.load("f", {"v": 1}, devices=jax.devices()) is not None
    assert compile_cache.load("f", {"v": 1}, devices=[]) is None
    with monkeypatch.context() as m:  # the same workdir, its host now another machine type
      m.setattr(compile_cache, "_cpu", lambda: ["a CPU without this one's instructions"])
      assert compile_cache.load("f", {"v": 1}) is None
    module.write_text("SCALE = 3.0\n")  # a new modification time: not the entry's code
    assert compile_cache.load("f", {"v": 1}) is None
    compile_cache.compiled("f", {"v": 1}, lower)  # compiled again, and kept in its place
    assert compile_cache.load("f", {"v": 1}) is not None and len(os.listdir(cache)) == 1
    os.utime(module, ns=(0, 0))  # the same size, another modification time
    assert compile_cache.load("f", {"v": 1}) is None
  finally:
    sys.modules.pop("kept_program_source", None)


def test_a_new_size_under_the_old_mtime_an_xla_flag_or_a_jax_config_value_miss(
    cache, tmp_path, monkeypatch):
  """Each part of the key alone: a source file whose size changed while its modification
  time was put back (a copy that keeps times, a file system of coarse times), another
  XLA_FLAGS (XLA builds other code), another value of a jax config option."""
  module = tmp_path / "kept_program_sized.py"
  module.write_text("SCALE = 2.0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.import_module("kept_program_sized")
  try:
    lower, _ = program([])
    compile_cache.compiled("f", {"v": 1}, lower)
    assert compile_cache.load("f", {"v": 1}) is not None
    with monkeypatch.context() as m:
      m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
      assert compile_cache.load("f", {"v": 1}) is None
    assert compile_cache.load("f", {"v": 1}) is not None
    log_compiles = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", not log_compiles)
    try:
      assert compile_cache.load("f", {"v": 1}) is None
    finally:
      jax.config.update("jax_log_compiles", log_compiles)
    assert compile_cache.load("f", {"v": 1}) is not None
    mtime = os.stat(module).st_mtime_ns
    module.write_text("SCALE = 20.0\n")
    os.utime(module, ns=(mtime, mtime))
    assert os.stat(module).st_mtime_ns == mtime
    assert compile_cache.load("f", {"v": 1}) is None
  finally:
    sys.modules.pop("kept_program_sized", None)


def test_bytes_that_are_not_those_written_are_refused_before_xla_reads_them(cache):
  lower, _ = program([])
  compile_cache.compiled("f", {"v": 1}, lower)
  [path] = [cache / name for name in os.listdir(cache)]
  with open(path, "rb") as f:
    entry = pickle.load(f)
  flipped = bytearray(entry["executable"])
  flipped[len(flipped) // 2] ^= 0x10
  entry["executable"] = bytes(flipped)
  with open(path, "wb") as f:
    pickle.dump(entry, f)
  with pytest.warns(UserWarning, match="sha256"):
    assert compile_cache.load("f", {"v": 1}) is None
  path.write_bytes(b"not an entry")
  with pytest.warns(UserWarning, match="could not be loaded"):
    assert compile_cache.load("f", {"v": 1}) is None


def test_off_by_default_and_the_newest_entries_kept(cache):
  lower, _ = program([])
  for v in range(compile_cache.KEEP + 2):
    compile_cache.compiled("f", {"v": v}, lower)
  assert len(os.listdir(cache)) == compile_cache.KEEP
  assert compile_cache.load("f", {"v": compile_cache.KEEP + 1}) is not None
  assert compile_cache.load("f", {"v": 0}) is None
  jax.config.update("jax_compilation_cache_dir", None)  # off, as --compilation_cache=none
  traces = []
  lower, _ = program(traces)
  compile_cache.compiled("f", {"v": compile_cache.KEEP + 1}, lower)
  assert traces == [1] and compile_cache.load("f", {"v": compile_cache.KEEP + 1}) is None


def test_a_program_that_cannot_be_kept_runs_and_leaves_no_file(cache):
  """Facts that cannot be pickled (or a program with host callbacks): a warning, the
  program as compiled, and no entry or temporary file left behind."""
  lower, args = program([])
  with pytest.warns(UserWarning, match="not kept"):
    found = compile_cache.compiled("f", {"v": 1}, lower, facts=lambda p: (lambda: None))
  assert found.program(*args)["out"].shape == (3, 2)
  assert not os.path.exists(cache) or os.listdir(cache) == []
