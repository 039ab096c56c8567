"""One host's run: `Trainer` holds its parts (`parts.Parts`, services built once) and its
state (`state.RunState`, a value each round replaces), and runs the rounds with the hooks
around them (`hooks.Hooks`: the profile window, the records, the checkpoints, the
admissions) and the end of the run.

The round itself is `rounds.run_round`; a start that continues a checkpoint is
`resume.resume`; a host that joins a live job starts from its members' state instead
(`join.receive`), and a member admits it (`join.admit`). One host prints (host 0, or the
lowest live one) and writes files (live: every host its own); the metrics writer reads
each round's figures one round late, so the devices never wait for logging.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any
from typing import NamedTuple

import jax
import ml_collections

from diloco_jax.algo import state as algo_state
from diloco_jax.loop import build as build_lib
from diloco_jax.loop import hooks as hooks_lib
from diloco_jax.loop import join as join_lib
from diloco_jax.loop import resume as resume_lib
from diloco_jax.loop import rounds
from diloco_jax.loop import runinfo
from diloco_jax.loop import state as state_lib
from diloco_jax.membership import lease as lease_lib
from diloco_jax.modes import base as modes_base
from diloco_jax.reporting import lines
from diloco_jax.reporting import plots
from diloco_jax.reporting import profiling
from diloco_jax.runtime import collector
from diloco_jax.runtime import hostmem
from diloco_jax.membership import world as world_lib
from diloco_jax.wire import dispatch


class TrainResult(NamedTuple):
  """Attributes: params, the trained params (the final anchor; eager: the mean of all
  replicas; ddp: its one set), on the local devices; outer_state, the mode's final outer
  state (OuterState, EagerState, the fragments' OuterStates; None for ddp), on the host;
  replicas, this host's final ReplicaState; records, one metrics dict per round; traces,
  how often each jitted program was traced; preempted_at, the round after which a
  preemption stopped the run (None: it ran to the end)."""
  params: Any
  outer_state: Any
  replicas: algo_state.ReplicaState
  records: list[dict[str, Any]]
  traces: dict[str, int]
  preempted_at: int | None = None


class Trainer:
  """One host's run: `parts` (what it is built from, never replaced) and `state` (where
  it stands: replaced by every round, by `resume` and at the end)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               dispatcher: dispatch.Dispatcher, world: world_lib.World | None = None,
               restart_from_scratch: bool = False,
               pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None):
    self.parts, self.state = build_lib.build(config, workdir, dispatcher,
                                             world or world_lib.World.fixed(),
                                             restart_from_scratch, pseudo_gradient_hook)
    self.hooks = self._hooks()

  def run_round(self, r: int) -> None:
    with profiling.annotate(f"round {r}"):
      self.state = rounds.run_round(self.parts, self.state, r)

  def resume(self) -> int:
    """Restores the newest readable checkpoint and returns the last round it holds (0:
    none)."""
    self.state = resume_lib.resume(self.parts, self.state)
    return self.state.round

  def snapshot(self, r: int, finished: bool = False):
    return state_lib.snapshot(self.parts, self.state, r, finished)

  def run(self) -> TrainResult:
    r, preempted_at = self._start(), None
    while r <= self.parts.num_rounds:
      self.hooks.before_round(r)
      try:
        self.run_round(r)
      except (dispatch.CollectiveError, lease_lib.Dropped) as e:
        dropped = e if isinstance(e, lease_lib.Dropped) else e.__cause__
        if not isinstance(dropped, lease_lib.Dropped):
          raise
        # live: the job went on without this host (frozen or cut off past its lease)
        self.state = join_lib.again(self.parts, self.state, dropped)
        r = self.state.round + 1
        continue
      if self.hooks.after_round(r):  # a preemption: stopped after round r
        preempted_at = r
        break
      r += 1
    return self._end(preempted_at)

  def _hooks(self) -> hooks_lib.Hooks:
    """What runs around each round, in this order: the profile window, the round's record
    (written one round late, so the devices never wait for it), a checkpoint when the
    store's policy says so (and a stop after a preemption), and an admission when a host
    waits to join (live)."""
    parts, hooks = self.parts, hooks_lib.Hooks()
    profile, log = parts.reporting.profile, parts.reporting.log
    hooks.add("profile", before=profile.before_round,
              after=lambda r: profile.after_round(r, self.state.replicas))
    started = 0.0  # when the round began

    def clock(r: int) -> None:
      del r
      nonlocal started
      started = time.perf_counter()

    def record(r: int) -> None:
      log.write_through(r - 1)  # read after round r's work was dispatched
      log.timed(r, time.perf_counter() - started, steady=not profile.covers(r),
                tokens=sum(parts.sync.pacer.steps(r)) * parts.replicas_per_host
                * parts.tokens_per_replica_step)

    hooks.add("record", before=clock, after=record)

    def checkpoint(r: int) -> bool:
      preempted = parts.sync.preemption.reached(r)
      if parts.storage.policy.due(r, preempted):
        self._save(r)
      return preempted and r < parts.num_rounds

    hooks.add("checkpoint", after=checkpoint)

    def admission(r: int) -> None:
      if parts.sync.membership.join_due() and r < parts.num_rounds:  # live: a host waits
        join_lib.admit(parts, self.state, r)  # on the dispatch thread: round r+1 goes on

    hooks.add("admission", after=admission)
    return hooks

  def _start(self) -> int:
    """Everything before the first round of this process: the start-up lines, the state
    (resumed from a checkpoint, or a joiner's from the members), the metrics files opened
    where they continue, run.json. Returns the first round to train."""
    parts = self.parts
    runinfo.announce(parts)
    # jax keeps every program it compiled for the life of the process, with its traces:
    # start-up's one-off programs (params and optimizer-state init) are dropped. The inner
    # step keeps its own executable; what else runs later compiles on first use (a
    # joiner's are dropped before its rehearsal compiles those: `join.receive`).
    if parts.world.joining:  # the members' state, at their next round boundary (it gives
      self.state = join_lib.receive(parts, self.state)  # back what compiling freed first)
    else:
      self.resume()
      jax.clear_caches()
      collector.settled()  # start-up's garbage freed, what it keeps out of later walks
      hostmem.trim()  # what compiling freed
    parts.reporting.start_phases.done("resume")  # the checkpoint read, what compiling freed
    done = self.state.round
    first = done if self.state.outer.inflight else done + 1  # the first round logged now
    parts.reporting.log.writer.begin(first, purge_step=first * parts.h * parts.tokens_per_step)
    if parts.writes:  # once the workdir is known to be this run's; the last thing before
      runinfo.write_run_json(parts, self.state)  # round 1 (benches time start-up by it)
    parts.sync.membership.started()
    return done + 1

  def _end(self, preempted_at: int | None) -> TrainResult:
    """After the last round (or the round a preemption stopped at): the final eval and
    checkpoint, the files closed, the last lines and the loss plot."""
    parts = self.parts
    parts.reporting.bar.close()
    final_params = final_eval = None
    if preempted_at is None:
      final_params, final_eval = self.finish_run()
    parts.storage.store.wait()
    parts.storage.store.close()
    log = parts.reporting.log
    log.writer.close()
    if preempted_at is not None and (parts.prints or parts.sync.preemption.alone):
      print(f"preempted: stopped after round {preempted_at} with a checkpoint in "
            f"{parts.storage.store.directory}; run the same command to continue", flush=True)
    elif parts.writes:
      title = (f"{parts.config.mode}: {parts.num_hosts} host(s) x {parts.replicas_per_host} "
               f"replicas, H={parts.h}")
      records, spec = log.writer.records, parts.spec
      if final_eval is not None:
        lines.report(records, parts.workdir, final_eval=float(final_eval), floor=spec.floor,
                     unigram=spec.unigram_loss, elapsed=log.elapsed,
                     num_rounds=parts.num_rounds, title=title)
      else:  # a live job's other hosts: the plot in their own workdir, no line
        plots.plot_losses(records, os.path.join(parts.workdir, "loss.png"),
                          floor=spec.floor, unigram=spec.unigram_loss, title=title)
    state = self.state
    return TrainResult(final_params if preempted_at is None else
                       parts.sync.driver.model(state.outer, state.replicas),
                       state.outer.state, state.replicas, log.writer.records,
                       {"inner_step": parts.model.inner.traces,
                        "eval_step": parts.model.eval_step.traces},
                       preempted_at)

  def finish_run(self) -> tuple[Any, Any]:
    """After the last round: apply what is still in flight, evaluate the final model,
    write the last record and the final checkpoint (unless the run had finished). Returns
    the final params and (the evaluating host's) their eval loss."""
    parts, num_rounds = self.parts, self.parts.num_rounds
    finished_before = self.state.finished_before
    if not finished_before:
      if num_rounds == 0:  # the initial model only: its eval and checkpoint 0
        parts.reporting.log.open(0, inner_step=0, tokens=0)
      self.state = rounds.take(parts, self.state, num_rounds,
                               parts.sync.driver.drain(self.state.outer, self.state.replicas))
    final_params = parts.sync.driver.final(self.state.outer, self.state.replicas)
    final_eval = None
    if parts.evaluates:
      final_eval = parts.model.eval_step(final_params, parts.model.eval_batches)
      if not finished_before:
        parts.reporting.log.add(num_rounds, eval_loss=final_eval, floor=parts.spec.floor)
    if not finished_before:
      hostmem.trim()  # what the eval's compile freed, before the save adds its buffers
      parts.storage.store.save(state_lib.snapshot(parts, self.state, num_rounds,
                                                  finished=True, model=final_params),
                               last=True)
      parts.storage.store.wait()  # the last line's "ETA 0s" is printed once it is on disk
      parts.reporting.log.write_through(num_rounds)
    return final_params, final_eval

  def _save(self, r: int) -> None:
    """Starts a checkpoint of round r and writes its record if its figures are in (async
    modes: once its sum arrives, and again after a resume), so that the metrics file and
    the checkpoint agree. Figures still being gathered across hosts are waited for first: a
    host lost meanwhile must not leave a checkpoint whose record no one wrote (a resume from
    it would never write it). The checkpoint reaches the disk only once the record is
    written: a small one could otherwise be complete while the record still waited for
    its eval, and a host killed in between left a checkpoint whose record no resume
    writes."""
    log, store = self.parts.reporting.log, self.parts.storage.store
    log.settle(r)
    written = threading.Event()
    try:
      log.add(r, checkpoint_blocking=store.save(self.snapshot(r), after=written))
      log.write_through(r)
    finally:
      written.set()


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, restart_from_scratch: bool = False, *,
    world: world_lib.World | None = None,
    pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None) -> TrainResult:
  """Trains per `config`, writing run.json, metrics, TensorBoard events and a loss plot to
  `workdir` (host 0; under live membership every host to its own). On several hosts,
  `world` is the job's (`membership.start.start`); None: `jax.distributed`'s hosts (one,
  unless it was started).
  `restart_from_scratch`: move the workdir's previous run aside and start from round 1.
  `pseudo_gradient_hook`: transforms this host's pseudo-gradients before they are checked
  and sent (`modes.base.PseudoGradientHook`; a tool's, e.g. bench/poison.py's attacks)."""
  with dispatch.Dispatcher() as dispatcher:
    trainer = Trainer(config, workdir, dispatcher, world, restart_from_scratch,
                      pseudo_gradient_hook=pseudo_gradient_hook)
    parts = trainer.parts
    try:
      with parts.sync.preemption.handling_signals():
        return trainer.run()
    finally:
      parts.reporting.bar.close()  # after an error too: the terminal gets its cursor back
      parts.reporting.profile.close()
      if parts.storage.lock is not None:
        parts.storage.lock.release()
      collector.released()  # in a process that goes on (a test, a notebook)
      if hasattr(parts.sync.membership, "close"):  # live: leave, so no one waits for the lease,
        # and the dispatch thread's op in flight ends before the sockets it uses close
        parts.sync.membership.close(drained=lambda timeout_s: dispatcher.close(timeout_s))
