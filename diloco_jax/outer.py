"""The outer step as the trainer runs it, per mode: on the host, across hosts, timed.

The accelerators hold only what plain training holds. The anchor, the outer momentum and
Δ live on this host's CPU device (DESIGN.md, "Where the outer state lives"):

  replicas' params ──d2h──► Δ_m, Σ_local Δ_m ──dispatch thread──► Σ over hosts
      ──► outer optimizer on Σ / K ──► new start point ──h2d──► every local replica

`sync` waits for the sum; `delayed` and `eager` submit it and start the next inner phase
at once, applying it one round later (ALGORITHMS.md §2, §3); `streaming_step` syncs
fragments mid-round. What crosses hosts is `wire`'s (plain sum, or encoded and robustly
aggregated). The math is `diloco`'s, so `simulate` and the trainer agree; this module
adds placement, the cross-host sum (always on the dispatch thread), timings and
diagnostics. A round's record is a dict that is
completed when its sum arrives (the trainer logs it one round late).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from diloco_jax import config as config_lib
from diloco_jax import diloco
from diloco_jax import state as state_lib
from diloco_jax import wire as wire_lib

Params = Any
_PLAIN = config_lib.get_default_config().outer  # no compression, the mean


def entries(tree: Params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _delta_stats(deltas_R: Params, mean: Params) -> jax.Array:
  """[R, 3]: per replica ‖Δ_m‖, cos(Δ_m, Δ̄) and ‖Δ_m − Δ̄‖² (float32)."""
  leaves_R, mean_leaves = jax.tree.leaves(deltas_R), jax.tree.leaves(mean)
  f32 = lambda x: x.astype(jnp.float32)
  dot = sum(jnp.sum(f32(d) * f32(m)[None], axis=tuple(range(1, d.ndim)))
            for d, m in zip(leaves_R, mean_leaves))
  sq = sum(jnp.sum(jnp.square(f32(d)), axis=tuple(range(1, d.ndim))) for d in leaves_R)
  mean_sq = sum(jnp.sum(jnp.square(f32(m))) for m in mean_leaves)
  cos = dot / jnp.maximum(jnp.sqrt(sq * mean_sq), 1e-30)
  return jnp.stack([jnp.sqrt(sq), cos, sq - 2 * dot + mean_sq], axis=1)


class BadPseudoGradientError(RuntimeError):
  """Pseudo-gradients with NaN or Inf entries in `outer.max_skipped_rounds` rounds in a row."""


class Pending:
  """A cross-host sum in flight, what went into it from this host, and the record of the
  round it belongs to."""

  def __init__(self, future: concurrent.futures.Future, record: dict, deltas_R: Params,
               loss_sum, finite_R: np.ndarray, times: dict, key: int, residual_in):
    self.future, self.record, self.times = future, record, times
    self.deltas_R, self.loss_sum, self.finite_R = deltas_R, loss_sum, finite_R
    self.key, self.residual_in = key, residual_in  # fragment; error feedback going in


class OuterStep:
  """What every mode shares: placement, the timed cross-host sum, the round's record."""

  def __init__(self, outer_optimizer: optax.GradientTransformation, *, mesh: Mesh,
               collective, dispatcher, replicas_per_host: int, steps_done=lambda: 0,
               max_skipped_rounds: int = 3, wire: wire_lib.Wire | None = None):
    self.collective, self.dispatcher = collective, dispatcher
    self.replicas_per_host = replicas_per_host
    self.max_skipped_rounds = max_skipped_rounds
    self.skipped_total = self.skipped_in_a_row = 0  # rounds with a NaN/Inf Δ
    self.num_replicas = replicas_per_host * collective.num_hosts  # K
    self.wire = wire or wire_lib.Wire(_PLAIN, self.num_replicas)
    self.host_device = (getattr(collective, "device", None)
                        or jax.local_devices(backend="cpu")[0])
    self.host = SingleDeviceSharding(self.host_device)
    self.on_mesh = NamedSharding(mesh, P())  # replicated on every local device
    self.optimizer = outer_optimizer
    self._steps_done = steps_done  # inner steps finished on the devices so far
    self._deltas = jax.jit(diloco.pseudo_gradients)
    self._sum_R = jax.jit(diloco.replica_sum)
    self._mean = jax.jit(lambda total: diloco.divide(total, self.num_replicas))
    self._stats = jax.jit(_delta_stats)
    self._finite = jax.jit(diloco.finite_replicas)
    self._zero_nonfinite = jax.jit(diloco.zero_nonfinite)
    self._broadcast = jax.jit(
        functools.partial(state_lib.broadcast_to_replicas, num_replicas=replicas_per_host),
        out_shardings=self.on_mesh)
    self._update = jax.jit(functools.partial(diloco.outer_update, self.optimizer),
                           donate_argnums=0)
    self.pending: Pending | None = None
    # Elastic mode: more per-host numbers summed with Δ ({"replicas": R, ...}); the mean
    # then divides by the summed replica count (the live replicas), not K.
    self.extra = None
    self._mean_by = jax.jit(diloco.divide)

  def init(self, anchor: Params):
    # Committed to the host CPU device, as every later outer state is, so the outer-step
    # programs compile once rather than again in round 2.
    self.wire.init_residuals({0: entries(anchor)}, self.replicas_per_host)
    return jax.device_put(state_lib.init_outer_state(self.optimizer, anchor), self.host)

  def model(self, outer_state) -> Params:
    """The params to evaluate, on the local devices."""
    return self.place(outer_state.anchor)

  def on_step(self, outer_state, replicas, step: int, round_: int):
    """After inner step `step` (1-based, over the run), before the round's end: what the
    mode does mid-round (streaming: the fragments' syncs)."""
    return outer_state, replicas

  def place(self, tree: Params) -> Params:
    """A copy on the local devices. Never an alias: on a CPU host, the host device is
    also the compute device, and the outer state must survive the inner step's donation."""
    return jax.device_put(tree, self.on_mesh, may_alias=False)

  def to_host(self, params_R: Params, times: dict) -> Params:
    jax.block_until_ready(params_R)  # the inner phase is done: time the outer step alone
    t = time.perf_counter()
    local_R = jax.block_until_ready(jax.device_put(params_R, self.host))
    times["outer_d2h"] = time.perf_counter() - t
    return local_R

  def pseudo_gradients(self, start: Params, local_R: Params) -> Params:
    """Δ_m = start − θ_m per replica (`start`: the anchor, or [R, ...] per replica)."""
    return self._deltas(start, local_R)

  def check_finite(self, deltas_R: Params, replicas: state_lib.ReplicaState):
    """[R] flags: which local Δ_m are finite. A replica whose Δ is not gets its inner
    optimizer state repaired (NaN/Inf moments set to 0): otherwise it would diverge again
    from the anchor in the next round."""
    finite_R = np.asarray(self._finite(deltas_R))
    if not finite_R.all():
      replicas = replicas.replace(opt_state=self._zero_nonfinite(replicas.opt_state))
    return finite_R, replicas

  def submit(self, deltas_R: Params, loss_sum, finite_R: np.ndarray, record: dict,
             round_: int, key: int = 0) -> Pending:
    """Queues Σ over hosts of (Σ_local Δ_m, the round's loss sum, which replicas' Δ were
    not finite) on the dispatch thread; Δ goes through `self.wire` unless it is plain
    (then Σ Δ, else Σ Δ or Δ̄ as `wire.aggregates` says). `key`: the fragment."""
    host, R = self.collective.host_index, self.replicas_per_host
    bad_K = np.zeros(self.num_replicas, np.float32)  # each host fills its own replicas'
    bad_K[host * R:(host + 1) * R] = ~np.asarray(finite_R, bool)
    payload = {"loss": loss_sum, "bad": bad_K}
    rows = None  # robust aggregation sends every replica's Δ: no local sum to compute
    if self.wire.aggregates:
      rows = deltas_R
    elif self.wire.plain:
      payload["delta"] = self._sum_R(deltas_R)
    else:
      rows = jax.tree.map(lambda x: x[None], self._sum_R(deltas_R))
    if self.extra is not None:
      payload["extra"] = {k: np.float32(v) for k, v in self.extra().items()}
    times: dict = {}

    def job():
      t, done, sent = time.perf_counter(), self._steps_done(), self.collective.bytes_sent
      total = self.collective.sum(payload)
      if rows is not None:
        total["delta"] = self.wire.reduce(self.collective, rows, key)
      jax.block_until_ready(total)
      times.update(collective_time=time.perf_counter() - t,
                   bytes_sent=self.collective.bytes_sent - sent,
                   overlap_steps=self._steps_done() - done)
      return total

    future = self.dispatcher.submit(job, round_=round_,
                                    what="cross-host sum of pseudo-gradients")
    return Pending(future, record, deltas_R, loss_sum, finite_R, times, key,
                   self.wire.residual.get(key))

  def inflight(self) -> dict | None:
    """What this host put into the sum still in flight (checkpointed in async modes: the
    sum is issued again on resume, and arrives with the same bits)."""
    p = self.pending
    if p is None:
      return None
    return {"deltas": p.deltas_R, "loss": p.loss_sum, "finite": p.finite_R}

  def resume_inflight(self, inflight: dict, record: dict, round_: int) -> None:
    """Issues again the sum that was in flight when the checkpoint was written."""
    deltas_R = jax.device_put(inflight["deltas"], self.host)
    self.pending = self.submit(deltas_R, inflight["loss"], np.asarray(inflight["finite"]),
                               record, round_)

  def wait(self, pending: Pending, stats: bool = True) -> tuple[Params, bool]:
    """The mean Δ̄ of `pending`'s round and whether to apply it (False when some replica's
    Δ was not finite, more than robust aggregation tolerates: the same answer on every
    host, which all see the same flags). Completes that round's record (with the Δ
    diagnostics unless `stats` is False)."""
    t = time.perf_counter()
    total = pending.future.result()
    wait = time.perf_counter() - t
    record = pending.record
    if "extra" in total:
      record.update({k: float(v) for k, v in total["extra"].items()})
    if self.wire.aggregates:
      mean = jax.device_put(total["delta"], self.host)
    elif "replicas" in total.get("extra", {}):
      mean = self._mean_by(total["delta"], total["extra"]["replicas"])
    else:
      mean = self._mean(total["delta"])
    ok = self._count_bad(np.asarray(total["bad"]) > 0, record)
    collective = pending.times["collective_time"]
    record.update(pending.times, outer_wait=wait, loss_sum=float(np.asarray(total["loss"])),
                  overlap=float(np.clip(1 - wait / collective, 0, 1)) if collective else 0.0)
    if stats:
      record["stats"] = self.dispatcher.submit(  # gathered on the dispatch thread, read late
          self.collective.allgather, np.asarray(self._stats(pending.deltas_R, mean)),
          round_=record["round"], what="gather of Δ diagnostics")
    return mean, ok

  def _count_bad(self, bad_K: np.ndarray, record: dict) -> bool:
    if not bad_K.any():
      self.skipped_in_a_row = 0
      record["skipped_rounds"] = self.skipped_total
      return True
    R = self.replicas_per_host
    where = ", ".join(f"host {g // R} replica {g % R}" for g in np.flatnonzero(bad_K))
    if bad_K.sum() <= self.wire.tolerated:  # trimmed away by robust aggregation
      self.skipped_in_a_row = 0
      record.update(skipped_rounds=self.skipped_total, bad_replicas=where)
      if self.collective.host_index == 0:
        print(f"WARNING: round {record['round']}: NaN or Inf in the pseudo-gradient of "
              f"{where}; left out by {self.wire.aggregation}", flush=True)
      return True
    self.skipped_total += 1
    self.skipped_in_a_row += 1
    record.update(skipped=1, skipped_rounds=self.skipped_total, bad_replicas=where)
    if self.skipped_in_a_row >= self.max_skipped_rounds:
      raise BadPseudoGradientError(
          f"round {record['round']}: pseudo-gradients with NaN or Inf entries in "
          f"{self.skipped_in_a_row} rounds in a row (outer.max_skipped_rounds="
          f"{self.max_skipped_rounds}); this round from {where}")
    if self.collective.host_index == 0:
      print(f"WARNING: round {record['round']}: NaN or Inf in the pseudo-gradient of "
            f"{where}; outer step skipped on every host ({self.skipped_in_a_row} in a row)",
            flush=True)
    return False

  def replicated(self, outer_state):
    """What must be identical on every host after every outer step."""
    return outer_state

  # Checkpoints (checkpoint.py): the outer state split into what every host holds
  # identically and what is this host's own, and joined again on resume.
  sends_late = False  # True where a round's sum is still in flight after the round.

  def split(self, outer_state) -> tuple[Any, Any]:
    wire = self._wire_state()
    return outer_state, (None if wire is None else {"wire": wire})

  def join(self, shared, own):
    self._set_wire_state(own)
    return jax.device_put(shared, self.host)

  def _wire_state(self) -> dict | None:
    """This host's error-feedback residuals as the next sends will use them (for a send
    still in flight, what went into it: it is issued again on resume)."""
    if not self.wire.feedback:
      return None
    state = dict(self.wire.residual)
    for p in self._in_flight():
      state[p.key] = p.residual_in
    return {str(key): residual for key, residual in state.items()}

  def _set_wire_state(self, own) -> None:
    if own is not None and "wire" in own:
      self.wire.residual = {int(key): np.asarray(v) for key, v in own["wire"].items()}

  def _in_flight(self) -> list[Pending]:
    return [] if self.pending is None else [self.pending]

  def inflight_like(self, params_R: Params) -> dict:
    """The structure of `inflight()`, for restoring it."""
    return {"deltas": params_R, "loss": np.zeros((), np.float32),
            "finite": np.ones(self.replicas_per_host, bool)}

  def to_replicas(self, replicas: state_lib.ReplicaState, anchor: Params, times: dict):
    t = time.perf_counter()
    anchor = self.place(anchor)
    replicas = replicas.replace(params=jax.block_until_ready(self._broadcast(anchor)))
    times["outer_h2d"] = time.perf_counter() - t
    return replicas, anchor


