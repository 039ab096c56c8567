"""The DiLoCo math as pure functions, and one `Rule` per mode (docs/algorithms.md §2–§4).

No I/O, no threads. A rule is one mode's outer step over its state (a flax.struct pytree);
`simulate` drives it with `lax.scan` over rounds, and the host driver (`modes/outer.py`) drives
the same rule with the mean coming from the other hosts. So each mode's schedule is
written once, here, and gives the same numbers wherever it runs.

The interface every rule has (optimizer and static K fixed when the rule is made):
  delay        rounds between sending a round's Δ and applying its mean: 0 waits for it
               (sync), 1 applies it one round late (delayed, eager).
  per_replica  whether the state holds one set of outer params per replica ([R, ...]: eager)
               rather than one anchor; the final model is then the mean over all K.
  init         (anchor, R) -> state, for the R replicas held here.
  start        state -> where the replicas start their next inner phase, which is also
               what Δ is measured against: the anchor, or [R, ...] per replica.
  apply        (state, Δ_R, mean, replicas=None) -> state: one outer step, given this
               host's Δ_m and the mean that arrived (this round's when delay = 0, the
               previous round's when delay = 1; None when nothing arrived or it was
               skipped), and the K that mean was divided by (`arrived_k`; None: the
               static K). Only eager uses K: the others apply the mean alone.
  drain        (state, mean, replicas=None) -> state: the end of the run, when the mean
               still in flight after the last inner phase arrives (None: there is none, or
               it was skipped).
  final        state -> the trained params (per replica when per_replica).
  model        state -> the params to evaluate during the run.
  split, join  state <-> (what every host holds bit for bit, what is this host's own).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.algo import state as state_lib

Params = Any


def pseudo_gradients(start: Params, local_params_R: Params) -> Params:
  """Δ_m = start − θ_m for every replica m (leading replica axis), in `start`'s dtype.

  `start` is the anchor (one set, broadcast over the replicas) or one start point per
  replica ([R, ...], eager mode).
  """
  return jax.tree.map(lambda s, l: (s if s.ndim == l.ndim else s[None]) - l.astype(s.dtype),
                      start, local_params_R)


def replica_sum(deltas_R: Params) -> Params:
  """Σ_m Δ_m over the leading replica axis.

  Means are taken as a sum followed by one division by the total replica count, so that a
  mean over hosts of per-host sums rounds exactly like a mean over one host's replicas.
  """
  return jax.tree.map(lambda d: jnp.sum(d, axis=0), deltas_R)


def token_weighted(deltas_K: Params, tokens_K: jax.Array) -> Params:
  """Each replica's Δ_k scaled by s_k = K·w_k / Σ_j w_j, w_k its tokens this round, in
  Δ's dtype (docs/algorithms.md §9): Σ_k s_k Δ_k / K is the token-weighted mean, and
  every rule applied to the scaled Δ_k is its token-weighted form. Equal weights give
  s_k = 1.0 exactly (K·w and Σw are the same integer), so the unweighted rule's bits are
  kept."""
  def scaled(d):
    w = tokens_K.astype(d.dtype)
    s = w * w.shape[0] / jnp.sum(w)
    return d * s.reshape((-1,) + (1,) * (d.ndim - 1))
  return jax.tree.map(scaled, deltas_K)


def divide(tree: Params, count: int | jax.Array) -> Params:
  return jax.tree.map(lambda x: x / jnp.asarray(count, x.dtype), tree)


def replica_mean(tree_R: Params) -> Params:
  """(1/R) Σ_m over the leading replica axis of every leaf."""
  return divide(replica_sum(tree_R), jax.tree.leaves(tree_R)[0].shape[0])


def outer_update(outer_optimizer: optax.GradientTransformation,
                 outer_state: state_lib.OuterState,
                 mean_delta: Params) -> state_lib.OuterState:
  """One outer step: the mean pseudo-gradient is the outer optimizer's gradient."""
  updates, opt_state = outer_optimizer.update(mean_delta, outer_state.opt_state,
                                              outer_state.anchor)
  return state_lib.OuterState(anchor=optax.apply_updates(outer_state.anchor, updates),
                              opt_state=opt_state, step=outer_state.step + 1)


def eager_gradients(deltas_R: Params, prev_mean: Params, prev_deltas_R: Params,
                    num_replicas: int | jax.Array) -> Params:
  """docs/algorithms.md §4, per replica m: Δ̃_m = Δ_m/K + (Δ̄_prev − Δ_m,prev/K).

  The replica's fresh Δ stands in (weight 1/K) for its own stale contribution to the
  delayed mean of round r−1. In this form K = 1 is sync DiLoCo bit for bit: Δ̄_prev and
  Δ_m,prev are then the same number, so the bracket is exactly 0.

  K is the K that Δ̄_prev was divided by: a Python int (the static K, a constant of the
  program), or a traced int32 scalar where a host left (§4, "K per round"), cast to Δ's
  dtype like the constant.
  """
  def one(d_R, mean, prev_R):
    k = jnp.asarray(num_replicas, d_R.dtype)
    return d_R / k + (mean[None] - prev_R / k)

  return jax.tree.map(one, deltas_R, prev_mean, prev_deltas_R)


