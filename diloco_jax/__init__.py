"""diloco_jax: DiLoCo and Async DiLoCo training in JAX across badly connected hosts.

The package is layered; each subpackage imports only from the layers below it
(tests/test_layers.py checks it; docs/architecture.md has the table):

  entry points   train, prepare, sample, export, plan   (`python -m diloco_jax.<name>`)
  loop | readback    the round loop: parts + state, build, resume, pacing, a join |
                     a finished run's model read back (sample, export)
  checkpoints | reporting   the stores of a round boundary | the round log and its writers
  membership     who trains together: the coordinator, leases, the epoch's collective
  config | planning   the schema and its validation | a run's time and bytes, before it
                 runs: both judge a run by its mode's traits, so they sit above `modes`
  modes          one driver per mode behind `modes.base.Driver` (with the mode's traits),
                 their registry, and `simulate`
  wire | data | device   cross-host sums | input pipelines | the inner step on the devices
  runtime        jax.distributed (ddp), coordination, preemption, security, host memory,
                 the lock
  algo | models | corpus   the math of every mode | model families | corpora to prepare
  errors, units, digest, _version   the base

Importing the package imports no jax and starts nothing: `simulate` is loaded on first use.
"""

from diloco_jax._version import __version__

__all__ = ["simulate", "SimulateResult", "__version__"]


def __getattr__(name: str):
  # `simulate` imports jax: only when it is asked for, so that `--help` starts fast.
  if name in ("simulate", "SimulateResult"):
    from diloco_jax.modes import simulate  # pylint: disable=import-outside-toplevel
    return getattr(simulate, name)
  raise AttributeError(f"module 'diloco_jax' has no attribute {name!r}")
