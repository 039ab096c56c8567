"""What a start says about the run: every host's start-up lines, and host 0's run.json."""

from __future__ import annotations

import jax

from diloco_jax.loop import parts as parts_lib
from diloco_jax.loop import state as state_lib
from diloco_jax.reporting import lines
from diloco_jax.reporting import phases as phases_lib
from diloco_jax.reporting import runjson


def announce(parts: parts_lib.Parts) -> None:
  """The start-up lines (every host prints its own)."""
  lines.print_startup(
      host=parts.host, num_hosts=parts.num_hosts, mode=parts.config.mode,
      devices=[f"{d.platform}:{jax.local_devices().index(d)}"  # this host's own numbering
               for d in parts.model.mesh.devices.flat],
      replicas_per_host=parts.replicas_per_host, num_params=parts.model.num_params,
      model=parts.model.cfg.module or parts.model.cfg.family, attention=parts.model.attention,
      flops_per_token=parts.model.flops_per_token, num_rounds=parts.num_rounds,
      inner_steps=parts.h, tokens=parts.tokens_per_step * parts.num_rounds * parts.h,
      floor=parts.spec.floor, unigram=parts.spec.unigram_loss,
      storage=None if parts.num_hosts == 1 else "one shared workdir" if parts.storage.shared
      else "a workdir per host (each keeps its own checkpoints)")


def write_run_json(parts: parts_lib.Parts, state: state_lib.RunState) -> None:
  """Host 0: the step's memory line and run.json."""
  lines.print_memory(parts.model.step_memory, parts.model.mesh)
  model, phases = parts.model, parts.reporting.start_phases
  runjson.write_run_json(parts.workdir, parts.config, hosts=parts.num_hosts,
                         devices=model.mesh.devices.flat, num_params=model.num_params,
                         flops_per_token=model.flops_per_token,
                         tokens_per_step=parts.tokens_per_step, peak_flops=model.peak_flops,
                         memory=model.step_memory, layout=model.inner.layout.describe(),
                         start={**state.start, **_taken(parts), "seconds": {
                             **phases.seconds, "total": round(phases_lib.process_age(), 3)}},
                         balance=parts.sync.pacer.describe(),
                         attention=model.attention, init_from=state.init_source)


def _taken(parts: parts_lib.Parts) -> dict:
  """A joiner's compiled programs taken from a member (membership/programs.py), if any."""
  offer = parts.world.programs
  return {"programs": offer.taken} if offer is not None and offer.taken else {}
