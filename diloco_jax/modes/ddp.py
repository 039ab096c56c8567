"""The data-parallel baseline (mode 'ddp'): one set of params, gradients all-reduced every step.

`DDPStep` is its inner step; `DDPRound` is its driver (`base.Driver`), so the trainer
runs every mode through the same loop: a ddp "round" is H steps between log lines, its end
only sums the round's loss over hosts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_jax.algo import state as state_lib
from diloco_jax.algo import step as step_lib
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.modes import base
from diloco_jax.modes import skips
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib

Params = Any


class DDPStep(inner.Step):
  """One set of params (a replica axis of size 1), updated every step with the mean
  gradient of all K replicas' batches, across hosts.

  Two programs per step: this host's gradient sum over its replicas, then, after the
  cross-host sum (`reduce`, None on one host), the optimizer update with sum / K. Both
  layouts of the same K replicas (one host or many) run these same two programs.
  """

  def __init__(self, loss_fn: step_lib.LossFn, optimizer: optax.GradientTransformation, *,
               mesh: Mesh, num_replicas: int, grad_accum_steps: int = 1,
               reduce: Callable[[Params], Params] | None = None):
    super().__init__(mesh)
    self._reduce = reduce
    grad_fn = step_lib.make_grad_fn(loss_fn, grad_accum_steps)

    def grad_sum(params_1, batch_RxBxL1):
      self.traces += 1
      params = jax.tree.map(lambda x: x[0], params_1)
      loss_R, grads_R = jax.lax.map(lambda b: grad_fn(params, b), batch_RxBxL1)
      # Σ_r g_r left to right, as the cross-host sum adds hosts' sums.
      total = jax.tree.map(lambda g: functools.reduce(jnp.add, list(g)), grads_R)
      return total, loss_R

    def apply(state: state_lib.ReplicaState, grad_total):
      self.traces += 1
      one = lambda t: jax.tree.map(lambda x: x[0], t)
      grads = jax.tree.map(lambda g: g / jnp.asarray(num_replicas, g.dtype), grad_total)
      params, opt_state = one(state.params), one(state.opt_state)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return jax.tree.map(lambda x: x[None], state_lib.ReplicaState(params, opt_state))

    self._traced = grad_sum, apply

  def _jit(self, state: state_lib.ReplicaState):
    """(the gradient program, the update program) for a state of these shapes; the
    gradient sum comes out sharded as one replica's params."""
    grad_sum, apply = self._traced
    shardings = self.state_shardings(state)
    self._grad_sharding = self.layout.params(  # `state` may be arrays or their shapes
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params))
    grads = jax.jit(grad_sum, in_shardings=(shardings.params, self.batch_sharding),
                    out_shardings=(self._grad_sharding, self.layout.per_replica),
                    compiler_options=inner.compiler_options(self.layout.mesh))
    self._apply = jax.jit(apply, in_shardings=(shardings, self._grad_sharding),
                          out_shardings=shardings, donate_argnums=0)
    return grads

  def compile(self, state, batch_shape, spec=None) -> dict[str, int] | None:
    # The gradient program is the larger: the update's memory is the state's, in place.
    # Never kept whole (`spec` unused): its steps sum gradients across the hosts, in a
    # program of the whole job's devices.
    del spec
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding)
    self._compiled = self._jit(state).lower(state.params, batch).compile()
    return inner.memory_per_device(self._compiled)

  def _run(self, state: state_lib.ReplicaState, batch):
    if self._compiled is None:
      self._compiled = self._jit(state)
    grad_sum, loss_R = self._compiled(state.params, batch)
    if self._reduce is not None:
      grad_sum = jax.device_put(self._reduce(grad_sum), self._grad_sharding)
    return self._apply(state, grad_sum), loss_R


