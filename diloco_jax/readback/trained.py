"""The model a run trained, read from its workdir in one process, without the trainer:
what `sample` and `export` start from.

The params are those the run evaluates (docs/algorithms.md), as the mode's driver reads
them from the checkpoint's trees (`trained_params` in modes/): the anchor in sync, delayed
and streaming DiLoCo (streaming: every fragment's global copy), ddp's one set of params,
and in eager mode host 0's first replica during the run and the mean of all K replicas
(with the last mean applied) once the run has finished. The newest checkpoint is read
unless `step` names another; it may come from any number of hosts, and a run still
training may be read (only finished checkpoints are listed).

Two layouts are read: one directory of orbax checkpoints (a run of one host, or ddp's on
a shared workdir), and host checkpoints (checkpoints/per_host.py: a run of several hosts),
given as one host's --workdir or as the shared --workdir that holds a `host<i>/` per host.
A finished run's last host checkpoint holds its trained params (`model.safetensors`);
before that, the mode's driver reads them from the `shared` and, in eager mode, the `own`
files, as from orbax's items.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import per_host
from diloco_jax.checkpoints import store
from diloco_jax.models import family
from diloco_jax.modes import base
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
  hosts = host_workdirs(workdir)
  if hosts:
    return _load_host_checkpoints(workdir, hosts, step)
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
    cfg, template = _model(config)
    params = model_params(config, meta, template, lambda items: _read(manager, step, items))
  except (LoadError, family.ModuleError):
    raise
  except Exception as e:  # noqa: BLE001 -- orbax's many read errors, one line
    detail = " ".join(str(e).split())[:300]
    raise LoadError(f"{directory}/{step}: cannot be read: {type(e).__name__}: {detail}"
                    ) from None
  return Trained(config, cfg, params, step, bool(meta["finished"]))


def _model(config: ml_collections.ConfigDict) -> tuple[family.ModelConfig, Params]:
  """The run's ModelConfig and its params' shapes."""
  cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
  # The same math with either kernel, and a GPU run's model may be read on a laptop.
  cfg = dataclasses.replace(cfg, attention="auto")
  return cfg, family.param_shapes(cfg)


# Host checkpoints (checkpoints/per_host.py).

def host_workdirs(workdir: str) -> list[str]:
  """The host workdirs `workdir` stands for, host order: itself if it holds host
  checkpoints, else its `host<i>/` that do (a shared --workdir of several hosts); [] if
  neither (orbax's, or nothing)."""
  root = os.path.abspath(workdir)
  if per_host.present(root):
    return [root]
  if not os.path.isdir(root):
    return []
  found = sorted((int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
                 if (m := re.fullmatch(r"host(\d+)", name)))
  return [path for _, path in found if per_host.present(path)]


def _rounds(workdir: str) -> list[int]:
  directory = os.path.join(workdir, store.CHECKPOINTS)
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.exists(os.path.join(directory, n, files.META)))


def _load_host_checkpoints(workdir: str, hosts: list[str], step: int | None) -> Trained:
  held = {path: _rounds(path) for path in hosts}
  rounds = sorted(set().union(*held.values()))
  if step is None:
    step = rounds[-1]
  elif step not in rounds:
    raise LoadError(f"{workdir}: no checkpoint {step}; there are {rounds}")
  holders = [path for path in hosts if step in held[path]]
  first = os.path.join(holders[0], store.CHECKPOINTS, str(step))
  try:
    with open(os.path.join(first, files.META), "rb") as f:
      meta = files.load_meta(f.read(), os.path.join(first, files.META))
    config = config_lib.from_saved(meta["config"])
    cfg, template = _model(config)
    model_file = files.filename(per_host.MODEL)
    if model_file in meta["files"]:  # a finished run: its trained params
      tree = _file_tree(first, model_file, meta)
      params = base.fill(template, tree)
    else:
      params = model_params(config, meta, template,
                            lambda items: _host_items(holders, step, meta, items))
  except (LoadError, family.ModuleError):
    raise
  except store.CheckpointError as e:
    raise LoadError(str(e)) from None
  except Exception as e:  # noqa: BLE001 -- a file's many read errors, one line
    detail = " ".join(str(e).split())[:300]
    raise LoadError(f"{first}: cannot be read: {type(e).__name__}: {detail}") from None
  return Trained(config, cfg, params, step, bool(meta["finished"]))


def _host_items(holders: list[str], step: int, meta: dict, items: tuple[str, ...]) -> dict:
  """The items a driver reads (`Read`), as orbax would give them: "shared", the first
  holder's; "hosts", every holder's own tree, its leaves stacked along a leading host axis
  (each host's file holds its own rows)."""
  out = {}
  if "shared" in items:
    out["shared"] = _file_tree(os.path.join(holders[0], store.CHECKPOINTS, str(step)),
                               files.filename("shared"), meta)
  if "hosts" in items:
    owns = []
    for path in holders:
      directory = os.path.join(path, store.CHECKPOINTS, str(step))
      with open(os.path.join(directory, files.META), "rb") as f:
        host_meta = files.load_meta(f.read(), os.path.join(directory, files.META))
      owns.append(_file_tree(directory, files.filename("own"), host_meta))
    out["hosts"] = jax.tree.map(lambda *rows: np.stack(rows), *owns)
  return out


_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)")


def _file_tree(directory: str, name: str, meta: dict) -> dict:
  """A host checkpoint file's leaves as nested dicts by the parts of their names (a
  leaf's name is its path, `jax.tree_util.keystr`: ['a'].b[0]), as orbax gives a tree
  back; read whole and checked against meta.json's sha256 first."""
  path = os.path.join(directory, name)
  record = meta["files"][name]
  tree: dict = {}
  for leaf, array in files.leaves(files.read(path, record), record, path).items():
    parts = list(_KEY.finditer(leaf))
    if not parts or "".join(m.group(0) for m in parts) != leaf:
      raise LoadError(f"{path}: a leaf named {leaf!r}, not a path this version reads")
    keys = [m.group(1) if m.group(1) is not None else
            int(m.group(2)) if m.group(2) is not None else m.group(3) for m in parts]
    node = tree
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = array
  return tree
