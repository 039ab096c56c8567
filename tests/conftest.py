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

import pytest

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
    "references": ("slow", "multihost"),  # test_checkpoint_hosts: 2-host runs (launch/local.py)
    "layouts": ("slow",),  # test_layout: one process training every layout (~1 min)
    "llama_run": ("slow",),  # test_export: a run and its export through the CLI
    "bytes_run": ("slow",),  # test_sample: a run on a text file
}


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  for item in items:
    for name in getattr(item, "fixturenames", ()):
      for mark in FIXTURE_MARKS.get(name, ()):
        item.add_marker(mark)


# Corpora that two test modules read, made once per session (as each was once per module
# before its module was split) and never changed (a test that damages one works on a copy).
# The helpers are imported here, not above: jax must not start before the environment is set.

@pytest.fixture(scope="session")
def documents():
  """Tagged train and eval documents (tests/prepared_dirs.py)."""
  from tests import prepared_dirs  # pylint: disable=import-outside-toplevel
  return prepared_dirs.corpus_documents()


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, documents):  # pylint: disable=redefined-outer-name
  """A prepared directory of `documents`, in the bytes tokenizer."""
  from tests import prepared_dirs  # pylint: disable=import-outside-toplevel
  return prepared_dirs.write_prepared(tmp_path_factory.mktemp("prepared"), *documents)


@pytest.fixture(scope="session")
def spm_models(tmp_path_factory):
  """SentencePiece models trained on the test text: one with an EOS, one without."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  from tests.corpora import make_texts  # pylint: disable=import-outside-toplevel
  d = tmp_path_factory.mktemp("spm")
  lines = [line for t in make_texts(200, seed=1) for line in t.splitlines() if line.strip()]
  for name, eos in [("with_eos", 2), ("no_eos", -1)]:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(d / name),
                                   vocab_size=80, eos_id=eos, minloglevel=2)
  return d / "with_eos.model", d / "no_eos.model"
