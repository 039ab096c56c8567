"""The outer step on a host: one driver over a mode's `diloco` rule.

The accelerators hold only what plain training holds. The outer state and Δ live on this
host's CPU device, and the cross-host mean runs on the dispatch thread (`exchange.py`):

  replicas' params ──d2h──► Δ_m = start − θ_m ──exchange──► Δ̄ over all K replicas
      ──► rule.apply (the outer optimizer) ──► start points ──h2d──► every local replica

`sync` (delay 0) waits for this round's mean; `delayed` and `eager` (delay 1) send this
round's Δ and apply the previous round's mean, so the sum runs behind the next inner phase.
The pieces it shares with streaming's driver are `host.HostSide`'s; the interface every
mode's driver has is `base.Driver`. Every call returns an `Update`: new values, never a
mutation.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from diloco_jax.algo import diloco
from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.modes import base
from diloco_jax.modes import host as host_lib
from diloco_jax.wire import exchange as exchange_lib

Params = Any


class OuterStep(host_lib.HostSide):
  """The outer step of sync, delayed and eager: one driver, the mode is its `rule`
  (`rule_class`, with the mode's traits, on `SyncStep`, `DelayedStep` and `EagerStep`)."""
  rule_class: type[diloco.Sync | diloco.Delayed | diloco.Eager]

  def __init__(self, rule, *, mesh: Mesh, exchange: exchange_lib.Exchange,
               max_skipped_rounds: int,
               pseudo_gradient_hook: base.PseudoGradientHook | None = None):
    super().__init__(rule, mesh=mesh, exchange=exchange, max_skipped_rounds=max_skipped_rounds,
                     pseudo_gradient_hook=pseudo_gradient_hook)
    self._apply = jax.jit(rule.apply, donate_argnums=0)
    self._drain = jax.jit(rule.drain, donate_argnums=0)
    self._drop = jax.jit(diloco.drop_replicas)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, *, mesh: Mesh,
                  exchange: exchange_lib.Exchange, params: Params,
                  pseudo_gradient_hook: base.PseudoGradientHook | None = None) -> OuterStep:
    del params  # a rule's state takes its shapes from the anchor in `init`
    rule = cls.rule_class(optim.outer_optimizer(config.outer), exchange.num_replicas)
    return cls(rule, mesh=mesh, exchange=exchange,
               max_skipped_rounds=config.outer.max_skipped_rounds,
               pseudo_gradient_hook=pseudo_gradient_hook)

  @classmethod
  def trained_params(cls, config: ml_collections.ConfigDict, meta: dict, template: Params,
                     read: base.Read) -> Params:
    """The anchor; in eager mode host 0's first replica during the run, and once the run
    has finished the mean of all K replicas with the last mean applied."""
    num_replicas = meta["num_hosts"] * meta["replicas_per_host"]
    rule = cls.rule_class(optim.outer_optimizer(config.outer), num_replicas)
    like = jax.eval_shape(lambda anchor: rule.init(anchor, num_replicas), template)
    state = cls.restored_state(rule, like, read)
    if rule.per_replica and meta["finished"]:
      return jax.tree.map(lambda x: np.asarray(x).mean(axis=0), jax.jit(rule.final)(state))
    return rule.model(state)

  def init(self, anchor: Params) -> base.Outer:
    # Committed to the host CPU device, as every later outer state is, so the outer-step
    # programs compile once rather than again in round 2.
    state = jax.device_put(self.rule.init(anchor, self.replicas_per_host), self.host_sharding)
    return base.Outer(state, state_lib.SkipCounters.of(0, 0), self.init_residuals(state))

  def end_round(self, outer: base.Outer, replicas, loss_sum, round_: int) -> base.Update:
    """The round's outer step: Δ of every local replica, the exchange, the rule."""
    times: dict[str, float] = {}
    local_R, times["outer_d2h"] = self.to_host(replicas.params)
    t = time.perf_counter()
    deltas_R = self.pseudo_gradients(self.rule.start(outer.state), local_R, round_=round_)
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
    state = jax.block_until_ready(self._apply(outer.state, deltas_R, mean,
                                              self._replicas(synced)))
    times["outer_update"] = time.perf_counter() - t
    replicas, times["outer_h2d"] = self._to_replicas(replicas, state)
    return base.Update(outer._replace(state=state), replicas, times, synced)

  def _replicas(self, synced: tuple) -> np.ndarray | None:
    """The K of the mean that arrived, as `diloco.arrived_k` gives it to the rule (None:
    the static K, also where no mean arrived); eager divides by it, the others ignore it."""
    return diloco.arrived_k(synced[0].arrived.replicas if synced else 0, self.num_replicas)

  def _to_replicas(self, replicas, state) -> tuple[state_lib.ReplicaState, float]:
    t = time.perf_counter()
    start = self.place(self.rule.start(state), per_replica=self.rule.per_replica)
    params = start if self.rule.per_replica else self._broadcast(start)
    return replicas.replace(params=jax.block_until_ready(params)), time.perf_counter() - t

  def drain(self, outer: base.Outer, replicas) -> base.Update:
    """After the last round: the mean still in flight arrives and is applied."""
    synced, mean = (), None
    if outer.inflight:
      outer, mean, arrived = self.receive(outer, outer.inflight[0])
      synced = (arrived,)
      state = self._drain(outer.state, mean, self._replicas(synced))
      replicas, _ = self._to_replicas(replicas, state)
      outer = outer._replace(state=state)
    return base.Update(outer, replicas, {}, synced)



# The modes over a rule: the rule and the traits (`base.Driver`) are all that differ.

class SyncStep(OuterStep):
  """sync: this round's mean, waited for (docs/algorithms.md §2)."""
  rule_class = diloco.Sync
  asynchronous, per_step, fragments, departure = False, False, False, 0
  carries_pace = base.Trait(True)
  needs_own_rows = base.Trait(False)
  needs_mean = base.Trait(False)


class DelayedStep(OuterStep):
  """delayed: the previous round's mean, its sum behind this inner phase (§3)."""
  rule_class = diloco.Delayed
  asynchronous, per_step, fragments, departure = True, False, False, 2
  carries_pace = base.Trait(True)
  needs_own_rows = base.Trait(False)
  needs_mean = base.Trait(False)


class EagerStep(OuterStep):
  """eager: a replica's own Δ at once, the others' one round late (Kale et al., §4)."""
  rule_class = diloco.Eager
  asynchronous, per_step, fragments, departure = True, False, False, 1
  carries_pace = base.Trait(True)
  needs_own_rows = base.Trait(True, "keeps an outer state per replica")
  needs_mean = base.Trait(True, "each replica subtracts its own Δ/K from it")
