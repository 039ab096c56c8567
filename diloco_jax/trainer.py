"""The round loop: inner phases on every replica, the outer step, eval, metrics.

One round is H inner steps of every local replica (one jitted call per step, dispatched
without waiting), then the outer step (`outer.py`): Δ of every replica is summed on this
host, across hosts on the dispatch thread, and the outer optimizer moves the anchor,
which is copied back into every replica. Metrics are read one round late so the devices
never wait for logging; only host 0 prints and writes files.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import diloco_jax
from diloco_jax import checkpoint as checkpoint_lib
from diloco_jax import collective as collective_lib
from diloco_jax import config as config_lib
from diloco_jax import data as data_lib
from diloco_jax import dispatch
from diloco_jax import elastic
from diloco_jax import inner
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import optim
from diloco_jax import outer as outer_lib
from diloco_jax import state as state_lib
from diloco_jax import streaming_step
from diloco_jax import wire as wire_lib


class TrainResult(NamedTuple):
  """Attributes: params, the trained params (the final anchor; eager: the mean of all
  replicas; ddp: its one set), on the local devices; outer_state, the final outer state
  (OuterState, or EagerState, on the host); replicas, this host's final ReplicaState;
  records, one metrics dict per round; traces, how often each jitted inner program was
  traced; preempted_at, the round after which a preemption stopped the run (None: it ran
  to the end)."""
  params: Any
  outer_state: Any
  replicas: state_lib.ReplicaState
  records: list[dict[str, Any]]
  traces: dict[str, int]
  preempted_at: int | None = None


OUTER_STEPS = {"sync": outer_lib.SyncOuterStep, "delayed": outer_lib.DelayedOuterStep,
               "eager": outer_lib.EagerOuterStep, "streaming": streaming_step.StreamingOuterStep}
# The parts of the outer step on the main thread's path (seconds; see README).
OUTER_PARTS = ("outer_d2h", "outer_mean", "outer_update", "outer_h2d")


class AnchorMismatchError(RuntimeError):
  """debug_checks: the outer state differs between hosts after an outer step."""


class RestartForRejoin(Exception):  # noqa: N818 -- a request, not a failure
  """Elastic mode: a host returned; a checkpoint is written and every host must restart."""


class Trainer:
  """Everything one host needs for a run; `run_round(r)` trains round r and returns its
  (not yet logged) record, `run()` the whole run."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               dispatcher: dispatch.Dispatcher):
    config_lib.validate(config, num_local_devices=jax.local_device_count(),
                        num_hosts=jax.process_count())
    checkpoint_lib.check_writable(workdir)
    self.config, self.workdir, self.dispatcher = config, workdir, dispatcher
    self.host, self.num_hosts = jax.process_index(), jax.process_count()
    self.is_host0 = self.host == 0
    self.replicas_per_host = config.replicas_per_host
    self.h, self.num_rounds = config.inner_steps, config.num_rounds
    self.total_steps = self.num_rounds * self.h
    self.num_replicas = self.replicas_per_host * self.num_hosts  # K
    self.tokens_per_step = self.num_replicas * config.batch_size * config.model.seq_len

    self.data = data_lib.make_host_data(
        config.data, seq_len=config.model.seq_len, batch_size=config.batch_size,
        replicas_per_host=self.replicas_per_host, num_eval_batches=config.eval_batches,
        host_index=self.host, num_hosts=self.num_hosts)
    self.spec = self.data.spec
    model_cfg = model_lib.GPTConfig.from_config(config.model, self.spec.vocab_size)
    loss_fn = model_lib.make_loss_fn(model_cfg)
    inner_optimizer = optim.inner_optimizer(config.inner, self.total_steps)
    self.mesh = inner.local_mesh()
    self.elastic = config.elastic and self.num_hosts > 1
    self.collective = (elastic.ElasticCollective(config.elastic_timeout) if self.elastic
                       else collective_lib.make_collective())
    self.ddp = config.mode == "ddp"

    self._done_before, self._round_losses = 0, []  # inner steps finished, for `overlap_steps`
    o, streaming_kw = config.outer, {}
    if config.mode == "streaming":
      streaming_kw = dict(num_fragments=o.fragments, layout=o.fragment_layout,
                          overlap_steps=o.overlap_steps, merge_alpha=o.merge_alpha,
                          num_rounds=self.num_rounds, inner_steps=self.h)
    self.outer_step = OUTER_STEPS.get(config.mode, outer_lib.SyncOuterStep)(  # ddp: its state
        optim.outer_optimizer(o), mesh=self.mesh, collective=self.collective,
        dispatcher=dispatcher, replicas_per_host=self.replicas_per_host,
        steps_done=self._steps_done, max_skipped_rounds=o.max_skipped_rounds,
        wire=wire_lib.Wire(o, self.num_replicas), **streaming_kw)
    if self.elastic:  # the mean divides by the live replicas; host 0 relays returning hosts
      self.outer_step.extra = lambda: {
          "replicas": self.replicas_per_host,
          "rejoin": float(self.is_host0 and bool(elastic.rejoin_requested()))}
    with jax.default_device(self.outer_step.host_device):
      anchor = model_lib.init_params(model_cfg, jax.random.key(config.seed))
    self.num_params = model_lib.count_params(anchor)
    self.outer_state = self.outer_step.init(anchor)
    if self.ddp:
      reduce = None
      if self.num_hosts > 1:
        reduce = lambda g: self.dispatcher.run(self.collective.sum, jax.device_get(g),
                                               what="cross-host sum of gradients")
      self.train_step = inner.DDPStep(loss_fn, inner_optimizer, mesh=self.mesh,
                                      num_replicas=self.num_replicas, reduce=reduce,
                                      grad_accum_steps=config.grad_accum_steps)
    else:
      self.train_step = inner.ReplicaStep(loss_fn, inner_optimizer, mesh=self.mesh,
                                          grad_accum_steps=config.grad_accum_steps)
    # ddp keeps one set of params (a replica axis of size 1) for all replicas' gradients.
    self._init_replicas = jax.jit(
        functools.partial(state_lib.init_replica_state, inner_optimizer,
                          num_replicas=1 if self.ddp else self.replicas_per_host),
        out_shardings=self.train_step.state_sharding)
    self.replicas = self._init_replicas(jax.device_put(anchor, self.train_step.state_sharding))
    self.eval_step = inner.EvalStep(loss_fn, mesh=self.mesh)
    self.eval_batches = self.eval_step.put(self.data.eval_batches)
    self.bar: metrics_lib.ProgressBar | None = None
    self.eval_params = None
    self.finished_before = False  # resumed from the checkpoint of a finished run
    self.checkpointer = checkpoint_lib.Checkpointer(
        workdir, keep=config.checkpoint.keep, dispatcher=dispatcher,
        collective=self.collective,
        elastic_timeout=config.elastic_timeout if self.elastic else None)
    self._sigterm = threading.Event()  # one host: SIGTERM asks for a checkpoint and exit

  def run_round(self, r: int) -> dict[str, Any]:
    """Round r: H inner steps of every local replica, then the outer step. Returns the
    round's record; parts of it arrive later (the loss with the cross-host sum)."""
    self._done_before += len(self._round_losses)
    self._round_losses = losses = []
    for i in range(self.h):
      self.replicas, loss_R = self.train_step(self.replicas, self.data.next_batch())
      losses.append(loss_R)
      if i + 1 < self.h and not self.ddp:  # streaming syncs fragments mid-round
        self.outer_state, self.replicas = self.outer_step.on_step(
            self.outer_state, self.replicas, (r - 1) * self.h + i + 1, r)
      if self.bar is not None:
        self.bar.update((r - 1) * self.h + i + 1, f"round {r}/{self.num_rounds}")
    loss_sum = jax.numpy.sum(jax.numpy.stack(losses))  # dispatched, not waited for
    if self.ddp:
      self.eval_params = jax.tree.map(lambda x: x[0], self.replicas.params)  # its one set
      record = {"round": r, "loss_sum": self._host_sum(loss_sum, r)}
    else:
      self.outer_state, self.replicas, self.eval_params, record = self.outer_step(
          self.outer_state, self.replicas, loss_sum, r)
      if self.config.debug_checks:
        record["anchor_hash"] = self._check_same_outer_state(r)
    record.update(inner_step=r * self.h, tokens=r * self.h * self.tokens_per_step)
    if self.is_host0 and r % self.config.eval_every == 0 and r < self.num_rounds:
      record["eval_loss"] = self.eval_step(self.eval_params, self.eval_batches)  # read late
      record["floor"] = self.spec.floor
    return record

  def _steps_done(self) -> int:
    """Inner steps finished on the devices so far (read from the dispatch thread)."""
    return self._done_before + sum(loss.is_ready() for loss in list(self._round_losses))

  def finish_run(self, last: dict[str, Any] | None) -> None:
    """After the last round: apply what is still in flight, then the final eval (into
    the last round's record; None when it was logged before a resume)."""
    if not self.ddp:
      self.outer_state, self.replicas, self.eval_params = self.outer_step.drain(
          self.outer_state, self.replicas)
    self.final_eval = None
    if self.is_host0:
      self.final_eval = self.eval_step(self.eval_params, self.eval_batches)
      if last is not None:
        last["eval_loss"], last["floor"] = self.final_eval, self.spec.floor

  def _host_sum(self, x: jax.Array, r: int) -> float:
    if self.num_hosts == 1:
      return x
    return float(self.dispatcher.run(self.collective.sum, np.asarray(x), round_=r,
                                     what="cross-host sum of losses"))

  def _check_same_outer_state(self, r: int) -> str:
    """Hashes the outer state on every host and stops if any two hosts differ."""
    digest = state_lib.fingerprint(self.outer_step.replicated(self.outer_state))
    words = np.frombuffer(bytes.fromhex(digest), np.uint32)
    every = self.dispatcher.run(self.collective.allgather, words, round_=r,
                                what="debug check of the outer state")
    if not (every == words).all():
      hashes = ", ".join(f"host {h}: {row.tobytes().hex()[:16]}" for h, row in enumerate(every))
      raise AnchorMismatchError(f"round {r}: the outer state differs between hosts ({hashes})")
    return digest[:16]

  def snapshot(self, r: int, finished: bool = False) -> checkpoint_lib.Snapshot:
    """Everything needed to continue after round r (after its outer step); `finished`:
    after the last round, with what was in flight applied (the final model)."""
    shared, own_outer = self.outer_step.split(self.outer_state)
    own = {"replicas": self.replicas,
           "data": checkpoint_lib.encode_json(self.data.get_state())}
    if own_outer is not None:
      own["outer"] = own_outer
    inflight = self.outer_step.inflight()
    if inflight is not None:
      own["inflight"] = inflight
    meta = {"round": r, "finished": finished, "inflight": inflight is not None,
            "mode": self.config.mode, "num_hosts": self.num_hosts,
            "replicas_per_host": self.replicas_per_host,
            "skipped_total": self.outer_step.skipped_total,
            "skipped_in_a_row": self.outer_step.skipped_in_a_row,
            "data_state": self.data.get_state(),  # host 0's (meta is written by host 0)
            "config": self.config.to_dict(), "diloco_jax": diloco_jax.__version__,
            "jax": jax.__version__, "saved_at": time.time()}
    return checkpoint_lib.Snapshot(r, shared, own, meta)

  def _check_checkpoint(self, meta: dict) -> None:
    checkpoint_lib.check_compatible(
        meta, self.config, num_hosts=self.num_hosts, replicas_per_host=self.replicas_per_host,
        where=f"checkpoint {meta['round']} in {self.checkpointer.directory}")

  def resume(self) -> tuple[int, dict | None]:
    """Restores the newest readable checkpoint. Returns the last round it holds (0: none)
    and, in async modes, that round's record, whose sum is issued again."""
    def like(meta):
      snap = self.snapshot(0)
      if meta["inflight"]:
        snap.own["inflight"] = self.outer_step.inflight_like(self.replicas.params)
      return snap

    snap = self.checkpointer.restore(like, self._check_checkpoint)
    if snap is None:
      return 0, None
    self.finished_before = snap.meta["finished"]
    r, own = snap.round, snap.own
    if own is None:  # elastic: this host was down when the checkpoint was written
      self._rejoin_from_anchor(snap)
      own = {}
    else:
      self.outer_state = self.outer_step.join(snap.shared, own.get("outer"))
      self.replicas = jax.device_put(own["replicas"], self.train_step.state_sharding)
      self.data.set_state(checkpoint_lib.decode_json(own["data"]))
    self.outer_step.skipped_total = snap.meta["skipped_total"]
    self.outer_step.skipped_in_a_row = snap.meta["skipped_in_a_row"]
    self._done_before = r * self.h
    if self.ddp or self.config.mode == "eager":
      self.eval_params = jax.tree.map(lambda x: x[0], self.replicas.params)
    else:
      self.eval_params = self.outer_step.model(self.outer_state)
    if self.is_host0:
      print(f"resumed from checkpoint {r} ({self.checkpointer.directory}/{r}): outer "
            f"state, {self.num_replicas} replicas' inner state and data iterators"
            + (", the pseudo-gradients in flight" if "inflight" in own else "")
            + ("; the run had finished" if self.finished_before
               else f"; continuing at round {r + 1} of {self.num_rounds}"), flush=True)
    if "inflight" not in own:
      return r, None
    record = {"round": r, "inner_step": r * self.h, "tokens": r * self.h * self.tokens_per_step,
              "resumed": True, "round_time": 0.0, "tokens_per_sec": 0.0, "elapsed": 0.0,
              "eta": 0.0}
    if self.is_host0 and r % self.config.eval_every == 0 and r < self.num_rounds:
      record.update(eval_loss=self.eval_step(self.eval_params, self.eval_batches),
                    floor=self.spec.floor)
    if self.config.debug_checks:
      record["anchor_hash"] = self._check_same_outer_state(r)
    self.outer_step.resume_inflight(own["inflight"], record, r)
    return r, record

  def _rejoin_from_anchor(self, snap: checkpoint_lib.Snapshot) -> None:
    """A host back after elastic mode trained without it: its replicas start from the
    anchor with fresh AdamW moments (the step count, which drives the lr schedule, set
    to the run's), and its data iterators where host 0's are (every replica has read
    the same number of batches of its own shard)."""
    self.outer_state = self.outer_step.join(snap.shared, None)
    replicas = self._init_replicas(self.outer_step.place(self.outer_state.anchor))
    step = snap.round * self.h
    self.replicas = replicas.replace(opt_state=state_lib.with_step_count(replicas.opt_state,
                                                                         step))
    self.data.set_state(snap.meta["data_state"])
    print(f"host {self.host}: rejoining at round {snap.round + 1}: replicas from the anchor "
          f"with fresh optimizer moments (step {step})", flush=True)

  def request_preemption(self) -> None:
    """One host (a SIGTERM handler): stop after this round with a checkpoint."""
    self._sigterm.set()

  def preempted(self, r: int) -> bool:
    """Whether any host got a preemption notice (SIGTERM); every host answers the same
    for the same round (JAX's preemption sync point, through the coordination service)."""
    if self.num_hosts == 1:
      return self._sigterm.is_set()
    try:
      return multihost_utils.reached_preemption_sync_point(r)
    except RuntimeError:  # the preemption service is off
      return False

  def print_startup(self) -> None:
    devices = [str(d) for d in self.mesh.devices.flat]
    print(f"host {self.host}/{self.num_hosts}: {len(devices)} local device(s) {devices}, "
          f"{self.replicas_per_host} replica(s), mode {self.config.mode}", flush=True)
    if self.is_host0:
      spec = self.spec
      floor = f"{spec.floor:.4f}" if spec.floor is not None else "unknown (not synthetic)"
      print(f"model {self.num_params / 1e6:.2f}M params; {self.num_replicas} replicas "
            f"({self.num_hosts} host(s) x {self.replicas_per_host}); {self.num_rounds} rounds x "
            f"{self.h} inner steps; {self.tokens_per_step * self.total_steps:,} tokens; "
            f"loss floor {floor}, best unigram loss {spec.unigram_loss:.4f}", flush=True)

  def run(self) -> TrainResult:
    self.print_startup()
    done, pending = self.resume()  # pending: the last record, still holding device values
    self.writer = metrics_lib.MetricsWriter(
        self.workdir, enabled=self.is_host0,
        resume_before=(done if pending is not None else done + 1) if done else None)
    self.bar = metrics_lib.ProgressBar(self.total_steps, enabled=self.is_host0)
    round_times: list[float] = []
    every, preempted_at = self.config.checkpoint.every, None
    if self.elastic and self.is_host0:
      elastic.mark_running()

    t_round = time.perf_counter()
    for r in range(done + 1, self.num_rounds + 1):
      record = self.run_round(r)
      if pending is not None:
        self._log(pending)  # Round r-1's values: read after round r's work was dispatched.
      now = time.perf_counter()
      round_times.append(now - t_round)
      t_round = now
      # The first round includes compilation; later rounds predict the rest better.
      typical = np.mean(round_times[1:] if len(round_times) > 1 else round_times)
      record.update(round_time=round_times[-1],
                    tokens_per_sec=self.h * self.tokens_per_step / round_times[-1],
                    elapsed=float(np.sum(round_times)),
                    eta=float(typical * (self.num_rounds - r)))
      pending = record
      if record.get("rejoin") and r < self.num_rounds:
        self._restart_for_rejoin(r, pending)
      preempted = self.preempted(r)
      if r < self.num_rounds and (preempted or (every and r % every == 0)):
        pending = self._save(r, pending)
      if preempted and r < self.num_rounds:
        preempted_at = r
        break
      t_round = time.perf_counter()  # the save's blocking part is in the next round

    if self.finished_before:
      self.final_eval = (self.eval_step(self.eval_params, self.eval_batches)
                         if self.is_host0 else None)
    elif preempted_at is None:
      self.finish_run(pending)
      self.checkpointer.save(self.snapshot(self.num_rounds, finished=True))
    if pending is not None and preempted_at is None:  # else logged after the resume
      self._log(pending)
    self.checkpointer.wait()
    self.checkpointer.close()
    self.writer.close()
    if preempted_at is not None:
      if self.is_host0:
        print(f"preempted: stopped after round {preempted_at} with a checkpoint in "
              f"{self.checkpointer.directory}; run the same command to continue", flush=True)
    elif self.is_host0:
      self._report(self.writer.records, float(np.sum(round_times)))
    return TrainResult(self.eval_params, self.outer_state, self.replicas, self.writer.records,
                       {"inner_step": self.train_step.traces, "eval_step": self.eval_step.traces},
                       preempted_at)

  def _restart_for_rejoin(self, r: int, record: dict) -> None:
    """Elastic mode, a host has returned: checkpoint this round boundary, let the
    returning host go, and stop every host so that the launcher restarts them all."""
    self._save(r, record)
    self.checkpointer.wait()
    self.writer.close()
    if self.is_host0:
      print(f"round {r}: a host returned; checkpoint {r} written; every host restarts "
            f"and resumes from it", flush=True)
      elastic.signal_restart()
    raise RestartForRejoin(f"restart after round {r} for a returning host")

  def _save(self, r: int, record: dict) -> dict | None:
    """Starts a checkpoint of round r. Returns the round's record if it is still waiting
    for its sum (async modes: logged when it arrives, and again after a resume), else
    logs it now so that the metrics file and the checkpoint agree."""
    record["checkpoint_blocking"] = self.checkpointer.save(self.snapshot(r))
    if self.outer_step.pending is not None:
      return record
    self._log(record)
    return None

  def _log(self, record: dict) -> None:
    """Completes a round's record (its values have arrived by now) and logs it."""
    live = int(record.get("replicas", self.num_replicas))  # elastic: the live replicas
    record["train_loss"] = float(record.pop("loss_sum")) / (live * self.h)
    if "eval_loss" in record:
      record["eval_loss"] = float(record["eval_loss"])
    record["outer_time"] = sum(record.get(k, 0.0) for k in OUTER_PARTS)
    if "stats" in record:  # [hosts, R, 3] -> per replica, in replica order
      stats = record.pop("stats").result().reshape(-1, 3)  # live replicas (elastic)
      record.update(delta_norm=stats[:, 0].tolist(), delta_cos=stats[:, 1].tolist(),
                    param_spread=float(np.sqrt(max(stats[:, 2].mean(), 0.0))))
    self.bar.clear()
    if self.is_host0:
      print(metrics_lib.round_line(record, self.num_rounds, self.total_steps), flush=True)
    self.writer.write(record)

  def _report(self, records, elapsed: float) -> None:
    spec, final_eval = self.spec, float(self.final_eval)
    floor = f"{spec.floor:.4f}" if spec.floor is not None else "unknown"
    print(f"final eval loss {final_eval:.4f} | loss floor {floor} | best unigram loss "
          f"{spec.unigram_loss:.4f} | {self.num_rounds} rounds in "
          f"{metrics_lib.format_duration(elapsed)}", flush=True)
    metrics_lib.plot_losses(
        records, os.path.join(self.workdir, "loss.png"), floor=spec.floor,
        unigram=spec.unigram_loss,
        title=f"{self.config.mode}: {self.num_hosts} host(s) x {self.replicas_per_host} "
              f"replicas, H={self.h}")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Trains per `config`, writing metrics, TensorBoard events and a loss plot to `workdir`
  (host 0). On several hosts, `distributed.initialize` must have run first."""
  with dispatch.Dispatcher() as dispatcher:
    trainer = Trainer(config, workdir, dispatcher)
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
      return trainer.run()  # several hosts: JAX's preemption notifier handles SIGTERM
    previous = signal.signal(signal.SIGTERM, lambda *_: trainer.request_preemption())
    try:
      return trainer.run()
    finally:
      signal.signal(signal.SIGTERM, previous)