def eager_update(outer_optimizer: optax.GradientTransformation,
                 eager: state_lib.EagerState, deltas_R: Params, prev_mean: Params,
                 num_replicas: int | jax.Array) -> state_lib.EagerState:
  """One eager outer step of every replica held here (leading axis R): each applies its
  own Δ̃_m with its own outer optimizer state, from its own start point θ_m."""
  grads_R = eager_gradients(deltas_R, prev_mean, eager.prev_deltas, num_replicas)

  def one(params, opt_state, grads):
    updates, opt_state = outer_optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # lax.map, not vmap: each replica runs the unbatched update program, so one replica
  # rounds exactly like sync DiLoCo's update of the anchor.
  params_R, opt_state_R = jax.lax.map(lambda a: one(*a),
                                      (eager.params, eager.opt_state, grads_R))
  return state_lib.EagerState(params=params_R, opt_state=opt_state_R, prev_deltas=deltas_R,
                              prev_mean=prev_mean, step=eager.step + 1)


def eager_drain(outer_optimizer: optax.GradientTransformation, eager: state_lib.EagerState,
                last_mean: Params, num_replicas: int) -> Params:
  """The end of an eager run: the mean of the last round arrives after the last inner phase.

  Each replica replaces its fresh proxy Δ_m/K by the true mean, g_m = Δ̄ − Δ_m/K, applying
  only g's immediate effect: the outer optimizer's update of g from a fresh state (for
  Nesterov −η(1+μ)g), since no new round happened to advance the momentum. With K = 1,
  g = 0 exactly and the params stay those of sync DiLoCo, bit for bit. Returns θ_m [R, ...].
  """
  zeros_R = jax.tree.map(jnp.zeros_like, eager.prev_deltas)
  grads_R = eager_gradients(zeros_R, last_mean, eager.prev_deltas, num_replicas)

  def one(params, grads):
    updates, _ = outer_optimizer.update(grads, outer_optimizer.init(params), params)
    return optax.apply_updates(params, updates)

  return jax.lax.map(lambda a: one(*a), (eager.params, grads_R))


def arrived_k(counted: int, num_replicas: int) -> np.ndarray | None:
  """The K a driver gives a rule for a mean divided by `counted` replicas
  (`Arrived.replicas`; 0: not counted): None where it is the static K, else an int32
  array, one compiled program for every other K.

  None keeps the static K a constant of the program, as it always was: XLA turns x / 3
  into x · (1/3), whose bits a division by a traced 3 does not give. So with K unchanged
  a run keeps its bits, and only a change of K compiles a second program.
  """
  return None if counted in (0, num_replicas) else np.int32(counted)


def restate_share(prev_deltas_R: Params, replicas: jax.Array, num_replicas: int) -> Params:
  """Δ_m,prev · K/K_r: a replica's share Δ_m,prev/K_r of a mean divided by K_r, written
  so that `eager_drain`, which divides by the static K, takes exactly that share.

  Keeps K_r out of the saved state (docs/algorithms.md §4, "K per round"). With K_r = K
  the factor is exactly 1.0, so the bits are those of the undivided Δ_m,prev. The factor
  is formed in at least float32: a bfloat16 4/3 would be off by 0.2%.
  """
  def one(d):
    dtype = jnp.promote_types(d.dtype, jnp.float32)
    factor = jnp.asarray(num_replicas, dtype) / jnp.asarray(replicas, dtype)
    return (d.astype(dtype) * factor).astype(d.dtype)

  return jax.tree.map(one, prev_deltas_R)


def finite_replicas(deltas_R: Params) -> jax.Array:
  """[R] bool: whether every entry of replica m's Δ_m is finite (no NaN or Inf)."""
  per_leaf = [jnp.all(jnp.isfinite(d), axis=tuple(range(1, d.ndim)))
              for d in jax.tree.leaves(deltas_R)]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def drop_replicas(deltas_R: Params, keep_R: jax.Array) -> Params:
  """Δ_m where keep_R[m], else zeros: a dropped replica contributes nothing."""
  return jax.tree.map(
      lambda d: jnp.where(keep_R.reshape((-1,) + (1,) * (d.ndim - 1)), d, jnp.zeros_like(d)),
      deltas_R)


def zero_nonfinite(tree: Any) -> Any:
  """Every NaN or Inf entry replaced by 0 (an inner optimizer state after a replica
  diverged: its moments restart from zero where they broke)."""
  return jax.tree.map(
      lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))
      if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)


# The rules. Each is a frozen value holding the outer optimizer and K, with pure methods
# that `jax.jit` and `lax.scan` accept; a `None` mean is static (a separate trace).


