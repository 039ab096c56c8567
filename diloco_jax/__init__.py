"""diloco_jax: DiLoCo and Async DiLoCo training in JAX across badly connected hosts.

The package is layered; each subpackage imports only from the layers below it
(tests/test_layers.py checks it):

  entry points   train, prepare, sample, export      (`python -m diloco_jax.<name>`)
  loop           the round loop, checkpoints, the round log and what it writes
  modes          one driver per mode behind `modes.base.Driver`, and their registry
  wire | data | device   cross-host sums | input pipelines | the inner step on the devices
  runtime        start-up, coordination, preemption, elasticity, host memory, the lock
  config         the schema and its validation
  algo | models | corpus   the math of every mode | model families | corpora to prepare
  errors, units, _version  the base
"""

from diloco_jax import _moved
from diloco_jax._version import __version__
from diloco_jax.runtime import hostmem

# `python -m diloco_jax.train` may start its process again for huge pages: here, before
# jax is imported, that costs next to nothing (train.py's main asks again for other ways in).
hostmem.restart_with_huge_pages(only_module="diloco_jax.train")
_moved.install()

__all__ = ["simulate", "SimulateResult", "__version__"]


def __getattr__(name: str):
  # `simulate` imports jax: only when it is asked for, so that `--help` starts fast.
  if name in ("simulate", "SimulateResult"):
    from diloco_jax.algo import simulate  # pylint: disable=import-outside-toplevel
    return getattr(simulate, name)
  raise AttributeError(f"module 'diloco_jax' has no attribute {name!r}")
