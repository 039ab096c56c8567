"""The state of one host's run, a value: `RunState`, and the `Snapshot` a checkpoint saves.

Each round makes a new `RunState` from the last (`rounds.run_round`), as the mode drivers
make a new outer state from the last; the parts that act on it (`build.Parts`) never
change. A checkpoint holds everything in it that a resumed run needs to continue bit for
bit, plus what the parts' own state needs (the data iterators, the pacer's decisions).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from diloco_jax._version import __version__
from diloco_jax.checkpoints import store


@dataclasses.dataclass(frozen=True)
class RunState:
  """Attributes:
    outer: the mode's outer state (`modes.base.Outer`: the rule's state, a sum in flight).
    replicas: this host's `ReplicaState` (every local replica's params and inner state).
    round: the last round whose outer step is in `outer` (0: none yet).
    run_id: the run's id, kept in its checkpoints ("" until `resume` agrees on it).
    start: how this start resumed, for run.json (round, storage, world, heal).
    finished_before: resumed from the checkpoint of a finished run.
    init_source: `config.model.init_from`'s directory and its files' sha256 (run.json).
    schedule_steps: the length of the inner learning-rate schedule the step was compiled
      with (balance 'speed' changes it).
    compiles: the next round compiles (first of the process, or after a reschedule): its
      inner phase is not timed for balance 'speed'.
    await_steps_once: the first round waits for its steps before the outer step (CPU).
  """
  outer: Any
  replicas: Any
  schedule_steps: int
  round: int = 0
  run_id: str = ""
  start: dict = dataclasses.field(default_factory=dict)
  finished_before: bool = False
  init_source: dict | None = None
  compiles: bool = True
  await_steps_once: bool = False

  def replace(self, **changes) -> RunState:
    return dataclasses.replace(self, **changes)


def snapshot(parts, state: RunState, r: int, finished: bool = False,
             model=None) -> store.Snapshot:
  """Everything needed to continue after round r (after its outer step); `finished`:
  after the last round, with what was in flight applied, and `model` the trained params."""
  shared, own = parts.driver.split(state.outer)
  snap = _snapshot(parts, state, r, shared, own, finished, bool(state.outer.inflight))
  return dataclasses.replace(snap, model=model)


def snapshot_like(parts, state: RunState, meta: dict) -> store.Snapshot:
  """The shapes a checkpoint with `meta` restores into (a sum in flight or not)."""
  shared, own = parts.driver.split_like(state.outer, state.replicas, meta["inflight"])
  return _snapshot(parts, state, 0, shared, own, False, meta["inflight"])


def _snapshot(parts, state, r, shared, own, finished, inflight) -> store.Snapshot:
  own = {"replicas": state.replicas,
         "data": store.encode_json(parts.data.get_state()), **own}
  meta = {"round": r, "finished": finished, "inflight": inflight, "mode": parts.config.mode,
          "num_hosts": parts.num_hosts, "replicas_per_host": parts.replicas_per_host,
          "data_state": parts.data.get_state(),  # host 0's (meta is written by host 0)
          "run_id": state.run_id, "balance": parts.pacer.state(),
          "config": parts.config.to_dict(), "diloco_jax": __version__,
          "jax": jax.__version__, "saved_at": time.time()}
  return store.Snapshot(r, shared, own, meta)
