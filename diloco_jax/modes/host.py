"""The pieces the DiLoCo drivers share (`outer.OuterStep`, `streaming.StreamingOuterStep`):
placement between the local devices and the host, Δ and its hook, the NaN check, the
exchange, the skip policy, and the checkpoint layout of a rule's state.

`HostSide` is given the mode's rule when it is made: what it says of the outer state
(the model, the final params, what every host shares) is the rule's, declared by
`StateRule`.
"""

from __future__ import annotations

import time
from typing import Any
from typing import ClassVar
from typing import Protocol

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_jax.algo import diloco
from diloco_jax.algo import state as state_lib
from diloco_jax.algo import step as step_lib
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.modes import base
from diloco_jax.modes import skips
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib

Params = Any


class StateRule(Protocol):
  """What `HostSide` asks of a mode's rule about its outer state: a `diloco` rule, or
  streaming's `fragments.Fragments`."""
  per_replica: ClassVar[bool]  # the final model is the mean of per-replica params

  def model(self, state: Any) -> Params:
    """The params to evaluate during the run."""
    ...

  def final(self, state: Any) -> Params:
    """The trained params (per replica when `per_replica`)."""
    ...

  def split(self, state: Any) -> tuple[Any, Any]:
    """(what every host holds bit for bit, what is this host's own; None: nothing)."""
    ...

  def join(self, shared: Any, own: Any) -> Any:
    """The state from `split`'s two parts."""
    ...


