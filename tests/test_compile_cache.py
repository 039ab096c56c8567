"""compile_cache: every host keeps its own compiled programs, not host 0 alone."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh interpreter: JAX's cache is set up once per process. It poses as process 1 of a
# job (what jax.distributed sets) and compiles one program.
SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
from jax._src import distributed
from diloco_jax import compile_cache
distributed.global_state.process_id = 1
used = compile_cache.use(sys.argv[1], "unused", int(sys.argv[2]) if sys.argv[2] != "-" else None)
jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.arange(4.0)).block_until_ready()
print(json.dumps({"dir": used, "executables": compile_cache.directory(), "entries": {d: sorted(os.listdir(d)) for d, _, _ in os.walk(sys.argv[1])}}))
"""


def run(cache: str, host_id: str) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, "-c", SCRIPT, cache, host_id], cwd=REPO, env=env,
                       capture_output=True, text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("host_id", ["1", "-"])
def test_a_host_other_than_0_writes_its_programs_to_a_directory_of_its_own(tmp_path, host_id):
  """Host 1 (known from --host_id): its entry in DIR/host1, written by itself; JAX alone
  writes from process 0 only. Unknown host index: JAX's default, nothing written."""
  cache = str(tmp_path / "cache")
  result = run(cache, host_id)
  # The programs kept whole go with JAX's, in the host's own
  assert result["executables"] == os.path.join(result["dir"], "executables")
  if host_id == "1":
    assert result["dir"] == os.path.join(cache, "host1")
    entries = result["entries"][result["dir"]]
    assert any(e.startswith("jit_") for e in entries), result
    assert not [e for e in result["entries"].get(cache, []) if e != "host1"], result
    # Where the directory is keys nothing: another host's entries are this one's
    # (membership/programs.py)
    elsewhere = run(str(tmp_path / "elsewhere"), "1")
    assert elsewhere["entries"][elsewhere["dir"]] == entries
  else:
    assert result["dir"] == cache
    assert not any(result["entries"].values()), result  # process 1: JAX writes nothing


def test_off_and_the_environment_win(tmp_path, monkeypatch):
  """...and the environment's directory, which processes whose code differs in ways no
  file shows may share (this session's tests patch functions), keeps no program whole."""
  from diloco_jax import compile_cache
  assert compile_cache.use("none", str(tmp_path), 1) is None
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert compile_cache.use(None, str(tmp_path), 1) is None
  assert compile_cache.directory() is None
