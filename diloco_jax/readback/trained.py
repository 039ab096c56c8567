"""The model a run trained, read from its workdir in one process, without the trainer:
what `sample` and `export` start from.

The params are those the run evaluates (docs/algorithms.md), as the mode's driver reads
them from the checkpoint's trees (`trained_params` in modes/): the anchor in sync, delayed
and streaming DiLoCo (streaming: every fragment's global copy), ddp's one set of params,
and in eager mode host 0's first replica during the run and the mean of all K replicas
(with the last mean applied) once the run has finished. The newest checkpoint is read
unless `step` names another; it may come from any number of hosts, and a run still
training may be read (only finished checkpoints are listed).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax.checkpoints import store
from diloco_jax.models import family
from diloco_jax.modes import registry

Params = Any


class LoadError(errors.DilocoError, RuntimeError):
  """The workdir holds no model that can be read; the message says why."""
  prefix = "Cannot load"


@dataclasses.dataclass(frozen=True)
class Trained:
  """Attributes: config, the run's (as its checkpoint recorded it); model, its ModelConfig;
  params, numpy float32 arrays in the model's tree; round, the checkpoint's; finished,
  whether the run had ended there."""
  config: ml_collections.ConfigDict
  model: family.ModelConfig
  params: Params
  round: int
  finished: bool


def _manager(directory: str) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers={"shared": ocp.StandardCheckpointHandler(),
                     "hosts": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def _read(manager: ocp.CheckpointManager, step: int, items: tuple[str, ...]) -> dict:
  """The items as numpy trees of dicts and lists, in this one process (the shardings of
  the hosts that wrote them are not needed: every array lands on the first device)."""
  device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  metadata = manager.item_metadata(step)
  is_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
  args = {item: ocp.args.StandardRestore(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), metadata[item],
      is_leaf=is_leaf)) for item in items}
  restored = manager.restore(step, args=ocp.args.Composite(**args))
  return {item: jax.tree.map(np.asarray, restored[item]) for item in items}


def model_params(config: ml_collections.ConfigDict, meta: dict, template: Params,
                 read) -> Params:
  """The params to evaluate, from a checkpoint's items (`read(items)`) and `meta`: the
  mode's driver says which (`modes.base.Driver.trained_params`)."""
  try:
    driver = registry.driver(meta["mode"])
  except KeyError:
    raise LoadError(f"a checkpoint of mode {meta['mode']!r}, unknown to this version"
                    ) from None
  return driver.trained_params(config, meta, template, read)


def load(workdir: str, step: int | None = None) -> Trained:
  """The model of the newest checkpoint in `workdir` (or of checkpoint `step`)."""
  # orbax reads only absolute paths: a relative --workdir is the user's working directory's
  directory = os.path.join(os.path.abspath(workdir), store.CHECKPOINTS)
  if not os.path.isdir(directory):
    raise LoadError(f"{workdir}: no {store.CHECKPOINTS}/ directory; is it the "
                    "--workdir of a training run?")
  manager = _manager(directory)
  steps = sorted(manager.all_steps())
  if not steps:
    raise LoadError(f"{directory}: no finished checkpoint yet (the first is written after "
                    "config.checkpoint.every rounds, and at the end of the run)")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise LoadError(f"{directory}: no checkpoint {step}; there are {steps}")
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    config = config_lib.from_saved(meta["config"])
    cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
    # The same math with either kernel, and a GPU run's model may be read on a laptop.
    cfg = dataclasses.replace(cfg, attention="auto")
    template = family.param_shapes(cfg)
    params = model_params(config, meta, template, lambda items: _read(manager, step, items))
  except (LoadError, family.ModuleError):
    raise
  except Exception as e:  # noqa: BLE001 -- orbax's many read errors, one line
    detail = " ".join(str(e).split())[:300]
    raise LoadError(f"{directory}/{step}: cannot be read: {type(e).__name__}: {detail}"
                    ) from None
  return Trained(config, cfg, params, step, bool(meta["finished"]))