class HostSide:
  """A DiLoCo driver's pieces over its `rule`; the modes' drivers add `init`,
  `end_round` and `drain` (`base.Driver` lists what the loop calls)."""

  def __init__(self, rule: StateRule, *, mesh: Mesh, exchange: exchange_lib.Exchange,
               max_skipped_rounds: int,
               pseudo_gradient_hook: base.PseudoGradientHook | None = None):
    self.rule, self.exchange, self.max_skipped_rounds = rule, exchange, max_skipped_rounds
    self.pseudo_gradient_hook = pseudo_gradient_hook
    self.replicas_per_host = exchange.replicas_per_host
    self.num_replicas = exchange.num_replicas
    self.host_sharding = jax.sharding.SingleDeviceSharding(exchange.host_device)
    self.layout = mesh_lib.Layout(mesh)  # how the inner step holds params on the devices
    self._deltas = jax.jit(diloco.pseudo_gradients)
    self._finite = jax.jit(diloco.finite_replicas)
    self._zero_nonfinite = jax.jit(diloco.zero_nonfinite)

  @property
  def param_sets(self) -> int:
    """Every local replica holds its own params on the devices."""
    return self.replicas_per_host

  @staticmethod
  def inner_step(loss_fn: step_lib.LossFn, optimizer: optax.GradientTransformation, *,
                 mesh: Mesh, grad_accum_steps: int, collective: Any,
                 dispatcher: dispatch.Dispatcher, num_replicas: int) -> inner.ReplicaStep:
    """Every replica's inner step, one after another; it never communicates."""
    del collective, dispatcher, num_replicas  # DiLoCo's replicas talk only in outer steps
    return inner.ReplicaStep(loss_fn, optimizer, mesh=mesh, grad_accum_steps=grad_accum_steps)

  @staticmethod
  def memory_profile(config: ml_collections.ConfigDict) -> mesh_lib.MemoryProfile:
    """Every replica of a device group holds its own params and moments; a step holds
    one replica's gradients (the replicas step one after another); the host holds the
    outer state, the mean, and per replica its params' host copy and its Δ."""
    r = config.replicas_per_host
    return mesh_lib.MemoryProfile(param_sets=r // config.mesh.replicas, grad_copies=1,
                                  host_copies=2 * r + 3)

  def after_step(self, outer: base.Outer, replicas, step: int, round_: int) -> base.Update:
    """After inner step `step` of round `round_`, before its end (streaming's syncs)."""
    return base.Update(outer, replicas, {})

  def place(self, tree: Params, per_replica: bool = False) -> Params:
    """A private copy on the local devices, sharded as the inner step holds params
    (`mesh.Layout.put`)."""
    return self.layout.put(tree, per_replica)

  def _broadcast(self, params: Params) -> Params:
    return self.layout.broadcast(params, self.replicas_per_host)

  def to_host(self, params_R: Params) -> tuple[Params, float]:
    jax.block_until_ready(params_R)  # the inner phase is done: time the outer step alone
    t = time.perf_counter()
    return jax.block_until_ready(jax.device_put(params_R, self.host_sharding)), time.perf_counter() - t

  def pseudo_gradients(self, start: Params, local_R: Params, *, round_: int,
                       fragment: int = 0) -> Params:
    """Δ_m = start − θ_m per replica (`start`: the anchor, or [R, ...] per replica), as
    the `pseudo_gradient_hook` leaves it."""
    deltas_R = self._deltas(start, local_R)
    if self.pseudo_gradient_hook is not None:
      deltas_R = self.pseudo_gradient_hook(deltas_R, round_=round_, fragment=fragment)
    return deltas_R

  def check_finite(self, deltas_R: Params, replicas: state_lib.ReplicaState):
    """[R] flags: which local Δ_m are finite. A replica whose Δ is not gets its inner
    optimizer state repaired (NaN/Inf moments set to 0): otherwise it would diverge again
    from the anchor in the next round."""
    finite_R = np.asarray(self._finite(deltas_R))
    if not finite_R.all():
      replicas = replicas.replace(opt_state=self._zero_nonfinite(replicas.opt_state))
    return finite_R, replicas

  def receive(self, outer: base.Outer, pending: exchange_lib.Pending,
              diagnostics: bool = True) -> tuple[base.Outer, Params | None, skips.Synced]:
    """Waits for `pending`; returns the carry with its residual and skip counters moved
    on, the mean to apply (None: skipped) and what arrived."""
    arrived = self.exchange.wait(pending, diagnostics)
    collective = self.exchange.collective
    counters, synced = skips.decide(
        outer.skips, arrived, replicas_per_host=self.replicas_per_host,
        max_skipped_rounds=self.max_skipped_rounds, aggregation=self.exchange.aggregation,
        prints=collective.host_index == min(collective.live))
    residuals = outer.residuals
    if arrived.residual is not None:
      residuals = {**residuals, arrived.key: arrived.residual}
    inflight = tuple(p for p in outer.inflight if p is not pending)
    return (outer._replace(skips=counters, residuals=residuals, inflight=inflight),
            arrived.mean if synced.applied else None, synced)

  # What the rule says of its state.

  def final(self, outer: base.Outer, replicas) -> Params:
    """The trained params on the local devices (eager: the mean over all K replicas)."""
    params = self.rule.final(outer.state)
    if self.rule.per_replica:
      params = self.exchange.mean_over_replicas(params)
    return self.place(params)

  def model(self, outer: base.Outer, replicas) -> Params:
    """The params to evaluate during the run, on the local devices."""
    return self.place(self.rule.model(outer.state))

  def replicated(self, outer: base.Outer, replicas) -> Any:
    """What must be identical on every host after every outer step."""
    return self.rule.split(outer.state)[0]

  def split(self, outer: base.Outer) -> tuple[dict, dict]:
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

  def split_like(self, outer: base.Outer, replicas, inflight: bool) -> tuple[dict, dict]:
    """The structure of `split`, with a sum in flight if `inflight` (for restoring)."""
    shared, own = self.split(outer._replace(inflight=()))
    if inflight:
      own["inflight"] = self.exchange.inflight_like(self.sent_at_boundary(replicas.params))
    return shared, own

  def sent_at_boundary(self, params_R: Params) -> Params:
    """The part of the params whose Δ can be in flight at a round boundary."""
    return params_R

  def join(self, shared: dict, own: dict | None) -> base.Outer:
    """The carry of a checkpoint, its sum in flight issued again (own None: a host that
    was away starts from the shared state)."""
    own = own or {}
    state = jax.device_put(self.rule.join(shared["outer"], own.get("outer")), self.host_sharding)
    residuals = ({int(key): np.asarray(r) for key, r in own["wire"].items()} if "wire" in own
                 else self.init_residuals(state))
    inflight = ()
    if "inflight" in own:
      inflight = (self.exchange.resubmit(own["inflight"], residuals),)
    skips = state_lib.SkipCounters.of(int(shared["skips"].total),
                                      int(shared["skips"].in_a_row))
    return base.Outer(state, skips, residuals, inflight)

  def init_residuals(self, state) -> dict[int, np.ndarray]:
    return self.exchange.init_residuals({0: exchange_lib.entries(self.rule.model(state))})

  @staticmethod
  def restored_state(rule: StateRule, like: Any, read: base.Read) -> Any:
    """The rule's state from a checkpoint read in one process (`trained_params`), in
    `split`'s layout: `like`, the state's shapes for all K replicas; its shared part
    from the "shared" item, its own part from every host's rows of "hosts", host-major."""
    shared_like, own_like = rule.split(like)
    items = read(("shared",) if own_like is None else ("shared", "hosts"))
    own = (None if own_like is None
           else base.fill(own_like, base.host_rows(items["hosts"]["outer"])))
    return rule.join(base.fill(shared_like, items["shared"]["outer"]), own)