@dataclasses.dataclass(frozen=True)
class Sync:
  """docs/algorithms.md §2: wait for the mean of this round's Δ, then apply it."""
  optimizer: optax.GradientTransformation
  num_replicas: int  # K, over all hosts
  delay: ClassVar[int] = 0
  per_replica: ClassVar[bool] = False

  def init(self, anchor: Params, replicas_here: int) -> state_lib.OuterState:
    del replicas_here  # every replica starts from the one anchor
    return state_lib.init_outer_state(self.optimizer, anchor)

  def start(self, state: state_lib.OuterState) -> Params:
    return state.anchor

  def apply(self, state: state_lib.OuterState, deltas_R: Params | None,
            mean: Params | None, replicas: jax.Array | None = None) -> state_lib.OuterState:
    del deltas_R, replicas  # only the mean moves the anchor, whatever K it is over
    return state if mean is None else outer_update(self.optimizer, state, mean)

  def drain(self, state: state_lib.OuterState, mean: Params | None,
            replicas: jax.Array | None = None) -> state_lib.OuterState:
    return self.apply(state, None, mean, replicas)

  def final(self, state: state_lib.OuterState) -> Params:
    return state.anchor

  def model(self, state: state_lib.OuterState) -> Params:
    return state.anchor

  def split(self, state: state_lib.OuterState) -> tuple[Any, Any]:
    return state, None

  def join(self, shared: Any, own: Any) -> state_lib.OuterState:
    del own
    return shared


@dataclasses.dataclass(frozen=True)
class Delayed(Sync):
  """docs/algorithms.md §3: Δ is measured against this round's start s_r and sent; the
  previous round's mean moves the anchor, s_{r+1} = OuterOpt(s_r, Δ̄^(r−1)); the last
  mean is applied by `drain`."""
  delay: ClassVar[int] = 1


@dataclasses.dataclass(frozen=True)
class Eager:
  """docs/algorithms.md §4: each replica applies its fresh Δ_m/K plus the delayed mean of
  the others, Δ̄^(r−1) − Δ_m^(r−1)/K, from its own θ_m with its own momentum.

  A mean of None (round 1, or a round skipped for NaN) makes the delayed term exactly 0:
  Δ̄ = 0 and Δ_m,prev = 0, so the replica applies Δ_m/K alone.

  K is per round (§4, "K per round"): the K the arrived mean was divided by divides both
  the stale share and the fresh term; the static `num_replicas` where no K is given or
  no mean arrived.
  """
  optimizer: optax.GradientTransformation
  num_replicas: int
  delay: ClassVar[int] = 1
  per_replica: ClassVar[bool] = True

  def init(self, anchor: Params, replicas_here: int) -> state_lib.EagerState:
    return state_lib.init_eager_state(self.optimizer, anchor, replicas_here)

  def start(self, state: state_lib.EagerState) -> Params:
    return state.params

  def _arrived(self, state: state_lib.EagerState, mean: Params | None,
               replicas: jax.Array | None):
    """(state, the mean, its K): zeros and the static K where no mean arrived."""
    if mean is not None:
      return state, mean, self.num_replicas if replicas is None else replicas
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return (state.replace(prev_deltas=zeros(state.prev_deltas)), zeros(state.prev_mean),
            self.num_replicas)

  def apply(self, state: state_lib.EagerState, deltas_R: Params, mean: Params | None,
            replicas: jax.Array | None = None) -> state_lib.EagerState:
    state, mean, k = self._arrived(state, mean, replicas)
    return eager_update(self.optimizer, state, deltas_R, mean, k)

  def drain(self, state: state_lib.EagerState, mean: Params | None,
            replicas: jax.Array | None = None) -> state_lib.EagerState:
    """Records the last mean; `final` then swaps each replica's proxy for it. A K other
    than the static one is folded into Δ_m,prev (`restate_share`), where `final`, and a
    read of the finished checkpoint, find it without a field of its own."""
    if mean is not None and replicas is not None:
      state = state.replace(prev_deltas=restate_share(state.prev_deltas, replicas,
                                                      self.num_replicas))
    state, mean, _ = self._arrived(state, mean, replicas)
    return state.replace(prev_mean=mean)

  def final(self, state: state_lib.EagerState) -> Params:
    return eager_drain(self.optimizer, state, state.prev_mean, self.num_replicas)

  def model(self, state: state_lib.EagerState) -> Params:
    # The replicas differ by their fresh terms: this host's first one is evaluated.
    return jax.tree.map(lambda x: x[0], state.params)

  def split(self, state: state_lib.EagerState) -> tuple[Any, Any]:
    return ({"prev_mean": state.prev_mean, "step": state.step},
            {"params": state.params, "opt_state": state.opt_state,
             "prev_deltas": state.prev_deltas})

  def join(self, shared: Any, own: Any) -> state_lib.EagerState:
    return state_lib.EagerState(params=own["params"], opt_state=own["opt_state"],
                                prev_deltas=own["prev_deltas"], prev_mean=shared["prev_mean"],
                                step=shared["step"])

