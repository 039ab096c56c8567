"""The state of one host's run, a value: `RunState`, and its `Snapshot`.

Each round makes a new `RunState` from the last (`rounds.run_round`), as the mode drivers
make a new outer state from the last; the parts that act on it (`parts.Parts`) never
change. `RunState` holds everything a checkpoint holds, the data iterators' positions and
the pacer's decisions included (as they stood at the end of its round).

`snapshot` and `restore` are the only functions that know its shape: `snapshot` gives the
`Snapshot` that every transport moves in one encoding (checkpoints/files.py: meta.json and
safetensors files, each with its sha256): to this host's disk (the stores), to a host that
joins a live job (loop/join.py) and to a host that heals at a start (checkpoints/
recovery.py); `restore` puts one back into a run, whichever way it came.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from diloco_jax._version import __version__
from diloco_jax.algo import state as algo_state
from diloco_jax.checkpoints import store
from diloco_jax.loop import parts as parts_lib


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
    data: every local replica's data iterator position after `round` (`data.get_state`).
    pace: balance 'speed': the pacer's decisions and timings after `round`
      (`pacing.Pacer.state`).
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
  data: Any = None
  pace: dict | None = None

  def replace(self, **changes) -> RunState:
    return dataclasses.replace(self, **changes)


def snapshot(parts: parts_lib.Parts, state: RunState, r: int, finished: bool = False,
             model=None) -> store.Snapshot:
  """Everything needed to continue after round r (after its outer step); `finished`:
  after the last round, with what was in flight applied, and `model` the trained params."""
  shared, own = parts.sync.driver.split(state.outer)
  snap = _snapshot(parts, state, r, shared, own, finished, bool(state.outer.inflight))
  return dataclasses.replace(snap, model=model)


def snapshot_like(parts: parts_lib.Parts, state: RunState, meta: dict) -> store.Snapshot:
  """The shapes a checkpoint with `meta` restores into (a sum in flight or not)."""
  shared, own = parts.sync.driver.split_like(state.outer, state.replicas, meta["inflight"])
  return _snapshot(parts, state, 0, shared, own, False, meta["inflight"])


def _snapshot(parts: parts_lib.Parts, state, r, shared, own, finished,
              inflight) -> store.Snapshot:
  own = {"replicas": state.replicas, "data": store.encode_json(state.data), **own}
  meta = {"round": r, "finished": finished, "inflight": inflight, "mode": parts.config.mode,
          "num_hosts": parts.num_hosts, "replicas_per_host": parts.replicas_per_host,
          "data_state": state.data,  # the writer's (a host without rows of its own takes it)
          "run_id": state.run_id, "balance": state.pace,
          # the highest membership epoch this host saw (a coordinator started anew numbers
          # its epochs above it: membership/start.py's last_epoch)
          "epoch": parts.world.lease.client.last_epoch if parts.world.live else None,
          "config": parts.config.to_dict(), "diloco_jax": __version__,
          "jax": jax.__version__, "saved_at": time.time(),
          # the hosts that take no part in a sum in flight (a joiner's catch-up round): a
          # resume sends that sum again with the same hosts idle (wire/exchange.py's `idle`)
          "inflight_idle": _idle_in_flight(parts, state)}
  return store.Snapshot(r, shared, own, meta)


def _idle_in_flight(parts: parts_lib.Parts, state: RunState) -> dict[str, list[int]]:
  """{round: idle hosts} of the sums in flight in `state` that have idle hosts."""
  idle = {p.round: parts.sync.exchange.idle_hosts(p.round)
          for p in getattr(state.outer, "inflight", ())}
  return {str(r): sorted(hosts) for r, hosts in idle.items() if hosts}


def restore(parts: parts_lib.Parts, state: RunState, snap: store.Snapshot, *,
            same_world: bool = True,
            inflight: Callable[[Any, Any], tuple] | None = None) -> RunState:
  """The run after `snap`'s round, on this host: the outer state, and either this host's
  own replicas, data positions and in-flight sum (`snap.own` holds "replicas": a resume
  on the disk that wrote it), or, for a host without rows of its own (new, wiped, or
  joining a live job), replicas from the anchor (eager: from `snap.own`'s outer rows) with
  fresh AdamW moments at the run's step count and the writer's data positions. The
  pacer's decisions come back too. `same_world` False: the host count changed, so the
  speed decisions and data positions are not this world's (every replica starts a new
  pass). `inflight(outer, replicas)`: the sums that were in flight, as they arrived on the
  sender (a joiner applies them like every member: loop/join.py)."""
  own = snap.own or {}
  parts.sync.pacer.restore(snap.meta.get("balance"), same_world=same_world)
  if "inflight" in own:  # sent again below, with the hosts that took no part in it then
    for r, hosts in snap.meta.get("inflight_idle", {}).items():
      parts.sync.exchange.idle(int(r), hosts)
  outer = parts.sync.driver.join(snap.shared, own or None)
  if "replicas" in own:
    replicas = parts.model.inner.place(own["replicas"])
    data = store.decode_json(own["data"])
  else:
    replicas = parts.model.init_replicas(parts.sync.driver.model(outer, None))
    replicas = replicas.replace(opt_state=algo_state.with_step_count(
        replicas.opt_state, parts.sync.pacer.steps_done(snap.round)))
    data = snap.meta["data_state"]
  if same_world:
    parts.data.set_state(data)
  if inflight is not None:
    outer = outer._replace(inflight=inflight(outer, replicas))
  return state.replace(outer=outer, replicas=replicas, round=snap.round,
                       run_id=snap.meta.get("run_id", state.run_id),
                       data=parts.data.get_state(), pace=parts.sync.pacer.state())
