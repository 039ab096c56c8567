"""Which hosts are in the job, and what the round loop does about it."""

from __future__ import annotations

import jax

from diloco_jax.algo import state as state_lib


def rejoin(outer_step, snap, init_replicas, data, inner_steps: int):
  """A host back after the others trained without it, resuming from a checkpoint that has
  no row of its own: the shared outer state, its replicas from the anchor with fresh AdamW
  moments (the step count, which drives the lr schedule, set to the run's), and its data
  iterators where host 0's are (every replica has read the same number of batches of its
  own shard). Returns the outer step's carry and the replicas."""
  outer = outer_step.join(snap.shared, None)
  replicas = init_replicas(outer_step.model(outer, None))
  step = snap.round * inner_steps
  replicas = replicas.replace(opt_state=state_lib.with_step_count(replicas.opt_state, step))
  data.set_state(snap.meta["data_state"])
  print(f"host {jax.process_index()}: rejoining at round {snap.round + 1}: replicas from the "
        f"anchor with fresh optimizer moments (step {step})", flush=True)
  return outer, replicas