class DDPRound:
  """ddp's driver (`base.Driver`): no outer state, nothing in flight."""
  asynchronous, per_step, fragments, departure = False, True, False, 0
  carries_pace = base.Trait(False, "ddp's hosts all-reduce every step, so every host trains "
                            "every step")
  needs_own_rows = base.Trait(True, "keeps its model only in the replicas")
  needs_mean = base.Trait(False)

  param_sets = 1  # one set of params stands for all K replicas

  def __init__(self, *, mesh: Mesh, exchange: exchange_lib.Exchange):
    self.exchange = exchange
    self._sent = 0  # the collective's count at the end of the previous round

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, *, mesh: Mesh,
                  exchange: exchange_lib.Exchange, params: Params,
                  pseudo_gradient_hook: base.PseudoGradientHook | None = None) -> DDPRound:
    del config, params
    if pseudo_gradient_hook is not None:  # ignored, a tool would measure nothing
      raise ValueError("mode 'ddp' has no pseudo-gradients for a pseudo_gradient_hook: "
                       "it sums gradients every step")
    return cls(mesh=mesh, exchange=exchange)

  @staticmethod
  def inner_step(loss_fn: step_lib.LossFn, optimizer: optax.GradientTransformation, *,
                 mesh: Mesh, grad_accum_steps: int, collective: Any,
                 dispatcher: dispatch.Dispatcher, num_replicas: int) -> DDPStep:
    """Every step: this host's gradient sum, summed across hosts on the dispatch thread."""
    reduce = None
    if collective.num_hosts > 1:
      reduce = lambda g: dispatcher.run(collective.sum, jax.device_get(g),
                                        what="cross-host sum of gradients")
    return DDPStep(loss_fn, optimizer, mesh=mesh, num_replicas=num_replicas, reduce=reduce,
                   grad_accum_steps=grad_accum_steps)

  @staticmethod
  def memory_profile(config: ml_collections.ConfigDict) -> mesh_lib.MemoryProfile:
    """One set of params; a step keeps all R replicas' gradients before summing them, and
    the sum; nothing on the host."""
    return mesh_lib.MemoryProfile(param_sets=1, grad_copies=config.replicas_per_host + 1,
                                  host_copies=0)

  @classmethod
  def trained_params(cls, config: ml_collections.ConfigDict, meta: dict, template: Params,
                     read: base.Read) -> Params:
    """The one set of params, host 0's (every host holds the same)."""
    del config, meta
    params = read(("hosts",))["hosts"]["replicas"]["params"]
    return jax.tree.map(lambda x: x[0][0], base.fill(template, params))

  def init(self, anchor: Params) -> base.Outer:
    self._sent = self.exchange.collective.bytes_sent
    return base.Outer(None, state_lib.SkipCounters.of(0, 0), {})

  def after_step(self, outer, replicas, step: int, round_: int) -> base.Update:
    return base.Update(outer, replicas, {})

  def end_round(self, outer, replicas, loss_sum, round_: int) -> base.Update:
    """The round's loss summed over hosts, and the bytes its gradient and loss sums sent
    (round 1's also count the start-up's agreements: a few bytes per host)."""
    collective = self.exchange.collective
    if collective.num_hosts > 1:
      loss_sum = float(self.exchange.dispatcher.run(
          collective.sum, np.asarray(loss_sum), round_=round_, what="cross-host sum of losses"))
    sent, self._sent = collective.bytes_sent - self._sent, collective.bytes_sent
    arrived = exchange_lib.Arrived(round_, 0, None, np.zeros(0, bool), loss_sum, None,
                                   None, sent, 0)
    return base.Update(outer, replicas, {}, (skips.Synced(arrived, True, 0, ""),))

  def drain(self, outer, replicas) -> base.Update:
    return base.Update(outer, replicas, {})

  def final(self, outer, replicas) -> Params:
    return jax.tree.map(lambda x: x[0], replicas.params)

  model = final

  def replicated(self, outer, replicas) -> Any:
    """The params, identical on every host (each applies the same summed gradient)."""
    return replicas.params

  def split(self, outer) -> tuple[dict, dict]:
    return {"skips": outer.skips}, {}

  def split_like(self, outer, replicas, inflight: bool) -> tuple[dict, dict]:
    return self.split(outer)

  def join(self, shared: dict, own: dict | None) -> base.Outer:
    return base.Outer(None, state_lib.SkipCounters.of(0, 0), {})