class SyncOuterStep(OuterStep):
  """ALGORITHMS.md §1: wait for the mean pseudo-gradient of all K replicas, then apply it."""

  def __call__(self, outer_state, replicas, loss_sum, round_: int):
    """Returns the new outer state, the replicas reset to it, the params to evaluate (on
    the local devices) and the round's record."""
    record = {"round": round_}
    local_R = self.to_host(replicas.params, record)
    t = time.perf_counter()
    deltas_R = self.pseudo_gradients(outer_state.anchor, local_R)
    finite_R, replicas = self.check_finite(deltas_R, replicas)
    mean, ok = self.wait(self.submit(deltas_R, loss_sum, finite_R, record, round_))
    record["outer_mean"] = time.perf_counter() - t
    t = time.perf_counter()
    if ok:
      outer_state = jax.block_until_ready(self._update(outer_state, mean))
    record["outer_update"] = time.perf_counter() - t
    replicas, anchor = self.to_replicas(replicas, outer_state.anchor, record)
    return outer_state, replicas, anchor, record

  def drain(self, outer_state, replicas):
    return outer_state, replicas, self.place(outer_state.anchor)


class DelayedOuterStep(OuterStep):
  """ALGORITHMS.md §2: submit this round's Δ (measured against this round's start s_r) and
  apply the previous round's mean, s_{r+1} = OuterOpt(s_r, Δ̄^(r−1)), without waiting for
  this round's."""

  sends_late = True

  def __call__(self, outer_state, replicas, loss_sum, round_: int):
    record = {"round": round_}
    local_R = self.to_host(replicas.params, record)
    t = time.perf_counter()
    deltas_R = self.pseudo_gradients(outer_state.anchor, local_R)  # against s_r
    finite_R, replicas = self.check_finite(deltas_R, replicas)
    previous, self.pending = self.pending, None
    if previous is not None:
      mean, ok = self.wait(previous)
      if ok:
        outer_state = jax.block_until_ready(self._update(outer_state, mean))
    self.pending = self.submit(deltas_R, loss_sum, finite_R, record, round_)
    record["outer_update"] = time.perf_counter() - t
    replicas, anchor = self.to_replicas(replicas, outer_state.anchor, record)
    return outer_state, replicas, anchor, record

  def drain(self, outer_state, replicas):
    """Applies the mean still in flight after the last round."""
    if self.pending is not None:
      mean, ok = self.wait(self.pending)
      self.pending = None
      if ok:
        outer_state = self._update(outer_state, mean)
        replicas, _ = self.to_replicas(replicas, outer_state.anchor, {})
    return outer_state, replicas, self.place(outer_state.anchor)


