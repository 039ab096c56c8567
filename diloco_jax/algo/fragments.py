"""Streaming DiLoCo (docs/algorithms.md §5): the params in P fragments, synced at staggered times.

Phase convention (S25's): with J = H/P (K is the replica count), fragment p sends its
pseudo-gradient after global inner steps n·H + p·J for n = 1, 2, ..., so every fragment
trains exactly H inner steps between two sends (fragment p ≥ 1 first sends after H + p·J
steps). Its mean arrives τ inner steps later (τ < J: one fragment in flight at a time);
then the fragment's own outer optimizer moves its global copy θᵍ_p, and every replica
mixes it in: θ_m,p ← α·θ_m,p + (1 − α)·θᵍ_p. With τ = 0 the mean is applied at the step it
is sent. A mean still in flight after the last step is applied at the end. The model to
evaluate is θᵍ; fragment p ≥ 1 holds the replicas' work up to its last send.

Fragments are lists of leaves (in `jax.tree.leaves` order); `fragment_ids` maps each leaf
to its fragment. `model_fragment_ids` puts block l (the top-level params named `block_<l>`,
in every model family and in your own module) in fragment l mod P (strided) or l·P // L
(sequential), and everything else (embeddings, final norm, head) in fragment 0.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from typing import ClassVar

import jax
import optax

from diloco_jax.algo import state as state_lib

Params = Any
LAYOUTS = ("strided", "sequential")


def model_fragment_ids(params: Params, num_fragments: int, layout: str = "strided") -> Params:
  """Per leaf of the model's params: its fragment."""
  if layout not in LAYOUTS:
    raise ValueError(f"fragment layout {layout!r}: one of {LAYOUTS}")
  blocks = {int(m.group(1)) for m in map(lambda k: re.fullmatch(r"block_(\d+)", k),
                                          params) if m}
  num_layers = max(blocks) + 1 if blocks else 0
  if num_layers < num_fragments:
    raise ValueError(f"{num_fragments} fragments but the model has {num_layers} blocks "
                     "(top-level params named block_0, block_1, ...; a fragment is made of "
                     "whole blocks)")

  def fragment(path, _):
    key = getattr(path[0], "key", None)
    m = re.fullmatch(r"block_(\d+)", str(key))
    if m is None:
      return 0  # embeddings, final norm, head
    layer = int(m.group(1))
    return layer % num_fragments if layout == "strided" else layer * num_fragments // num_layers

  return jax.tree_util.tree_map_with_path(fragment, params)


def split(tree: Params, ids: list[int], num_fragments: int) -> list[list[jax.Array]]:
  """The leaves of `tree` grouped by fragment."""
  leaves = jax.tree.leaves(tree)
  return [[x for x, i in zip(leaves, ids) if i == p] for p in range(num_fragments)]


def join(parts: list[list[jax.Array]], ids: list[int], treedef) -> Params:
  cursors = [iter(part) for part in parts]
  return jax.tree.unflatten(treedef, [next(cursors[i]) for i in ids])


def merge(local_K: list[jax.Array], new_global: list[jax.Array], alpha: float,
          num_replicas: int) -> list[jax.Array]:
  """θ_m,p ← α·θ_m,p + (1 − α)·θᵍ_p for every replica (α = 0: the global copy itself)."""
  fresh = state_lib.broadcast_to_replicas(new_global, num_replicas)
  if alpha == 0:
    return fresh
  return jax.tree.map(lambda l, g: (alpha * l + (1 - alpha) * g).astype(l.dtype), local_K,
                      fresh)


def check_schedule(h: int, num_fragments: int, tau: int) -> int:
  """J = H/P, after checking that P divides H and that τ < J."""
  if h % num_fragments:
    raise ValueError(f"inner_steps H = {h} must be divisible by the {num_fragments} fragments")
  k = h // num_fragments
  if not 0 <= tau < k:
    raise ValueError(f"overlap τ = {tau} must be in [0, H/P = {k})")
  return k


def events(num_rounds: int, h: int, num_fragments: int, tau: int) -> dict[int, list]:
  """{global step t: [("send" | "receive", fragment), ...]} after inner step t, in order."""
  k = check_schedule(h, num_fragments, tau)
  total, out = num_rounds * h, {}
  for p in range(num_fragments):
    for send in range(h + p * k, total + 1, h):
      out.setdefault(send, []).append(("send", p))
      out.setdefault(min(send + tau, total), []).append(("receive", p))
  for t in out:  # a send before the receive of the same step (τ = 0)
    out[t].sort(key=lambda e: e[0] != "send")
  return out


def outer_states(outer_optimizer: optax.GradientTransformation, init_params: Params,
                 ids: list[int], num_fragments: int) -> list[state_lib.OuterState]:
  return [state_lib.init_outer_state(outer_optimizer, part)
          for part in split(init_params, ids, num_fragments)]



@dataclasses.dataclass(frozen=True)
class Fragments:
  """The P fragments' global copies as one outer state (the list of their OuterStates),
  seen as a `diloco` rule sees its state: the model is θᵍ, every fragment's anchor;
  every host holds all of it identically."""
  ids: tuple[int, ...]  # per leaf of the params: its fragment
  treedef: Any
  per_replica: ClassVar[bool] = False

  def model(self, states: list[state_lib.OuterState]) -> Params:
    return join([s.anchor for s in states], list(self.ids), self.treedef)

  final = model

  def split(self, states: list[state_lib.OuterState]) -> tuple[Any, Any]:
    return states, None

  def join(self, shared: Any, own: Any) -> list[state_lib.OuterState]:
    del own
    return list(shared)
