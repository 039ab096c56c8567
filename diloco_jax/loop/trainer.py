"""The round loop: inner phases of every local replica, the outer step, eval, checkpoints.

One round is H inner steps of every local replica (one jitted call per step, dispatched
without waiting), then the mode's outer step. Every mode's driver comes from
`modes.registry` and is used only through `modes.base.Driver`, so nothing here depends on
the mode. What a round reports travels back as values into `metrics.RoundLog`, which
writes each record one round late so the devices never wait for logging; only host 0
prints and writes files.
"""

from __future__ import annotations

import time
import uuid
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.checkpoints import store
from diloco_jax.loop import membership as membership_lib
from diloco_jax.reporting import metrics
from diloco_jax.reporting import profiling
from diloco_jax.checkpoints import resize
from diloco_jax.loop import setup
from diloco_jax.reporting import writers
from diloco_jax.modes import base as modes_base
from diloco_jax.runtime import hostmem
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
  replicas: state_lib.ReplicaState
  records: list[dict[str, Any]]
  traces: dict[str, int]
  preempted_at: int | None = None


class RestartForRejoin(Exception):  # noqa: N818 -- a request, not a failure
  """Elastic mode: a host returned; a checkpoint is written and every host must restart."""


class Trainer(setup.Setup):
  """One host's run: `run_round(r)` trains round r, `run()` the run (what it is built from:
  `setup.Setup`)."""

  def run_round(self, r: int) -> None:
    """Round r: H inner steps of every local replica (balance 'speed': this host's share,
    `self.pacer`), then the outer step. Its record opens in `self.log`; the figures of
    its sums join it when they arrive."""
    n = self.pacer.my_steps(r)
    self._open_record(r)
    losses, t = [], time.perf_counter()
    for i in range(n):
      step = (r - 1) * self.h + (i + 1) * self.h // n  # the progress in slowest-host steps
      with profiling.step_annotation("inner_step", step_num=step):
        self.replicas, loss_R = self.train_step(self.replicas, self.data.next_batch())
      losses.append(loss_R)
      if i + 1 < n:  # streaming syncs fragments mid-round
        self._take(r, self.outer_step.after_step(self.outer, self.replicas, step, r))
      self.bar.update(step, f"round {r}/{self.num_rounds}")
    if self.exchange.pace is not None:  # this host's speed: its inner phase, if not compiled
      jax.block_until_ready(self.replicas)  # (the outer step waits for it first thing)
      self.pacer.measured(r, 0.0 if self._compiles else time.perf_counter() - t)
      self._compiles = False
    if self._await_steps_once:
      # The round's end compiles its programs (the outer step's, the loss sum's) on first
      # use, while the steps dispatched ahead still run. On CPU they run on the same cores
      # (nothing is gained) and the compiler's memory adds to the steps' peak: the first
      # round waits for its steps. Accelerators keep the overlap.
      jax.block_until_ready(self.replicas)
      self._await_steps_once = False
    loss_sum = jnp.sum(jnp.stack(losses))  # dispatched, not waited for
    with profiling.annotate("outer_step"):
      self._take(r, self.outer_step.end_round(self.outer, self.replicas, loss_sum, r))
    self._round_checks(r)
    if (peak := mesh_lib.peak_bytes(self.mesh.devices.flat)) is not None:
      self.log.add(r, device_peak_bytes=peak)  # accelerators: the allocator's peak so far
    hostmem.trim()  # what the round's compiles and host copies freed

  def _open_record(self, r: int, **figures) -> None:
    """Round r's record; with unequal steps, the losses its train loss averages."""
    steps = self.pacer.steps(r)
    if steps != (self.h,) * self.num_hosts:
      figures["_loss_terms"] = sum(steps) * self.replicas_per_host
    self.log.open(r, inner_step=r * self.h,
                  tokens=self.pacer.tokens_through(r, self.tokens_per_replica_step), **figures)

  def _take(self, r: int, update: modes_base.Update) -> None:
    self.outer, self.replicas = update.outer, update.replicas
    self.log.add_times(r, update.times)
    self.log.add_synced(update.synced)
    for s in update.synced:
      if s.arrived.pace is not None:
        figures = self.pacer.arrived(s.arrived.round, s.arrived.pace, now=r)
        self.log.add_if_open(s.arrived.round, **figures, hosts_tokens=[
            n * self.replicas_per_host * self.tokens_per_replica_step
            for n in figures["hosts_steps"]])
    if self.pacer.take_changed():
      self._reschedule(announce=True)

  def _reschedule(self, announce: bool = False) -> None:
    """balance 'speed': this host's learning-rate schedule spans the steps it trains in
    the run (`pacing.Pacer.schedule_steps`; recompiled when that changes, and the round
    after is not timed)."""
    total = self.pacer.schedule_steps()
    if total != self._schedule_steps:
      self.train_step.reschedule(optim.inner_optimizer(self.config.inner, total))
      self._schedule_steps, self._compiles = total, True
    decision = self.pacer.decisions[-1]
    if announce and self.is_host0:
      print(f"balance: from round {decision.first}, inner steps per host "
            f"{list(decision.steps)} (measured speeds; H = {self.h} for the slowest)",
            flush=True)
      self.write_run_json()

  def _round_checks(self, r: int) -> None:
    """After round r's outer step: the outer state compared across hosts, and the eval,
    when due (the eval is read late)."""
    replicated = self.outer_step.replicated(self.outer, self.replicas)
    self.log.add(r, **self.anchor_check(replicated, r))
    if self.is_host0 and r % self.config.eval_every == 0 and r < self.num_rounds:
      self.log.add(r, eval_loss=self.eval_step(self.outer_step.model(self.outer, self.replicas),
                                               self.eval_batches), floor=self.spec.floor)

  def resume(self) -> int:
    """Restores the newest readable checkpoint and returns the last round it holds (0:
    none). A sum in flight in it is issued again; its round's record is opened anew."""
    def like(meta):
      shared, own = self.outer_step.split_like(self.outer, self.replicas, meta["inflight"])
      return self._snapshot(0, shared, own, False, meta["inflight"])

    snap = self.checkpointer.restore(like, self._check_checkpoint)
    self.run_id = self._agreed_run_id(snap.meta.get("run_id", "") if snap else "")
    storage = "shared" if self.shared_storage else "per_host"
    if snap is None:
      self.start = {"round": 0, "storage": storage}
      if self.config.model.init_from:
        self.start_from_pretrained()
      return 0
    self.finished_before, r = snap.meta["finished"], snap.round
    world = resize.World.of(snap, self.num_hosts)
    resize.check_mode(world, self.config.mode, where=f"checkpoint {r}")
    self.pacer.restore(snap.meta.get("balance"), same_world=not world.changed)
    self._reschedule()
    own = resize.without_inflight(snap.own) if world.partial else snap.own
    if own is None:  # a new, wiped or returning host: no row of its own
      self.outer, self.replicas = membership_lib.rejoin(
          self.outer_step, snap, self._init_replicas, None if world.changed else self.data,
          self.pacer.steps_done(r))
    else:
      self.outer = self.outer_step.join(snap.shared, own)
      self.replicas = self.train_step.place(own["replicas"])
      if not world.changed:  # else every replica starts a new pass over the new shards
        self.data.set_state(store.decode_json(own["data"]))
    recovered = getattr(self.checkpointer, "recovered", None)
    self.start = {"round": r, "storage": storage, **world.describe(),
                  "healed_from": recovered.source if recovered and recovered.healed else None,
                  "heal_bytes": recovered.bytes if recovered else 0,
                  "heal_seconds": recovered.seconds if recovered else 0.0}
    if self.is_host0 and world.partial:
      print(world.message(r, replicas_per_host=self.replicas_per_host,
                          inflight=bool(snap.meta["inflight"])), flush=True)
    if self.is_host0:
      metrics.print_resumed(r, self.checkpointer.directory, replicas=self.num_replicas,
                            inflight=bool(self.outer.inflight),
                            finished=self.finished_before, num_rounds=self.num_rounds)
      if self.config.model.init_from:
        print(f"config.model.init_from = {self.config.model.init_from}: its weights are not "
              f"used (the checkpoint's params win)", flush=True)
    if self.outer.inflight:  # its record was not logged before the checkpoint
      self._open_record(r, resumed=True, round_time=0.0, tokens_per_sec=0.0, elapsed=0.0,
                        eta=0.0)
      self._round_checks(r)
    return r

  def _agreed_run_id(self, saved: str) -> str:
    """The run's id: the checkpoint's, else a new one; host 0's on every host."""
    mine = np.frombuffer(bytes.fromhex(saved or uuid.uuid4().hex), np.uint8)
    words = self.dispatcher.run(self.collective.allgather, mine, what="agreeing on the run")
    return bytes(words[0]).hex()

  def run(self) -> TrainResult:
    self.announce()
    done = self.resume()
    # jax keeps every program it compiled for the life of the process, with its traces:
    # start-up's one-off programs (params and optimizer-state init) are dropped. The inner
    # step keeps its own executable; what else runs later compiles on first use.
    jax.clear_caches()
    hostmem.trim()  # what compiling freed
    if self.is_host0:  # once the workdir is known to be this run's
      self.write_run_json()
    first = done if self.outer.inflight else done + 1  # the first round logged from now on
    log = self.config.log
    self.log.writer = writers.MetricsWriter(
        self.workdir, enabled=self.is_host0, first_round=first,
        purge_step=first * self.h * self.tokens_per_step,
        wandb=dict(project=log.wandb_project, mode=log.wandb_mode, config=self.config.to_dict()))
    every, preempted_at = self.config.checkpoint.every, None
    self.membership.started()

    t_round = time.perf_counter()
    for r in range(done + 1, self.num_rounds + 1):
      self.profile.before_round(r)
      with profiling.annotate(f"round {r}"):
        self.run_round(r)
      self.profile.after_round(r, self.replicas)
      self.log.write_through(r - 1)  # read after round r's work was dispatched
      self.log.timed(r, time.perf_counter() - t_round, steady=not self.profile.covers(r),
                     tokens=sum(self.pacer.steps(r)) * self.replicas_per_host
                     * self.tokens_per_replica_step)
      if self.log.rejoin_requested(r) and r < self.num_rounds:
        self._restart_for_rejoin(r)
      preempted = self.preemption.reached(r)
      if r < self.num_rounds and (preempted or (every and r % every == 0)):
        self._save(r)
      if preempted and r < self.num_rounds:
        preempted_at = r
        break
      t_round = time.perf_counter()  # the save's blocking part is in the next round

    self.bar.close()
    if preempted_at is None:
      self.finish_run()
    self.checkpointer.wait()
    self.checkpointer.close()
    self.log.writer.close()
    if self.is_host0 and preempted_at is not None:
      print(f"preempted: stopped after round {preempted_at} with a checkpoint in "
            f"{self.checkpointer.directory}; run the same command to continue", flush=True)
    elif self.is_host0:
      metrics.report(
          self.log.writer.records, self.workdir, final_eval=float(self.final_eval),
          floor=self.spec.floor, unigram=self.spec.unigram_loss, elapsed=self.log.elapsed,
          num_rounds=self.num_rounds, title=f"{self.config.mode}: {self.num_hosts} host(s) "
          f"x {self.replicas_per_host} replicas, H={self.h}")
    return TrainResult(self.final_params if preempted_at is None else
                       self.outer_step.model(self.outer, self.replicas),
                       self.outer.state, self.replicas, self.log.writer.records,
                       {"inner_step": self.train_step.traces,
                        "eval_step": self.eval_step.traces}, preempted_at)

  def finish_run(self) -> None:
    """After the last round: apply what is still in flight, evaluate the final model,
    write the last record and the final checkpoint (unless the run had finished)."""
    if not self.finished_before:
      if self.num_rounds == 0:  # the initial model only: its eval and checkpoint 0
        self.log.open(0, inner_step=0, tokens=0)
      self._take(self.num_rounds, self.outer_step.drain(self.outer, self.replicas))
    self.final_params = self.outer_step.final(self.outer, self.replicas)
    self.final_eval = None
    if self.is_host0:
      self.final_eval = self.eval_step(self.final_params, self.eval_batches)
      if not self.finished_before:
        self.log.add(self.num_rounds, eval_loss=self.final_eval, floor=self.spec.floor)
    if not self.finished_before:
      hostmem.trim()  # what the eval's compile freed, before the save adds its buffers
      self.checkpointer.save(self.snapshot(self.num_rounds, finished=True), last=True)
      self.checkpointer.wait()  # the last line's "ETA 0s" is printed once it is on disk
      self.log.write_through(self.num_rounds)

  def _restart_for_rejoin(self, r: int) -> None:
    """Elastic mode, a host has returned: checkpoint this round boundary, let the
    returning host go, and stop every host so that the launcher restarts them all."""
    self._save(r)
    self.checkpointer.wait()
    self.log.writer.close()
    if self.is_host0:
      print(f"round {r}: a host returned; checkpoint {r} written; every host restarts "
            f"and resumes from it", flush=True)
      self.membership.signal_restart()
    raise RestartForRejoin(f"restart after round {r} for a returning host")

  def _save(self, r: int) -> None:
    """Starts a checkpoint of round r and writes its record if its figures are in (async
    modes: once its sum arrives, and again after a resume), so that the metrics file and
    the checkpoint agree."""
    self.log.add(r, checkpoint_blocking=self.checkpointer.save(self.snapshot(r)))
    self.log.write_through(r)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, restart_from_scratch: bool = False, *,
    pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None) -> TrainResult:
  """Trains per `config`, writing run.json, metrics, TensorBoard events and a loss plot to
  `workdir` (host 0). On several hosts, `distributed.initialize` must have run first.
  `restart_from_scratch`: move the workdir's previous run aside and start from round 1.
  `pseudo_gradient_hook`: transforms this host's pseudo-gradients before they are checked
  and sent (`modes.base.PseudoGradientHook`; a tool's, e.g. bench/poison.py's attacks)."""
  with dispatch.Dispatcher() as dispatcher:
    trainer = Trainer(config, workdir, dispatcher, restart_from_scratch,
                      pseudo_gradient_hook=pseudo_gradient_hook)
    try:
      with trainer.preemption.handling_signals():
        return trainer.run()
    finally:
      trainer.bar.close()  # after an error too: the terminal gets its cursor back
      trainer.profile.close()
      if trainer.lock is not None:
        trainer.lock.release()
