"""The model a run trained, read from its workdir in one process, without the trainer:
what `sample` and `export` start from.

The params are those the run evaluates (docs/algorithms.md): the anchor in sync, delayed
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
from diloco_jax.algo import diloco
from diloco_jax.algo import fragments as streaming
from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.loop import checkpoint as checkpoint_lib
from diloco_jax.models import model as model_lib

Params = Any


class LoadError(RuntimeError):
  """The workdir holds no model that can be read; the message says why."""


@dataclasses.dataclass(frozen=True)
class Trained:
  """Attributes: config, the run's (as its checkpoint recorded it); model, its ModelConfig;
  params, numpy float32 arrays in the model's tree; round, the checkpoint's; finished,
  whether the run had ended there."""
  config: ml_collections.ConfigDict
  model: model_lib.ModelConfig
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


def _fill(template: Any, raw: Any) -> Any:
  """`template`'s tree with the leaves found at the same paths in `raw` (orbax returns
  dataclasses and tuples as dicts and lists)."""
  def find(path, _):
    node = raw
    for key in path:
      node = node[getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))]
    return np.asarray(node)
  return jax.tree_util.tree_map_with_path(find, template)


def _rows(tree: Any) -> Any:
  """[hosts, R, ...] -> [K, ...]: every replica of every host, host-major."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def model_params(config: ml_collections.ConfigDict, meta: dict, template: Params,
                 read) -> Params:
  """The params to evaluate, from a checkpoint's items (`read(items)`) and `meta`."""
  mode = meta["mode"]
  if mode in ("sync", "delayed"):
    return _fill(template, read(("shared",))["shared"]["outer"]["anchor"])
  if mode == "streaming":
    o = config.outer
    ids = jax.tree.leaves(streaming.model_fragment_ids(template, o.fragments,
                                                       o.fragment_layout))
    states = read(("shared",))["shared"]["outer"]
    return streaming.join([list(s["anchor"]) for s in states], ids,
                          jax.tree.structure(template))
  items = read(("shared", "hosts"))
  if mode == "ddp":
    return jax.tree.map(lambda x: x[0][0], _fill(template, items["hosts"]["replicas"]["params"]))
  if mode != "eager":
    raise LoadError(f"a checkpoint of mode {mode!r}, unknown to this version")
  own = items["hosts"]["outer"]
  if not meta["finished"]:  # what the run evaluates: host 0's first replica
    return jax.tree.map(lambda x: x[0][0], _fill(template, own["params"]))
  num_replicas = meta["num_hosts"] * meta["replicas_per_host"]
  rule = diloco.Eager(optim.outer_optimizer(config.outer), num_replicas)
  like = jax.eval_shape(lambda anchor: state_lib.init_eager_state(
      rule.optimizer, anchor, num_replicas), template)
  raw = {"params": _rows(own["params"]), "opt_state": _rows(own["opt_state"]),
         "prev_deltas": _rows(own["prev_deltas"]), **items["shared"]["outer"]}
  per_replica = jax.jit(rule.final)(_fill(like, raw))
  return jax.tree.map(lambda x: np.asarray(x).mean(axis=0), per_replica)


def load(workdir: str, step: int | None = None) -> Trained:
  """The model of the newest checkpoint in `workdir` (or of checkpoint `step`)."""
  directory = os.path.join(workdir, checkpoint_lib.CHECKPOINTS)
  if not os.path.isdir(directory):
    raise LoadError(f"{workdir}: no {checkpoint_lib.CHECKPOINTS}/ directory; is it the "
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
    cfg = model_lib.ModelConfig.from_config(config.model, config.data.vocab_size)
    template = model_lib.param_shapes(cfg)
    params = model_params(config, meta, template, lambda items: _read(manager, step, items))
  except (LoadError, model_lib.ModuleError):
    raise
  except Exception as e:  # noqa: BLE001 -- orbax's many read errors, one line
    detail = " ".join(str(e).split())[:300]
    raise LoadError(f"{directory}/{step}: cannot be read: {type(e).__name__}: {detail}"
                    ) from None
  return Trained(config, cfg, params, step, bool(meta["finished"]))
