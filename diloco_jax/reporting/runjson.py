"""workdir/run.json: what a run is, written at its start."""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from typing import Any
from typing import Iterable
from typing import Mapping

import flax
import jax
import numpy as np
import optax

from diloco_jax._version import __version__
from diloco_jax.runtime import hostmem


def write_run_json(workdir: str, config, *, hosts: int, devices: Iterable[Any],
                   num_params: int, flops_per_token: float, tokens_per_step: int,
                   peak_flops: float | None = None, memory: Mapping[str, int] | None = None,
                   layout: Mapping[str, Any] | None = None,
                   start: Mapping[str, Any] | None = None,
                   balance: Mapping[str, Any] | None = None, attention: str = "xla",
                   init_from: Mapping[str, Any] | None = None) -> str:
  """workdir/run.json: what this run is (the resolved config, the world, the model size,
  the software), written at start so a workdir always says how it was made."""
  run = {"config": config.to_dict(), "mode": config.mode, "hosts": hosts,
         "replicas_per_host": config.replicas_per_host,
         "replicas": hosts * config.replicas_per_host,
         "local_devices": [str(d) for d in devices], "num_params": num_params,
         "flops_per_token": flops_per_token, "tokens_per_step": tokens_per_step,
         "peak_flops": peak_flops,  # all hosts' devices together (bf16 table); None: CPU
         # XLA's plan for the compiled inner step on one device (None: the backend has none)
         "memory_per_device_bytes": memory and memory["total"], "memory_per_device": memory,
         "layout": layout,
         "attention": attention,  # what causal attention runs: 'xla', 'cudnn' or 'own'
         "start": start,  # how this start resumed: round, storage, healed hosts, world change
         "balance": balance,  # balance 'speed': the steps per host decided so far (None: fixed)
         "init_from": init_from,  # the pretrained weights of round 1: directory, files' sha256
         "huge_pages": hostmem.huge_pages(),  # for big host buffers (runtime/hostmem.py)
         "versions": {"diloco_jax": __version__, "jax": jax.__version__,
                      "jaxlib": jax.lib.__version__, "flax": flax.__version__,
                      "optax": optax.__version__,  # orbax: not imported before a save
                      "orbax_checkpoint": importlib.metadata.version("orbax-checkpoint"),
                      "numpy": np.__version__},
         "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
  path = os.path.join(workdir, "run.json")
  with open(path + ".tmp", "w") as f:
    json.dump(run, f, indent=2, sort_keys=True, default=str)
  os.replace(path + ".tmp", path)
  return path
