"""The round loop: inner phases on every replica, the outer step, eval, metrics.

One round is H inner steps of every local replica (one jitted call per step, dispatched
without waiting), then the outer step: the replicas' params are copied to the host, the
mean pseudo-gradient moves the anchor with the outer optimizer, and the new anchor is
copied back into every replica. Metrics are read one round late so the devices never
wait for logging.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from diloco_jax import config as config_lib
from diloco_jax import data as data_lib
from diloco_jax import diloco
from diloco_jax import inner
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import optim
from diloco_jax import state as state_lib


class TrainResult(NamedTuple):
  """Attributes: outer_state, the final OuterState (on the host); replicas, the final
  ReplicaState; records, one metrics dict per round; traces, how often each jitted
  function was traced."""
  outer_state: state_lib.OuterState
  replicas: state_lib.ReplicaState
  records: list[dict[str, Any]]
  traces: dict[str, int]


class OuterStep:
  """The sync outer step, timed in its four parts; the outer state lives on the host CPU.

  The accelerators hold only what plain training holds; the anchor, momentum and Δ stay
  in host memory, where the cross-host mean runs (DESIGN.md, "Where the outer state lives").
  """

  def __init__(self, outer_optimizer, *, mesh, num_replicas: int):
    self.host_device = jax.local_devices(backend="cpu")[0]
    self.host = SingleDeviceSharding(self.host_device)
    self._replicated = NamedSharding(mesh, P())
    self._mean = jax.jit(diloco.mean_pseudo_gradient)
    self._update = jax.jit(functools.partial(diloco.outer_update, outer_optimizer),
                           donate_argnums=0)
    self._broadcast = jax.jit(
        functools.partial(state_lib.broadcast_to_replicas, num_replicas=num_replicas),
        out_shardings=self._replicated)

  def __call__(self, outer_state, replicas):
    times = {}
    # Wait for the inner phase first, so the figures below time the outer step alone.
    jax.block_until_ready(replicas.params)
    t = time.perf_counter()
    local = jax.block_until_ready(jax.device_put(replicas.params, self.host))
    times["outer_d2h"], t = _lap(t)
    mean_delta = jax.block_until_ready(self._mean(outer_state.anchor, local))
    times["outer_mean"], t = _lap(t)
    outer_state = jax.block_until_ready(self._update(outer_state, mean_delta))
    times["outer_update"], t = _lap(t)
    anchor = jax.device_put(outer_state.anchor, self._replicated)
    replicas = replicas.replace(params=jax.block_until_ready(self._broadcast(anchor)))
    times["outer_h2d"], t = _lap(t)
    times["outer_time"] = sum(times.values())
    return outer_state, replicas, anchor, times


def _lap(t0: float) -> tuple[float, float]:
  t = time.perf_counter()
  return t - t0, t


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Trains per `config`, writing metrics, TensorBoard events and a loss plot to `workdir`."""
  config_lib.validate(config, num_local_devices=jax.local_device_count())
  os.makedirs(workdir, exist_ok=True)
  is_host0 = jax.process_index() == 0
  num_replicas = config.replicas_per_host
  h, num_rounds = config.inner_steps, config.num_rounds
  total_steps = num_rounds * h

  data = data_lib.make_host_data(
      config.data, seq_len=config.model.seq_len, batch_size=config.batch_size,
      replicas_per_host=num_replicas, num_eval_batches=config.eval_batches,
      host_index=jax.process_index(), num_hosts=jax.process_count())
  spec = data.spec
  model_cfg = model_lib.GPTConfig.from_config(config.model, spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(model_cfg)
  inner_optimizer = optim.inner_optimizer(config.inner, total_steps)
  outer_optimizer = optim.outer_optimizer(config.outer)
  mesh = inner.local_mesh()
  ddp = config.mode == "ddp"

  outer_step = OuterStep(outer_optimizer, mesh=mesh, num_replicas=num_replicas)
  with jax.default_device(outer_step.host_device):
    anchor = model_lib.init_params(model_cfg, jax.random.key(config.seed))
    # Committed to the host CPU device, as every later outer state is: the outer-step
    # functions then compile once, not once for the first round and again for the rest.
    outer_state = jax.device_put(state_lib.init_outer_state(outer_optimizer, anchor),
                                 outer_step.host)
  train_step = inner.ReplicaStep(loss_fn, inner_optimizer, mesh=mesh,
                                 grad_accum_steps=config.grad_accum_steps, ddp=ddp)
  # ddp keeps one set of params (a replica axis of size 1) for all replicas' gradients.
  replicas = train_step.place(jax.jit(
      functools.partial(state_lib.init_replica_state, inner_optimizer,
                        num_replicas=1 if ddp else num_replicas),
      out_shardings=train_step.state_sharding)(jax.device_put(anchor, train_step.state_sharding)))
  eval_step = inner.EvalStep(loss_fn, mesh=mesh)
  eval_batches = eval_step.put(data.eval_batches)

  num_params = model_lib.count_params(anchor)
  tokens_per_step = num_replicas * jax.process_count() * config.batch_size * config.model.seq_len
  print(f"host {jax.process_index()}/{jax.process_count()}: {len(mesh.devices)} local "
        f"device(s) {[str(d) for d in mesh.devices]}, {num_replicas} replica(s), "
        f"mode {config.mode}", flush=True)
  if is_host0:
    floor = f"{spec.floor:.4f}" if spec.floor is not None else "unknown (not synthetic)"
    print(f"model {num_params / 1e6:.2f}M params; {num_rounds} rounds x {h} inner steps; "
          f"{format(tokens_per_step * total_steps, ',')} tokens; loss floor {floor}, "
          f"best unigram loss {spec.unigram_loss:.4f}", flush=True)

  writer = metrics_lib.MetricsWriter(workdir, enabled=is_host0)
  bar = metrics_lib.ProgressBar(total_steps, enabled=is_host0)
  round_times: list[float] = []
  pending = None  # The previous round's record, still holding device values.

  def finish(record):
    """Reads a round's device values (they are done by now) and logs the round."""
    record["train_loss"] = float(np.mean(jax.device_get(record.pop("losses"))))
    if "eval_loss" in record:
      record["eval_loss"] = float(record["eval_loss"])
    bar.clear()
    if is_host0:
      print(metrics_lib.round_line(record, num_rounds, total_steps), flush=True)
    writer.write(record)

  t_round = time.perf_counter()
  for r in range(1, num_rounds + 1):
    losses = []
    for _ in range(h):
      replicas, loss_R = train_step(replicas, data.next_batch())
      losses.append(loss_R)
      bar.update((r - 1) * h + len(losses), f"round {r}/{num_rounds}")
    if pending is not None:
      finish(pending)  # Round r-1's values: read while round r's steps run.
    if ddp:
      times = {"outer_time": 0.0}
      anchor = jax.tree.map(lambda x: x[0], replicas.params)  # ddp's one set of params
    else:
      outer_state, replicas, anchor, times = outer_step(outer_state, replicas)
    record = {"round": r, "inner_step": r * h, "tokens": r * h * tokens_per_step,
              "losses": losses, **times}
    if r % config.eval_every == 0 or r == num_rounds:
      record["eval_loss"] = eval_step(anchor, eval_batches)
      record["floor"] = spec.floor
    now = time.perf_counter()
    round_times.append(now - t_round)
    t_round = now
    # The first round includes compilation; later rounds predict the rest better.
    typical = np.mean(round_times[1:] if len(round_times) > 1 else round_times)
    record.update(round_time=round_times[-1], tokens_per_sec=h * tokens_per_step / round_times[-1],
                  elapsed=float(np.sum(round_times)), eta=float(typical * (num_rounds - r)))
    pending = record
  finish(pending)
  writer.close()

  final_eval = writer.records[-1]["eval_loss"]
  if is_host0:
    floor = f"{spec.floor:.4f}" if spec.floor is not None else "unknown"
    print(f"final eval loss {final_eval:.4f} | loss floor {floor} | best unigram loss "
          f"{spec.unigram_loss:.4f} | {num_rounds} rounds in "
          f"{metrics_lib.format_duration(float(np.sum(round_times)))}", flush=True)
    metrics_lib.plot_losses(writer.records, os.path.join(workdir, "loss.png"),
                            floor=spec.floor, unigram=spec.unigram_loss,
                            title=f"{config.mode}: {num_replicas} replicas x "
                                  f"{jax.process_count()} host(s), H={h}")
  return TrainResult(outer_state, replicas, writer.records,
                     {"inner_step": train_step.traces, "eval_step": eval_step.traces})
