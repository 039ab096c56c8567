"""Import paths of the flat layout (diloco_jax 0.1.0 before the subpackages), kept working
with a DeprecationWarning: `import diloco_jax.model` still gives the model module, and a
config's `model.module = "diloco_jax.gpt:GPT"` still finds the family.

Each old path names where its contents live now; a module that was split names every
module its functions went to, and attribute access looks them up in that order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, tuple[str, ...]] = {
    "aggregate": ("algo.aggregate",),
    "compress": ("algo.compress",),
    "diloco": ("algo.diloco",),
    "streaming": ("algo.fragments",),
    "state": ("algo.state",),
    "optim": ("algo.optim",),
    "layers": ("models.layers",),
    "gpt": ("models.gpt",),
    "llama": ("models.llama",),
    "model": ("models.model",),
    "corpus_reader": ("data.prepared",),
    "sources": ("corpus.sources",),
    "tokenizer": ("corpus.tokenizer",),
    "collective": ("wire.collective",),
    "exchange": ("wire.exchange",),
    "dispatch": ("wire.dispatch",),
    "integrity": ("wire.integrity",),
    "distributed": ("runtime.cluster", "runtime.coordination", "runtime.watchdog",
                    "runtime.preemption"),
    "elastic": ("runtime.elastic", "wire.elastic", "loop.membership"),
    "security": ("runtime.security",),
    "hostmem": ("runtime.hostmem",),
    "workdir": ("runtime.workdir",),
    "inner": ("device.inner", "algo.step"),
    "mesh": ("device.mesh",),
    "outer": ("modes.outer", "modes.host", "modes.base"),
    "streaming_step": ("modes.streaming",),
    "ddp": ("modes.ddp",),
    "skips": ("modes.skips",),
    "trainer": ("loop.trainer",),
    "checkpoint": ("loop.checkpoint",),
    "metrics": ("loop.metrics", "units"),
    "writers": ("loop.writers",),
    "profiling": ("loop.profiling",),
    "trained": ("loop.trained",),
}
# Old modules whose name is a package now: their names are read from the package.
SHADOWED: dict[str, tuple[str, ...]] = {
    "data": ("data.pipeline", "data.synthetic", "data.files"),
    "corpus": ("corpus.format",),
}


def _warn(old: str, new: tuple[str, ...], stacklevel: int) -> None:
  warnings.warn(f"diloco_jax.{old} moved to {' and '.join('diloco_jax.' + n for n in new)} "
                f"(CHANGELOG.md lists the moves)", DeprecationWarning,
                stacklevel=stacklevel)


def _lookup(old: str, new: tuple[str, ...], name: str):
  for module in new:
    module = importlib.import_module(f"diloco_jax.{module}")
    if hasattr(module, name):
      return getattr(module, name)
  raise AttributeError(f"module 'diloco_jax.{old}' (moved to "
                       f"{', '.join('diloco_jax.' + n for n in new)}) has no attribute {name!r}")


def _facade(old: str, new: tuple[str, ...]) -> types.ModuleType:
  """The old module: the new one itself where it moved whole (so that patching it patches
  the code that runs), else a module that reads each name from the modules it went to."""
  if len(new) == 1:
    return importlib.import_module(f"diloco_jax.{new[0]}")
  facade = types.ModuleType(f"diloco_jax.{old}", f"Moved to {', '.join(new)}.")
  facade.__getattr__ = lambda name: _lookup(old, new, name)
  return facade


class _Loader(importlib.abc.Loader):

  def __init__(self, old: str):
    self.old = old

  def create_module(self, spec):
    _warn(self.old, MOVED[self.old], stacklevel=6)
    return _facade(self.old, MOVED[self.old])

  def exec_module(self, module):
    pass


class _Finder(importlib.abc.MetaPathFinder):
  """Finds `diloco_jax.<old>` for every old path in MOVED."""

  def find_spec(self, fullname, path=None, target=None):
    prefix, _, old = fullname.rpartition(".")
    if prefix != "diloco_jax" or old not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, _Loader(old))


def install() -> None:
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())


def package_getattr(package: str):
  """A `__getattr__` for a package that took an old module's name (`data`, `corpus`): an
  old name read from the package warns and comes from where it lives now."""
  new = SHADOWED[package]

  def __getattr__(name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _lookup(package, new, name)
    _warn(f"{package}.{name}", new, stacklevel=3)
    return value

  return __getattr__
