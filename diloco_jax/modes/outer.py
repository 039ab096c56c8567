"""The outer step on a host: one driver over a mode's `diloco` rule.

The accelerators hold only what plain training holds. The outer state and Δ live on this
host's CPU device, and the cross-host mean runs on the dispatch thread (`exchange.py`):

  replicas' params ──d2h──► Δ_m = start − θ_m ──exchange──► Δ̄ over all K replicas
      ──► rule.apply (the outer optimizer) ──► start points ──h2d──► every local replica

`sync` (delay 0) waits for this round's mean; `delayed` and `eager` (delay 1) send this
round's Δ and apply the previous round's mean, so the sum runs behind the next inner phase.
Streaming's driver (`streaming_step.py`) and ddp's (`ddp.py`) have the same interface and
share `HostSide`'s pieces. Every call returns an `Update`: new values, never a mutation.
"""

from __future__ import annotations

import time
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from diloco_jax.algo import diloco
from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.modes import skips
from diloco_jax.wire import exchange as exchange_lib

Params = Any


class Outer(NamedTuple):
  """What the outer step carries from round to round.

  Attributes:
    state: the mode's outer state on the host (a rule's state; streaming: one OuterState
      per fragment; ddp: None).
    skips: the NaN-skip counters (checkpointed with the state).
    residuals: error feedback per fragment, this host's ({} without feedback).
    inflight: the sums still in flight (exchange.Pending), oldest first.
  """
  state: Any
  skips: state_lib.SkipCounters
  residuals: dict[int, np.ndarray]
  inflight: tuple[exchange_lib.Pending, ...] = ()


class Update(NamedTuple):
  """What one call of a driver returns. `times`: the main thread's seconds in it, by part
  (outer_d2h, outer_mean, outer_update, outer_h2d); `synced`: the sums that arrived."""
  outer: Outer
  replicas: state_lib.ReplicaState
  times: dict[str, float]
  synced: tuple[skips.Synced, ...] = ()


class HostSide:
  """The pieces every driver shares: placement between the local devices and the host,
  Δ, the NaN check, the exchange and the skip policy."""

  def __init__(self, *, mesh: Mesh, exchange: exchange_lib.Exchange,
               max_skipped_rounds: int):
    self.exchange, self.max_skipped_rounds = exchange, max_skipped_rounds
    self.replicas_per_host = exchange.replicas_per_host
    self.param_sets = self.replicas_per_host  # sets of params on the devices
    self.num_replicas = exchange.num_replicas
    self.host = jax.sharding.SingleDeviceSharding(exchange.host_device)
    self.layout = mesh_lib.Layout(mesh)  # how the inner step holds params on the devices
    self._deltas = jax.jit(diloco.pseudo_gradients)
    self._finite = jax.jit(diloco.finite_replicas)
    self._zero_nonfinite = jax.jit(diloco.zero_nonfinite)

  @staticmethod
  def inner_step(loss_fn, optimizer, *, mesh: Mesh, grad_accum_steps: int,
                 **unused) -> inner.ReplicaStep:
    """The inner step this driver's replicas take (every replica, no communication)."""
    del unused
    return inner.ReplicaStep(loss_fn, optimizer, mesh=mesh, grad_accum_steps=grad_accum_steps)

  def after_step(self, outer: Outer, replicas, step: int, round_: int) -> Update:
    """After inner step `step` of round `round_`, before its end (streaming's syncs)."""
    return Update(outer, replicas, {})

  def place(self, tree: Params, per_replica: bool = False) -> Params:
    """A private copy on the local devices, sharded as the inner step holds params
    (`mesh.Layout.put`)."""
    return self.layout.put(tree, per_replica)

  def _broadcast(self, params: Params) -> Params:
    return self.layout.broadcast(params, self.replicas_per_host)

  def to_host(self, params_R: Params) -> tuple[Params, float]:
    jax.block_until_ready(params_R)  # the inner phase is done: time the outer step alone
    t = time.perf_counter()
    return jax.block_until_ready(jax.device_put(params_R, self.host)), time.perf_counter() - t

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

  def receive(self, outer: Outer, pending: exchange_lib.Pending,
              diagnostics: bool = True) -> tuple[Outer, Params | None, skips.Synced]:
    """Waits for `pending`; returns the carry with its residual and skip counters moved
    on, the mean to apply (None: skipped) and what arrived."""
    arrived = self.exchange.wait(pending, diagnostics)
    counters, synced = skips.decide(
        outer.skips, arrived, replicas_per_host=self.replicas_per_host,
        tolerated=self.exchange.tolerated, max_skipped_rounds=self.max_skipped_rounds,
        aggregation=self.exchange.aggregation, host=self.exchange.collective.host_index)
    residuals = outer.residuals
    if arrived.residual is not None:
      residuals = {**residuals, arrived.key: arrived.residual}
    inflight = tuple(p for p in outer.inflight if p is not pending)
    return (outer._replace(skips=counters, residuals=residuals, inflight=inflight),
            arrived.mean if synced.applied else None, synced)

  # What a driver's `rule` says of its state (a diloco rule; streaming: its fragments).

  def final(self, outer: Outer, replicas) -> Params:
    """The trained params on the local devices (eager: the mean over all K replicas)."""
    params = self.rule.final(outer.state)
    if self.rule.per_replica:
      params = self.exchange.mean_over_replicas(params)
    return self.place(params)

  def model(self, outer: Outer, replicas) -> Params:
    """The params to evaluate during the run, on the local devices."""
    return self.place(self.rule.model(outer.state))

  def replicated(self, outer: Outer, replicas) -> Any:
    """What must be identical on every host after every outer step."""
    return self.rule.split(outer.state)[0]

  def split(self, outer: Outer) -> tuple[dict, dict]:
    """(shared, own) trees for a checkpoint: the state as the rule splits it, the skip
    counters, the residuals and the sum in flight (at most one at a round boundary)."""
    assert len(outer.inflight) <= 1, "more than one sum in flight at a round boundary"
    shared, own = self.rule.split(outer.state)
    own_tree = {} if own is None else {"outer": own}
    if outer.residuals:
      own_tree["wire"] = {str(key): r for key, r in outer.residuals.items()}
    if outer.inflight:
      own_tree["inflight"] = self.exchange.inflight(outer.inflight[0])
    return {"outer": shared, "skips": outer.skips}, own_tree

  def split_like(self, outer: Outer, replicas, inflight: bool) -> tuple[dict, dict]:
    """The structure of `split`, with a sum in flight if `inflight` (for restoring)."""
    shared, own = self.split(outer._replace(inflight=()))
    if inflight:
      own["inflight"] = self.exchange.inflight_like(self.sent_at_boundary(replicas.params))
    return shared, own

  def sent_at_boundary(self, params_R: Params) -> Params:
    """The part of the params whose Δ can be in flight at a round boundary."""
    return params_R

  def join(self, shared: dict, own: dict | None) -> Outer:
    """The carry of a checkpoint, its sum in flight issued again (own None: a host that
    was away in elastic mode starts from the shared state)."""
    own = own or {}
    state = jax.device_put(self.rule.join(shared["outer"], own.get("outer")), self.host)
    residuals = ({int(key): np.asarray(r) for key, r in own["wire"].items()} if "wire" in own
                 else self.init_residuals(state))
    inflight = ()
    if "inflight" in own:
      inflight = (self.exchange.resubmit(own["inflight"], residuals),)
    skips = state_lib.SkipCounters.of(int(shared["skips"].total),
                                      int(shared["skips"].in_a_row))
    return Outer(state, skips, residuals, inflight)

  def init_residuals(self, state) -> dict[int, np.ndarray]:
    return self.exchange.init_residuals({0: exchange_lib.entries(self.rule.model(state))})


