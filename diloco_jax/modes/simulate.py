"""`simulate`: K DiLoCo replicas of any loss function in one process, for research and tests.

It runs exactly the math of the trainer, under one `jax.jit` with the replicas vmapped:
`step.make_train_step` for the inner steps, a `diloco` rule for the outer step (the rule
the host driver calls too), and for streaming the schedule of `fragments.events` (the
table the host driver follows). Which of them a mode is, its driver says (`registry`):
every mode but ddp, whose per-step all-reduce is plain data parallelism.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.algo import diloco
from diloco_jax.algo import fragments
from diloco_jax.algo import state as state_lib
from diloco_jax.algo import step as step_lib
from diloco_jax.modes import names
from diloco_jax.modes import registry

Params = Any
MODES = registry.names(lambda d: not d.per_step)


class SimulateResult(NamedTuple):
  """Attributes: params, the trained params (the anchor after T outer steps; eager: the
  mean of the replicas' drained params); losses, [T, K, H] inner losses; outer_state, the
  rule's final state (OuterState; eager: EagerState, whose params are from before the
  drain; streaming: the list of the fragments' OuterStates); replicas, the final
  ReplicaState [K, ...]."""
  params: Params
  losses: jax.Array
  outer_state: Any
  replicas: state_lib.ReplicaState


def simulate(loss_fn: Callable[[Params, Any], jax.Array], init_params: Params, batches: Any,
             *, inner_optimizer: optax.GradientTransformation,
             outer_optimizer: optax.GradientTransformation,
             mode: str = names.PLAIN, fragment_ids: Params | None = None,
             overlap_steps: int = 0, merge_alpha: float = 0.0,
             steps: Any = None) -> SimulateResult:
  """Trains K replicas of `loss_fn` from `init_params` with DiLoCo for T rounds of H steps.

  Args:
    loss_fn: (params, batch) -> scalar loss, where batch is one leaf-slice of `batches`.
    init_params: the initial anchor (any pytree, any float dtype, e.g. float64 under
      `jax_enable_x64`).
    batches: a pytree whose leaves have leading dims [T, K, H, ...]: outer step, replica,
      inner step.
    inner_optimizer, outer_optimizer: any optax transformations.
    mode: 'sync', 'delayed' or 'eager' (docs/algorithms.md §2–§4). In the async modes the
      mean of the last round, still in flight when the rounds end, is applied at the end
      (drained), so `params` contains every round. 'streaming': docs/algorithms.md §5.
    fragment_ids, overlap_steps, merge_alpha: streaming only. A pytree like
      `init_params` giving each leaf's fragment in 0..P−1 (None: one fragment), τ, and α.
    steps: None (every replica trains all H steps of every round), or integers [T, K] in
      0..H: replica k trains the first steps[t, k] of its H batches in round t (unequal
      hosts), and the outer step weights each replica by its tokens, i.e. by its steps
      (docs/algorithms.md §9; sync, delayed, eager). A round's losses after a replica's
      last step are NaN. H everywhere runs the program of None: the same bits.
  """
  if mode not in MODES:
    raise ValueError(f"simulate: mode={mode!r} is not one of {MODES}")
  leaves = jax.tree.leaves(batches)
  if not leaves or any(x.ndim < 3 for x in leaves):
    raise ValueError("simulate: every leaf of `batches` needs leading dims [T, K, H, ...]")
  t, k, h = leaves[0].shape[:3]
  if any(x.shape[:3] != (t, k, h) for x in leaves):
    raise ValueError("simulate: the leaves of `batches` disagree on [T, K, H]: "
                     f"{[x.shape[:3] for x in leaves]}")

  driver = registry.driver(mode)
  weights = None if steps is None else _weights(steps, driver, t, k, h)
  train_step = jax.vmap(step_lib.make_train_step(loss_fn, inner_optimizer))

  def inner_steps(replicas, batches_KxH, start=0, stop=None, steps_K=None):
    """Inner steps start..stop−1 of a round on every replica; losses [K, steps]. With
    `steps_K`, replica k's steps from its steps_K[k]-th on leave it as it was."""
    batches_HxK = jax.tree.map(lambda x: x[:, start:stop].swapaxes(0, 1), batches_KxH)

    def one_step(replicas, batch_K):
      params, opt_state, loss_K = train_step(replicas.params, replicas.opt_state, batch_K)
      return state_lib.ReplicaState(params=params, opt_state=opt_state), loss_K

    def some_step(replicas, i_and_batch_K):  # replicas past their steps_K stay as they are
      i, batch_K = i_and_batch_K
      new, loss_K = one_step(replicas, batch_K)
      active = i < steps_K  # [K]
      keep = lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
      return jax.tree.map(keep, new, replicas), jnp.where(active, loss_K, jnp.nan)

    if steps_K is None:
      replicas, losses_HxK = jax.lax.scan(one_step, replicas, batches_HxK)
    else:
      count = jax.tree.leaves(batches_HxK)[0].shape[0]
      replicas, losses_HxK = jax.lax.scan(some_step, replicas,
                                          (start + jnp.arange(count), batches_HxK))
    return replicas, losses_HxK.T

  @jax.jit
  def run(init_params, batches):
    replicas = state_lib.init_replica_state(inner_optimizer, init_params, k)
    if driver.fragments:
      return _streaming(inner_steps, outer_optimizer, init_params, replicas, batches,
                        fragment_ids, overlap_steps, merge_alpha, t, k, h)
    return _rounds(registry.rule(mode)(outer_optimizer, k), inner_steps, init_params,
                   replicas, batches, k, weights)

  return run(init_params, batches)


def _weights(steps: Any, driver, t: int, k: int, h: int) -> jax.Array | None:
  """`steps` checked: int32 [T, K] in 0..H, every round with some step; None when every
  replica trains all H steps of every round: the unweighted program, bit for bit."""
  if not driver.carries_pace:
    modes = registry.listed(registry.names(lambda d: d.carries_pace), "and", quoted=False)
    raise ValueError(f"simulate: steps= is for {modes}; {driver.carries_pace.why}")
  steps = np.asarray(steps)
  if steps.shape != (t, k) or not np.issubdtype(steps.dtype, np.integer):
    raise ValueError(f"simulate: steps must be integers of shape [T, K] = {(t, k)}, got "
                     f"{steps.dtype} {steps.shape}")
  if steps.min() < 0 or steps.max() > h:
    raise ValueError(f"simulate: steps must be in 0..H = {h}, got {steps.min()}..{steps.max()}")
  idle = np.flatnonzero(steps.sum(axis=1) == 0)
  if idle.size:
    raise ValueError(f"simulate: no replica trains in round(s) {(idle + 1).tolist()}: the "
                     f"weights of that round's mean are all zero")
  if (steps == h).all():  # the weighted program is another XLA program, which may fuse
    return None  # and round differently (an ulp apart was seen): the plain one keeps the bits
  return jnp.asarray(steps, jnp.int32)


def _scan_rounds(round_fn, carry, batches):
  """Round 1 on its own (nothing is in flight before it), then `lax.scan` over the rest;
  losses [T, K, H]."""
  carry, first = round_fn(carry, jax.tree.map(lambda x: x[0], batches))
  carry, rest = jax.lax.scan(round_fn, carry, jax.tree.map(lambda x: x[1:], batches))
  return carry, jnp.concatenate([first[None], rest])


def _rounds(rule, inner_steps, init_params, replicas, batches, k, weights) -> SimulateResult:
  """sync, delayed, eager: the rule's round, as the host driver runs it; with `weights`
  [T, K], each replica's Δ scaled to its token share first (diloco.token_weighted)."""

  def round_fn(carry, batches_and_steps):
    state, replicas, in_flight = carry
    batches_KxH, steps_K = batches_and_steps
    replicas, losses = inner_steps(replicas, batches_KxH, steps_K=steps_K)
    deltas_K = diloco.pseudo_gradients(rule.start(state), replicas.params)
    if steps_K is not None:
      deltas_K = diloco.token_weighted(deltas_K, steps_K)
    mean = diloco.replica_mean(deltas_K)  # what the all-reduce of this round brings
    state = rule.apply(state, deltas_K, in_flight if rule.delay else mean)
    start = rule.start(state)
    if not rule.per_replica:
      start = state_lib.broadcast_to_replicas(start, k)
    return (state, replicas.replace(params=start), mean), losses

  (state, replicas, in_flight), losses = _scan_rounds(
      round_fn, (rule.init(init_params, k), replicas, None), (batches, weights))
  if rule.delay:
    state = rule.drain(state, in_flight)
  params = rule.final(state)
  if rule.per_replica:
    params = diloco.replica_mean(params)
  return SimulateResult(params, losses, state, replicas)


def _streaming(inner_steps, outer_optimizer, init_params, replicas, batches, fragment_ids,
               tau, alpha, t, k, h) -> SimulateResult:
  """Streaming DiLoCo, following `fragments.events` step by step within each round."""
  leaves, treedef = jax.tree.flatten(init_params)
  ids = jax.tree.leaves(fragment_ids) if fragment_ids is not None else [0] * len(leaves)
  num_p = max(ids) + 1
  events = fragments.events(t, h, num_p, tau)
  fragment_rule = diloco.Sync(outer_optimizer, k)  # each fragment's outer step

  def round_fn(round_events):
    """One round's body for the given [(step within the round, kind, fragment), ...]."""

    def body(carry, batches_KxH):
      outer, replicas, in_flight = list(carry[0]), carry[1], dict(carry[2])
      losses, done = [], 0
      for step, kind, p in round_events:
        if step > done:
          replicas, l = inner_steps(replicas, batches_KxH, done, step)
          losses.append(l)
          done = step
        parts = fragments.split(replicas.params, ids, num_p)
        if kind == "send":  # Δ̄_p against the fragment's global copy θᵍ_p
          in_flight[p] = diloco.replica_mean(
              diloco.pseudo_gradients(fragment_rule.start(outer[p]), parts[p]))
        else:
          outer[p] = fragment_rule.apply(outer[p], None, in_flight.pop(p))
          parts[p] = fragments.merge(parts[p], outer[p].anchor, alpha, k)
          replicas = replicas.replace(params=fragments.join(parts, ids, treedef))
      if done < h:
        replicas, l = inner_steps(replicas, batches_KxH, done, h)
        losses.append(l)
      return (outer, replicas, in_flight), jnp.concatenate(losses, axis=1)

    return body

  def events_of(r, schedule=events):  # round r is global steps (r−1)H+1 .. rH
    return [(s - (r - 1) * h, kind, p) for s in range((r - 1) * h + 1, r * h + 1)
            for kind, p in schedule.get(s, ())]

  carry = (fragments.outer_states(outer_optimizer, init_params, ids, num_p), replicas, {})
  at = lambda r: jax.tree.map(lambda x: x[r - 1], batches)
  carry, first = round_fn(events_of(1))(carry, at(1))
  losses = [first[None]]
  steady = events_of(2, fragments.events(3, h, num_p, tau))  # a round between two others
  assert all(events_of(r) == steady for r in range(2, t)), "streaming schedule not periodic"
  # The last round runs on its own only when its events differ from the steady ones
  # (τ > 0: it also receives what its last send started); otherwise it joins the scan.
  # With P = 1, τ = 0, α = 0 the program then has `_rounds`' shape (round 1, one scan over
  # rounds 2..T), which sync's bits need: XLA contracts a·b + c into FMAs inside a fusion
  # and fuses differently across rounds that no loop separates (a one-trip scan is
  # inlined), so 1 | scan(2) | 3 came out an ulp away from sync's 1 | scan(2..3).
  scanned = t if t == 1 or events_of(t) == steady else t - 1  # rounds 1..scanned
  if scanned > 1:  # rounds 2..scanned follow one pattern
    carry, middle = jax.lax.scan(round_fn(steady), carry,
                                 jax.tree.map(lambda x: x[1:scanned], batches))
    losses.append(middle)
  if scanned < t:
    carry, last = round_fn(events_of(t))(carry, at(t))
    losses.append(last[None])
  outer, replicas, in_flight = carry
  assert not in_flight, "fragments.events receives every send by the last step"
  anchor = fragments.join([o.anchor for o in outer], ids, treedef)
  return SimulateResult(anchor, jnp.concatenate(losses), outer, replicas)
