"""Train state: the outer state shared by all replicas and the replicas' own inner state.

Both are flax.struct dataclasses, i.e. pytrees of arrays: they pass through `jax.jit`,
orbax and the cross-host collective unchanged.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any


@flax.struct.dataclass
class OuterState:
  """What every replica agrees on, bit for bit, after every outer step.

  Attributes:
    anchor: θ, the params every replica starts an inner phase from.
    opt_state: the outer optimizer's state (the Nesterov momentum buffer).
    step: number of outer steps applied so far (int32 scalar).
  """
  anchor: Params
  opt_state: optax.OptState
  step: jax.Array


@flax.struct.dataclass
class ReplicaState:
  """The state of this host's replicas, each leaf with a leading replica axis [R, ...].

  Attributes:
    params: every replica's local params θ_m.
    opt_state: every replica's inner optimizer state (AdamW moments and step count); kept
      across rounds, never reset.
  """
  params: Params
  opt_state: optax.OptState


def init_outer_state(outer_optimizer: optax.GradientTransformation,
                     anchor: Params) -> OuterState:
  # One program for the optimizer state's leaves: eagerly, each zeros_like was a dispatch
  # of its own (0.05 s of configs/peer.py's start, 0.015 s jitted).
  return OuterState(anchor=anchor, opt_state=jax.jit(outer_optimizer.init)(anchor),
                    step=jnp.zeros((), jnp.int32))


def init_replica_state(inner_optimizer: optax.GradientTransformation, anchor: Params,
                       num_replicas: int) -> ReplicaState:
  """Every replica starts from the anchor with a fresh inner optimizer state."""
  params = broadcast_to_replicas(anchor, num_replicas)
  return ReplicaState(params=params, opt_state=jax.vmap(inner_optimizer.init)(params))


def broadcast_to_replicas(tree: Params, num_replicas: int) -> Params:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas, *x.shape)), tree)


_CHUNK = 16 << 20  # bytes hashed by one task: big leaves spread over the cores too


def fingerprint(tree: Any) -> str:
  """sha256 (hex) over every leaf's dtype, shape and bytes, in tree order: equal on two
  hosts only if the trees are equal bit for bit. The bytes are hashed in place, in 16 MiB
  chunks on a pool of threads (hashlib lets go of the GIL), each chunk's digest then
  hashed in order: ~cores x one sha256 stream, and no copy of the state."""
  leaves = [np.ascontiguousarray(leaf) for leaf in jax.tree.leaves(tree)]
  chunks = []  # per leaf, its bytes in _CHUNK pieces (one empty piece for an empty leaf)
  for a in leaves:
    data = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
    chunks.append([data[i:i + _CHUNK] for i in range(0, max(len(data), 1), _CHUNK)])
  flat = [c for leaf_chunks in chunks for c in leaf_chunks]
  with concurrent.futures.ThreadPoolExecutor(min(len(flat), os.cpu_count() or 1) or 1) as pool:
    digests = iter(pool.map(lambda c: hashlib.sha256(c).digest(), flat))
  total = hashlib.sha256()
  for a, leaf_chunks in zip(leaves, chunks):
    total.update(f"{a.dtype}{a.shape}".encode())
    for _ in leaf_chunks:
      total.update(next(digests))
  return total.hexdigest()


@flax.struct.dataclass
class EagerState:
  """The outer state of eager mode (docs/algorithms.md §4) for the replicas held here,
  each leaf with a leading replica axis [R, ...] except `prev_mean` and `step`.

  Attributes:
    params: θ_m, each replica's own outer params: where its next inner phase starts.
    opt_state: b_m, each replica's own outer optimizer state.
    prev_deltas: Δ_m of the previous round, needed to take the replica's own stale term
      out of the delayed mean.
    prev_mean: Δ̄ of the previous round (identical on every host).
    step: number of eager outer steps applied (identical on every host).
  """
  params: Params
  opt_state: optax.OptState
  prev_deltas: Params
  prev_mean: Params
  step: jax.Array


def init_eager_state(outer_optimizer: optax.GradientTransformation, anchor: Params,
                     num_replicas: int) -> EagerState:
  """Every replica at the anchor; Δ̄⁽⁰⁾ = Δ_m⁽⁰⁾ = 0 (so round 1 applies Δ_m/K alone)."""
  params = broadcast_to_replicas(anchor, num_replicas)
  zeros = jax.tree.map(jnp.zeros_like, anchor)
  return EagerState(params=params, opt_state=jax.vmap(outer_optimizer.init)(params),
                    prev_deltas=broadcast_to_replicas(zeros, num_replicas), prev_mean=zeros,
                    step=jnp.zeros((), jnp.int32))


def with_step_count(opt_state: optax.OptState, step: int) -> optax.OptState:
  """`opt_state` with every step counter (optax's `count` fields, which drive schedules)
  set to `step`."""
  def count(x):  # numpy's, put where x is (jnp.full_like compiles a program per shape)
    return jax.device_put(np.full(np.shape(x), step, x.dtype), getattr(x, "sharding", None))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: count(x) if getattr(path[-1], "name", None) == "count" else x,
      opt_state)


@flax.struct.dataclass
class SkipCounters:
  """Rounds whose outer step was skipped for NaN/Inf pseudo-gradients (identical on every
  host, which all see the same flags; checkpointed with the outer state).

  Attributes:
    total: skipped rounds so far in the run (int32 scalar).
    in_a_row: skipped rounds since the last applied one (int32 scalar).
  """
  total: jax.Array
  in_a_row: jax.Array

  @classmethod
  def of(cls, total: int, in_a_row: int) -> SkipCounters:
    return cls(total=np.int32(total), in_a_row=np.int32(in_a_row))