class EagerOuterStep(OuterStep):
  """ALGORITHMS.md §3: each replica applies its fresh Δ_m/K plus the delayed mean of the
  others, Δ̄^(r−1) − Δ_m^(r−1)/K, from its own θ_m with its own momentum; this round's Δ
  goes out on the dispatch thread and is used next round."""

  sends_late = True

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    self._update = jax.jit(functools.partial(diloco.eager_update, self.optimizer,
                                             num_replicas=self.num_replicas),
                           donate_argnums=0)
    self._drain = jax.jit(functools.partial(diloco.eager_drain, self.optimizer,
                                            num_replicas=self.num_replicas))
    self._deltas = jax.jit(lambda start_R, local_R: jax.tree.map(jnp.subtract, start_R,
                                                                  local_R))
    self._drop = jax.jit(diloco.drop_replicas)
    self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))

  def init(self, anchor: Params):
    self.wire.init_residuals({0: entries(anchor)}, self.replicas_per_host)
    return jax.device_put(state_lib.init_eager_state(self.optimizer, anchor,
                                                     self.replicas_per_host), self.host)

  def __call__(self, eager, replicas, loss_sum, round_: int):
    record = {"round": round_}
    local_R = self.to_host(replicas.params, record)
    t = time.perf_counter()
    deltas_R = self.pseudo_gradients(eager.params, local_R)  # each from its own θ_m
    finite_R, replicas = self.check_finite(deltas_R, replicas)
    if not finite_R.all():  # a broken replica applies nothing of its own this round
      deltas_R = self._drop(deltas_R, finite_R)
    previous, self.pending = self.pending, None
    # Round 1 has no delayed mean: Δ̄⁽⁰⁾ = 0 (a fresh buffer: `eager` is donated). Waiting
    # before submitting costs no overlap (the dispatch thread runs jobs in order anyway)
    # and keeps the small diagnostics job of round r−1 ahead of round r's sum.
    prev_mean, ok = (self.wait(previous) if previous is not None
                     else (self._zeros(eager.prev_mean), True))
    if not ok:  # skipped on every host: the delayed term Δ̄ − Δ_m/K of that round is 0
      prev_mean = self._zeros(eager.prev_mean)
      eager = eager.replace(prev_deltas=self._zeros(eager.prev_deltas))
    self.pending = self.submit(deltas_R, loss_sum, finite_R, record, round_)
    eager = jax.block_until_ready(self._update(eager, deltas_R, prev_mean))
    record["outer_update"] = time.perf_counter() - t
    t = time.perf_counter()
    replicas = replicas.replace(params=self.place(eager.params))
    jax.block_until_ready(replicas.params)
    record["outer_h2d"] = time.perf_counter() - t
    # Evaluated: this host's first replica (the replicas differ by their fresh terms).
    return eager, replicas, jax.tree.map(lambda x: x[0], replicas.params), record

  def drain(self, eager, replicas):
    """The last mean arrives: every replica swaps its proxy for it (`diloco.eager_drain`),
    then the final params are the mean over all K replicas (one more cross-host sum)."""
    if self.pending is not None:
      last_mean, ok = self.wait(self.pending)
      self.pending = None
      if ok:
        eager = eager.replace(params=self._drain(eager, last_mean), prev_mean=last_mean)
    total = self.dispatcher.run(self.collective.sum, self._sum_R(eager.params),
                                what="cross-host mean of the final params")
    final = self.place(self._mean(total))
    return eager, replicas.replace(params=self._broadcast(final)), final

  def replicated(self, eager):
    """What must be identical on every host: the delayed mean and the step count."""
    return (eager.prev_mean, eager.step)

  def split(self, eager):
    wire = self._wire_state()
    return ({"prev_mean": eager.prev_mean, "step": eager.step},
            {"params": eager.params, "opt_state": eager.opt_state,
             "prev_deltas": eager.prev_deltas, **({} if wire is None else {"wire": wire})})

  def join(self, shared, own):
    self._set_wire_state(own)
    return jax.device_put(state_lib.EagerState(
        params=own["params"], opt_state=own["opt_state"], prev_deltas=own["prev_deltas"],
        prev_mean=shared["prev_mean"], step=shared["step"]), self.host)