class OuterStep(HostSide):
  """The outer step of sync, delayed and eager: one driver, the mode is its `rule`."""

  def __init__(self, rule, *, mesh: Mesh, exchange: exchange_lib.Exchange,
               max_skipped_rounds: int):
    super().__init__(mesh=mesh, exchange=exchange, max_skipped_rounds=max_skipped_rounds)
    self.rule = rule
    self._apply = jax.jit(rule.apply, donate_argnums=0)
    self._drain = jax.jit(rule.drain, donate_argnums=0)
    self._drop = jax.jit(diloco.drop_replicas)

  @classmethod
  def from_config(cls, config, *, mesh: Mesh, exchange: exchange_lib.Exchange) -> OuterStep:
    rule = diloco.make_rule(config.mode, optim.outer_optimizer(config.outer),
                            exchange.num_replicas)
    return cls(rule, mesh=mesh, exchange=exchange,
               max_skipped_rounds=config.outer.max_skipped_rounds)

  def init(self, anchor: Params) -> Outer:
    # Committed to the host CPU device, as every later outer state is, so the outer-step
    # programs compile once rather than again in round 2.
    state = jax.device_put(self.rule.init(anchor, self.replicas_per_host), self.host)
    return Outer(state, state_lib.SkipCounters.of(0, 0), self.init_residuals(state))

  def end_round(self, outer: Outer, replicas, loss_sum, round_: int) -> Update:
    """The round's outer step: Δ of every local replica, the exchange, the rule."""
    times: dict[str, float] = {}
    local_R, times["outer_d2h"] = self.to_host(replicas.params)
    t = time.perf_counter()
    deltas_R = self.pseudo_gradients(self.rule.start(outer.state), local_R)
    finite_R, replicas = self.check_finite(deltas_R, replicas)
    if self.rule.per_replica and not finite_R.all():  # applies its own Δ at once: a broken
      deltas_R = self._drop(deltas_R, finite_R)  # replica applies nothing of its own
    mean, synced = None, ()
    if self.rule.delay and outer.inflight:  # the previous round's mean; waited for first,
      outer, mean, arrived = self.receive(outer, outer.inflight[0])  # so its diagnostics
      synced = (arrived,)  # job runs before this round's sum
    outer = outer._replace(inflight=(*outer.inflight, self.exchange.submit(
        deltas_R, loss_sum, finite_R, round_=round_, residual=outer.residuals.get(0))))
    if not self.rule.delay:  # sync: this round's own mean
      outer, mean, arrived = self.receive(outer, outer.inflight[-1])
      synced = (arrived,)
      times["outer_mean"] = time.perf_counter() - t
      t = time.perf_counter()
    state = jax.block_until_ready(self._apply(outer.state, deltas_R, mean))
    times["outer_update"] = time.perf_counter() - t
    replicas, times["outer_h2d"] = self._to_replicas(replicas, state)
    return Update(outer._replace(state=state), replicas, times, synced)

  def _to_replicas(self, replicas, state) -> tuple[state_lib.ReplicaState, float]:
    t = time.perf_counter()
    start = self.place(self.rule.start(state), per_replica=self.rule.per_replica)
    params = start if self.rule.per_replica else self._broadcast(start)
    return replicas.replace(params=jax.block_until_ready(params)), time.perf_counter() - t

  def drain(self, outer: Outer, replicas) -> Update:
    """After the last round: the mean still in flight arrives and is applied."""
    synced, mean = (), None
    if outer.inflight:
      outer, mean, arrived = self.receive(outer, outer.inflight[0])
      synced = (arrived,)
      state = self._drain(outer.state, mean)
      replicas, _ = self._to_replicas(replicas, state)
      outer = outer._replace(state=state)
    return Update(outer, replicas, {}, synced)
