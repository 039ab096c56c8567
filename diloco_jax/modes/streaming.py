"""Streaming DiLoCo on a host (docs/algorithms.md §5): P fragments synced mid-round.

The schedule is `fragments.events`, the table `simulate` follows too: after inner step t,
fragment p's Δ against its own global copy θᵍ_p is sent (one job on the dispatch thread),
and τ steps later its mean moves θᵍ_p with the sync rule and every replica merges it in,
θ_m,p ← α·θ_m,p + (1 − α)·θᵍ_p. The pieces (placement, Δ, NaN check, exchange, skip
policy, checkpoint layout) are `host.HostSide`'s. The state is the list of the P
fragments' OuterStates; fragment 0's send, at the end of each round, carries the round's
loss. At a round boundary only fragment 0 can be in flight (τ < H/P), so it is checkpointed
and issued again on resume like a delayed round's sum.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from diloco_jax import errors
from diloco_jax.algo import diloco
from diloco_jax.algo import fragments
from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.modes import base
from diloco_jax.modes import host as host_lib
from diloco_jax.wire import exchange as exchange_lib

Params = Any


def fragments_of(params: Params, num_fragments: int,
                 layout: str) -> tuple[list[int], fragments.Fragments]:
  """(each leaf's fragment, the fragments seen as one rule) for params of these shapes."""
  try:
    ids = fragments.model_fragment_ids(params, num_fragments, layout)
  except ValueError as e:  # your own module, with fewer blocks than fragments
    raise errors.ConfigError(f"config.outer.fragments = {num_fragments}: {e}") from None
  ids = jax.tree.leaves(ids)
  return ids, fragments.Fragments(tuple(ids), jax.tree.structure(params))


class StreamingOuterStep(host_lib.HostSide):
  """The streaming driver: `base.Driver` with events instead of a rule's round.

  `params`: the model's param shapes, which fix the fragments."""
  asynchronous, per_step, fragments, departure = False, False, True, 0
  carries_pace = base.Trait(False, "streaming's fragments sync at the same step on every host")
  needs_own_rows = base.Trait(False)
  needs_mean = base.Trait(False)

  def __init__(self, optimizer, *, params: Params, num_fragments: int, layout: str,
               overlap_steps: int, merge_alpha: float, num_rounds: int, inner_steps: int,
               **kw):
    self.ids, self.fragments = fragments_of(params, num_fragments, layout)
    super().__init__(self.fragments, **kw)
    self.num_fragments = num_fragments
    self.alpha = merge_alpha
    self.optimizer, self.h = optimizer, inner_steps
    self.fragment_rule = diloco.Sync(optimizer, self.num_replicas)  # a fragment's outer step
    self.events = fragments.events(num_rounds, inner_steps, num_fragments, overlap_steps)
    self._apply = jax.jit(self.fragment_rule.apply, donate_argnums=0)
    self._merge = jax.jit(functools.partial(fragments.merge, alpha=merge_alpha,
                                            num_replicas=self.replicas_per_host))

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, *, mesh: Mesh,
                  exchange: exchange_lib.Exchange, params: Params,
                  pseudo_gradient_hook: base.PseudoGradientHook | None = None
                  ) -> StreamingOuterStep:
    o = config.outer
    return cls(optim.outer_optimizer(o), params=params, num_fragments=o.fragments,
               layout=o.fragment_layout, overlap_steps=o.overlap_steps,
               merge_alpha=o.merge_alpha, num_rounds=config.num_rounds,
               inner_steps=config.inner_steps, mesh=mesh, exchange=exchange,
               max_skipped_rounds=o.max_skipped_rounds,
               pseudo_gradient_hook=pseudo_gradient_hook)

  @classmethod
  def trained_params(cls, config: ml_collections.ConfigDict, meta: dict, template: Params,
                     read: base.Read) -> Params:
    """θᵍ: every fragment's global copy."""
    o = config.outer
    ids, rule = fragments_of(template, o.fragments, o.fragment_layout)
    like = jax.eval_shape(lambda anchor: fragments.outer_states(
        optim.outer_optimizer(o), anchor, ids, o.fragments), template)
    return rule.final(cls.restored_state(rule, like, read))

  def init(self, anchor: Params) -> base.Outer:
    states = jax.device_put(fragments.outer_states(self.optimizer, anchor, self.ids,
                                                   self.num_fragments), self.host_sharding)
    return base.Outer(states, state_lib.SkipCounters.of(0, 0), self.init_residuals(states))

  def init_residuals(self, states) -> dict[int, np.ndarray]:
    return self.exchange.init_residuals({p: exchange_lib.entries(s.anchor)
                                         for p, s in enumerate(states)})

  def after_step(self, outer, replicas, step: int, round_: int) -> base.Update:
    return self._handle(outer, replicas, step, round_, None)

  def end_round(self, outer, replicas, loss_sum, round_: int) -> base.Update:
    return self._handle(outer, replicas, round_ * self.h, round_, loss_sum)

  def _handle(self, outer, replicas, step: int, round_: int, loss_sum) -> base.Update:
    times = {"outer_d2h": 0.0, "outer_update": 0.0}
    synced = []
    for kind, p in self.events.get(step, ()):
      if kind == "send":
        local, seconds = self.to_host(self._fragment(replicas.params, p))
        times["outer_d2h"] += seconds
        deltas_R = self.pseudo_gradients(outer.state[p].anchor, local, round_=round_,
                                         fragment=p)
        finite_R, replicas = self.check_finite(deltas_R, replicas)
        loss = loss_sum if p == 0 else np.zeros((), np.float32)
        outer = outer._replace(inflight=(*outer.inflight, self.exchange.submit(
            deltas_R, loss, finite_R, round_=round_, key=p, residual=outer.residuals.get(p))))
        continue
      t = time.perf_counter()  # the wait for the mean, the update and the merge
      pending = next(x for x in outer.inflight if x.key == p)
      outer, mean, arrived = self.receive(outer, pending, diagnostics=p == 0)
      synced.append(arrived)
      states = list(outer.state)
      states[p] = jax.block_until_ready(self._apply(states[p], None, mean))
      replicas = self._merge_in(replicas, p, states[p].anchor)
      outer = outer._replace(state=states)
      times["outer_update"] += time.perf_counter() - t
    return base.Update(outer, replicas, times if self.events.get(step) else {},
                       tuple(synced))

  def _fragment(self, params: Params, p: int) -> list:
    return fragments.split(params, self.ids, self.num_fragments)[p]

  def _merge_in(self, replicas, p: int, anchor_p: list):
    """θ_m,p ← α·θ_m,p + (1 − α)·θᵍ_p on the local devices (α = 0: the sync broadcast)."""
    placed = self.place(anchor_p)
    if self.alpha == 0:
      new = self._broadcast(placed)
    else:
      new = self.layout.hold(self._merge(self._fragment(replicas.params, p), placed))
    parts = fragments.split(replicas.params, self.ids, self.num_fragments)
    parts[p] = jax.block_until_ready(new)
    return replicas.replace(params=fragments.join(parts, self.ids, self.fragments.treedef))

  def drain(self, outer, replicas) -> base.Update:
    """Nothing: the schedule receives every send by the last inner step."""
    return base.Update(outer, replicas, {})

  def sent_at_boundary(self, params_R: Params) -> Params:
    return self._fragment(params_R, 0)  # only fragment 0 crosses a round boundary
