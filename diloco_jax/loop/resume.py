"""`resume(parts, state) -> RunState`: a start that continues from the newest readable
checkpoint, or begins the run (round 0) when there is none.

The store (`checkpoints/`) says which checkpoint every host can read and gives it back; this
module puts it into the run: the outer state and replicas (or, for a host without a row of
its own, replicas started from the anchor), the data iterators, the pacer's decisions, the
run's id (host 0's on every host), and what run.json says about the start.
"""

from __future__ import annotations

import dataclasses
import uuid

import jax
import numpy as np

from diloco_jax.checkpoints import resize
from diloco_jax.checkpoints import store
from diloco_jax.loop import parts as parts_lib
from diloco_jax.loop import rounds
from diloco_jax.loop import state as state_lib
from diloco_jax.models import pretrained
from diloco_jax.reporting import lines


def resume(parts: parts_lib.Parts, state: state_lib.RunState) -> state_lib.RunState:
  """The state after the newest readable checkpoint (`state` itself, with the run's id, when
  there is none). A sum in flight in it is issued again; its round's record is opened anew."""
  config = parts.config
  snap = parts.storage.store.restore(lambda meta: state_lib.snapshot_like(parts, state, meta),
                             lambda meta: _check_checkpoint(parts, meta))
  state = state.replace(run_id=_agreed_run_id(parts, snap.meta.get("run_id", "") if snap else ""),
                        init_source=_init_source(config))
  storage = "shared" if parts.storage.shared else "per_host"
  if snap is None:
    state = state.replace(start={"round": 0, "storage": storage}, round=0)
    return _from_pretrained(parts, state) if config.model.init_from else state
  r = snap.round
  change = resize.Change.of(snap, parts.num_hosts)
  resize.check_mode(change, config.mode, where=f"checkpoint {r}")
  if change.partial:  # (a sum in flight is not every host's: dropped)
    snap = dataclasses.replace(snap, own=resize.without_inflight(snap.own))
  # Another host count: every replica starts a new pass over the new shards, and the
  # speeds are measured anew.
  state = state_lib.restore(parts, state.replace(finished_before=snap.meta["finished"]), snap,
                            same_world=not change.changed)
  state = rounds.reschedule(parts, state)
  if snap.own is None:
    print(f"host {parts.host}: starting from the anchor at round {r + 1}: replicas with "
          f"fresh optimizer moments (step {parts.sync.pacer.steps_done(r)})", flush=True)
  outer = state.outer
  recovered = parts.storage.store.recovered
  state = state.replace(start={
      "round": r, "storage": storage, **change.describe(),
      "healed_from": recovered.source if recovered and recovered.healed else None,
      "heal_bytes": recovered.bytes if recovered else 0,
      "heal_seconds": recovered.seconds if recovered else 0.0})
  if parts.prints and change.partial:
    print(change.message(r, replicas_per_host=parts.replicas_per_host,
                        inflight=bool(snap.meta["inflight"])), flush=True)
  if parts.prints:
    lines.print_resumed(r, parts.storage.store.directory, replicas=parts.num_replicas,
                        inflight=bool(outer.inflight), finished=state.finished_before,
                        num_rounds=parts.num_rounds)
    if config.model.init_from:
      print(f"config.model.init_from = {config.model.init_from}: its weights are not "
            f"used (the checkpoint's params win)", flush=True)
  if outer.inflight:  # its record was not logged before the checkpoint
    rounds.open_record(parts, r, resumed=True, round_time=0.0, tokens_per_sec=0.0,
                       elapsed=0.0, eta=0.0)
    rounds.round_checks(parts, state, r)
  return state


def _check_checkpoint(parts: parts_lib.Parts, meta: dict) -> None:
  store.check_compatible(meta, parts.config, num_hosts=parts.num_hosts,
                         replicas_per_host=parts.replicas_per_host,
                         where=f"checkpoint {meta['round']} in {parts.storage.store.directory}")


def _agreed_run_id(parts: parts_lib.Parts, saved: str) -> str:
  """The run's id: the checkpoint's, else a new one; host 0's on every host."""
  mine = np.frombuffer(bytes.fromhex(saved or uuid.uuid4().hex), np.uint8)
  words = parts.dispatcher.run(parts.sync.collective.allgather, mine, what="agreeing on the run")
  return bytes(words[0]).hex()


def _from_pretrained(parts: parts_lib.Parts, state: state_lib.RunState) -> state_lib.RunState:
  """The anchor and every replica from `config.model.init_from`'s weights: the same files
  on every host, the same anchor."""
  params = pretrained.params(parts.config.model.init_from, parts.model.cfg)
  # The placeholders (zeros of the right shapes) go first: one copy of the state at a time.
  for x in jax.tree.leaves((state.outer, state.replicas)):
    if isinstance(x, jax.Array):
      x.delete()
  anchor = jax.device_put(params, parts.sync.exchange.host_device)
  return state.replace(outer=parts.sync.driver.init(anchor),
                       replicas=parts.model.init_replicas(anchor))


def _init_source(config) -> dict | None:
  """`config.model.init_from`'s directory and the sha256 of its files (None: none), for
  run.json. A resumed run's weights may be gone: then the path alone."""
  if not config.model.init_from:
    return None
  try:
    return pretrained.source(config.model.init_from)
  except (OSError, pretrained.PretrainedError):
    return {"path": config.model.init_from, "sha256": None}
