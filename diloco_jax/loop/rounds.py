"""One round: `run_round(parts, state, r) -> RunState`.

A round is H inner steps of every local replica (one jitted call per step, dispatched
without waiting), then the mode's outer step. Every mode's driver comes from
`modes.registry` and is used only through `modes.base.Driver`, so nothing here depends on
the mode. What a round reports travels back as values into the round log
(`reporting.roundlog.RoundLog`), which writes each record one round late so the devices
never wait for logging.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from diloco_jax.device import mesh as mesh_lib
from diloco_jax.loop import parts as parts_lib
from diloco_jax.loop import runinfo
from diloco_jax.loop import state as state_lib
from diloco_jax.modes import base as modes_base
from diloco_jax.reporting import profiling
from diloco_jax.runtime import hostmem


def run_round(parts: parts_lib.Parts, state: state_lib.RunState, r: int) -> state_lib.RunState:
  """Round r: H inner steps of every local replica (balance 'speed': this host's share,
  `parts.sync.pacer`), then the outer step. Its record opens in the round log; the figures
  of its sums join it when they arrive."""
  h, pacer = parts.h, parts.sync.pacer
  n = pacer.my_steps(r)
  open_record(parts, r)
  replicas, losses, t = state.replicas, [], time.perf_counter()
  # A host admitted at the end of round r−1 catches up in round r: it takes no part in its
  # sums, trains no step and reads no batch, but meets every sum of the round where the
  # members do (docs/algorithms.md §11); its Δ is zero, and so are its losses.
  idle = parts.sync.exchange.idle_here(r)
  no_loss = parts.model.inner.no_losses(parts.replicas_per_host) if idle else None
  for i in range(n):
    step = (r - 1) * h + (i + 1) * h // n  # the progress in slowest-host steps
    if idle:
      loss_R = no_loss
    else:
      with profiling.step_annotation("inner_step", step_num=step):
        replicas, loss_R = parts.model.inner(replicas, parts.data.next_batch())
    losses.append(loss_R)
    if i + 1 < n:  # streaming syncs fragments mid-round
      state = take(parts, state.replace(replicas=replicas), r,
                   parts.sync.driver.after_step(state.outer, replicas, step, r))
      replicas = state.replicas
    parts.reporting.bar.update(step, f"round {r}/{parts.num_rounds}")
  state = state.replace(replicas=replicas)
  if pacer in parts.sync.exchange.riders:  # this host's speed: its inner phase, if not compiled
    jax.block_until_ready(replicas)  # (the outer step waits for it first thing)
    pacer.measured(r, 0.0 if state.compiles or idle else time.perf_counter() - t)
    state = state.replace(compiles=False)
  if state.await_steps_once:
    # The round's end compiles its programs (the outer step's, the loss sum's) on first
    # use, while the steps dispatched ahead still run. On CPU they run on the same cores
    # (nothing is gained) and the compiler's memory adds to the steps' peak: the first
    # round waits for its steps. Accelerators keep the overlap.
    jax.block_until_ready(replicas)
    state = state.replace(await_steps_once=False)
  loss_sum = jnp.sum(jnp.stack(losses))  # dispatched, not waited for
  with profiling.annotate("outer_step"):
    state = take(parts, state, r, parts.sync.driver.end_round(state.outer, replicas, loss_sum, r))
  round_checks(parts, state, r)
  if (peak := mesh_lib.peak_bytes(parts.model.mesh.devices.flat)) is not None:
    parts.reporting.log.add(r, device_peak_bytes=peak)  # accelerators: the allocator's peak so far
  hostmem.trim()  # what the round's compiles and host copies freed
  return state.replace(round=r, data=parts.data.get_state(), pace=parts.sync.pacer.state())


def open_record(parts: parts_lib.Parts, r: int, **figures) -> None:
  """Round r's record; with unequal steps, the losses its train loss averages."""
  pacer = parts.sync.pacer
  steps = pacer.steps(r)
  loss_terms = (None if steps == (parts.h,) * parts.num_hosts
                else sum(steps) * parts.replicas_per_host)
  parts.reporting.log.open(r, loss_terms=loss_terms, inner_step=r * parts.h,
                           tokens=pacer.tokens_through(r, parts.tokens_per_replica_step),
                           **figures)


def take(parts: parts_lib.Parts, state: state_lib.RunState, r: int,
         update: modes_base.Update) -> state_lib.RunState:
  """The state after a driver's `update`, whose figures go to the round log."""
  state = state.replace(outer=update.outer, replicas=update.replicas)
  log, sync = parts.reporting.log, parts.sync
  log.add_times(r, update.times)
  log.add_synced(update.synced)
  for s in update.synced:  # what rode the sums comes back as the round's figures
    log.add_if_open(s.arrived.round, **sync.membership.figures(s.arrived.riders))
    sync.preemption.arrived(s.arrived.riders)
    if (pace := s.arrived.riders.get(sync.pacer.name)) is not None:
      figures = sync.pacer.arrived(s.arrived.round, pace, now=r)
      log.add_if_open(s.arrived.round, **figures, hosts_tokens=[
          n * parts.replicas_per_host * parts.tokens_per_replica_step
          for n in figures["hosts_steps"]])
  if sync.pacer.take_changed():
    state = reschedule(parts, state, announce=True)
  return state


def reschedule(parts: parts_lib.Parts, state: state_lib.RunState,
               announce: bool = False) -> state_lib.RunState:
  """balance 'speed': this host's learning-rate schedule spans the steps it trains in the
  run (`pacing.Pacer.schedule_steps`; recompiled when that changes, and the round after is
  not timed)."""
  total = parts.sync.pacer.schedule_steps()
  if total != state.schedule_steps:
    parts.model.inner.reschedule(parts.inner_optimizer(total))
    state = state.replace(schedule_steps=total, compiles=True)
  decision = parts.sync.pacer.decisions[-1]
  if announce and parts.prints:
    print(f"balance: from round {decision.first}, inner steps per host "
          f"{list(decision.steps)} (measured speeds; H = {parts.h} for the slowest)", flush=True)
  if announce and parts.writes:
    runinfo.write_run_json(parts, state)
  return state


def round_checks(parts: parts_lib.Parts, state: state_lib.RunState, r: int) -> None:
  """After round r's outer step: the outer state compared across hosts, and the eval,
  when due (the eval is read late)."""
  driver, log = parts.sync.driver, parts.reporting.log
  log.add(r, **parts.sync.anchor_check(driver.replicated(state.outer, state.replicas), r))
  if parts.evaluates and r % parts.config.eval_every == 0 and r < parts.num_rounds:
    model = driver.model(state.outer, state.replicas)
    log.add(r, eval_loss=parts.model.eval_step(model, parts.model.eval_batches),
            floor=parts.spec.floor)
