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
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from diloco_jax import collective as collective_lib
from diloco_jax import config as config_lib
from diloco_jax import data as data_lib
from diloco_jax import dispatch
from diloco_jax import inner
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import optim
from diloco_jax import outer as outer_lib
from diloco_jax import state as state_lib


class TrainResult(NamedTuple):
  """Attributes: params, the trained params (the final anchor; eager: the mean of all
  replicas; ddp: its one set), on the local devices; outer_state, the final outer state
  (OuterState, or EagerState, on the host); replicas, this host's final ReplicaState;
  records, one metrics dict per round; traces, how often each jitted inner program was
  traced."""
  params: Any
  outer_state: Any
  replicas: state_lib.ReplicaState
  records: list[dict[str, Any]]
  traces: dict[str, int]


OUTER_STEPS = {"sync": outer_lib.SyncOuterStep, "delayed": outer_lib.DelayedOuterStep,
               "eager": outer_lib.EagerOuterStep}
# The parts of the outer step on the main thread's path (seconds; see README).
OUTER_PARTS = ("outer_d2h", "outer_mean", "outer_update", "outer_h2d")


class AnchorMismatchError(RuntimeError):
  """debug_checks: the outer state differs between hosts after an outer step."""


class Trainer:
  """Everything one host needs for a run; `run_round(r)` trains round r and returns its
  (not yet logged) record, `run()` the whole run."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               dispatcher: dispatch.Dispatcher):
    config_lib.validate(config, num_local_devices=jax.local_device_count())
    os.makedirs(workdir, exist_ok=True)
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
    self.collective = collective_lib.make_collective()
    self.ddp = config.mode == "ddp"

    self._done_before, self._round_losses = 0, []  # inner steps finished, for `overlap_steps`
    self.outer_step = OUTER_STEPS.get(config.mode, outer_lib.SyncOuterStep)(
        optim.outer_optimizer(config.outer), mesh=self.mesh, collective=self.collective,
        dispatcher=dispatcher, replicas_per_host=self.replicas_per_host,
        steps_done=self._steps_done)
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
    init = jax.jit(functools.partial(state_lib.init_replica_state, inner_optimizer,
                                     num_replicas=1 if self.ddp else self.replicas_per_host),
                   out_shardings=self.train_step.state_sharding)
    self.replicas = init(jax.device_put(anchor, self.train_step.state_sharding))
    self.eval_step = inner.EvalStep(loss_fn, mesh=self.mesh)
    self.eval_batches = self.eval_step.put(self.data.eval_batches)
    self.bar: metrics_lib.ProgressBar | None = None
    self.eval_params = None

  def run_round(self, r: int) -> dict[str, Any]:
    """Round r: H inner steps of every local replica, then the outer step. Returns the
    round's record; parts of it arrive later (the loss with the cross-host sum)."""
    self._done_before += len(self._round_losses)
    self._round_losses = losses = []
    for i in range(self.h):
      self.replicas, loss_R = self.train_step(self.replicas, self.data.next_batch())
      losses.append(loss_R)
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

  def finish_run(self, last: dict[str, Any]) -> None:
    """After the last round: apply what is still in flight, then the final eval."""
    if not self.ddp:
      self.outer_state, self.replicas, self.eval_params = self.outer_step.drain(
          self.outer_state, self.replicas)
    if self.is_host0:
      last["eval_loss"] = self.eval_step(self.eval_params, self.eval_batches)
      last["floor"] = self.spec.floor

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
    writer = metrics_lib.MetricsWriter(self.workdir, enabled=self.is_host0)
    self.bar = metrics_lib.ProgressBar(self.total_steps, enabled=self.is_host0)
    round_times: list[float] = []
    pending = None  # The previous round's record, still holding device values.

    def finish(record):
      """Completes a round's record (its values have arrived by now) and logs it."""
      record["train_loss"] = float(record.pop("loss_sum")) / (self.num_replicas * self.h)
      if "eval_loss" in record:
        record["eval_loss"] = float(record["eval_loss"])
      record["outer_time"] = sum(record.get(k, 0.0) for k in OUTER_PARTS)
      if "stats" in record:  # [hosts, R, 3] -> per replica, in replica order
        stats = record.pop("stats").result().reshape(self.num_replicas, 3)
        record.update(delta_norm=stats[:, 0].tolist(), delta_cos=stats[:, 1].tolist(),
                      param_spread=float(np.sqrt(max(stats[:, 2].mean(), 0.0))))
      self.bar.clear()
      if self.is_host0:
        print(metrics_lib.round_line(record, self.num_rounds, self.total_steps), flush=True)
      writer.write(record)

    t_round = time.perf_counter()
    for r in range(1, self.num_rounds + 1):
      record = self.run_round(r)
      if pending is not None:
        finish(pending)  # Round r-1's values: read after round r's work was dispatched.
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
    self.finish_run(pending)
    finish(pending)
    writer.close()
    if self.is_host0:
      self._report(writer.records, float(np.sum(round_times)))
    return TrainResult(self.eval_params, self.outer_state, self.replicas, writer.records,
                       {"inner_step": self.train_step.traces, "eval_step": self.eval_step.traces})

  def _report(self, records, elapsed: float) -> None:
    spec, final_eval = self.spec, records[-1]["eval_loss"]
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
    return Trainer(config, workdir, dispatcher).run()
