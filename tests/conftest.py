"""Test set-up: one CPU device per process, unless a test starts its own processes; one
JAX compilation cache for the whole session.

Most tests train the same tiny models in many trainers, in this process and in the host
processes they start; with JAX's persistent compilation cache (in a temporary directory,
shared through the environment) each program is compiled once per session instead of
once per trainer. The cache holds XLA's compiled programs only: tracing, and so the
traced-once checks, and every computed bit are the same with or without it.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _cache = tempfile.mkdtemp(prefix="diloco_jax_test_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Test tiers (the markers are pyproject.toml's). A test is marked where it is written
# (@pytest.mark.slow, a parametrized case's `marks`, a module's `pytestmark`), or here, by
# a module fixture it uses: that fixture's runs are what take the time or start the hosts,
# so every test that uses one is marked, whichever comes first and pays for it.
FIXTURE_MARKS = {
    "references": ("slow", "multihost"),  # test_checkpoint: 2-host runs (launch/local.py)
    "layouts": ("slow",),  # test_layout: one process training every layout (~1 min)
    "llama_run": ("slow",),  # test_export: a run and its export through the CLI
    "bytes_run": ("slow",),  # test_sample: a run on a text file
}


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  for item in items:
    for name in getattr(item, "fixturenames", ()):
      for mark in FIXTURE_MARKS.get(name, ()):
        item.add_marker(mark)
