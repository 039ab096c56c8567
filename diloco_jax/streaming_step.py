"""The trainer's side of Streaming DiLoCo (ALGORITHMS.md §4; the schedule and the math are
`streaming`'s, so `simulate` and the trainer agree): an outer step that syncs P fragments
mid-round, each fragment's mean one job on the dispatch thread.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np

from diloco_jax import outer
from diloco_jax import streaming

Params = Any


class StreamingOuterStep(outer.OuterStep):
  """ALGORITHMS.md §4, with streaming.py's phase convention: fragment p's Δ against its
  own θᵍ_p is sent after inner steps n·H + p·H/P (one dispatch job per fragment); τ steps
  later its mean moves θᵍ_p with the fragment's own outer optimizer and every replica
  merges it in. The outer state is the list of the P fragments' OuterStates.

  Fragment 0's job carries the round's loss and completes the round's record (bytes and
  collective time summed over the fragments synced since the previous one; `bytes_peak`,
  the most one sync sent: the peak in flight). At a round's end only fragment 0 can be in
  flight (τ < H/P), so checkpoints and resumes treat it as `delayed` treats its sum.
  """

  def __init__(self, *args, num_fragments: int, layout: str, overlap_steps: int,
               merge_alpha: float, num_rounds: int, inner_steps: int, **kw):
    self._pending: dict[int, outer.Pending] = {}
    super().__init__(*args, **kw)
    self.num_fragments, self.layout, self.alpha = num_fragments, layout, merge_alpha
    self.h = inner_steps
    self.events = streaming.events(num_rounds, inner_steps, num_fragments, overlap_steps)
    self.sends_late = overlap_steps > 0
    self._merge = jax.jit(functools.partial(streaming.merge, alpha=merge_alpha,
                                            num_replicas=self.replicas_per_host),
                          out_shardings=self.on_mesh)
    self._synced: list[dict] = []  # syncs of fragments ≥ 1 since fragment 0's last one

  @property
  def pending(self) -> outer.Pending | None:  # the in-flight sum of fragment 0
    return self._pending.get(0)

  @pending.setter
  def pending(self, value: outer.Pending | None) -> None:
    if value is None:
      self._pending.pop(0, None)
    else:
      self._pending[0] = value

  def _in_flight(self) -> list[outer.Pending]:
    return list(self._pending.values())

  def init(self, anchor: Params):
    self.ids = jax.tree.leaves(streaming.model_fragment_ids(anchor, self.num_fragments,
                                                            self.layout))
    self.treedef = jax.tree.structure(anchor)
    parts = streaming.split(anchor, self.ids, self.num_fragments)
    self.wire.init_residuals({p: outer.entries(part) for p, part in enumerate(parts)},
                             self.replicas_per_host)
    return jax.device_put(streaming.outer_states(self.optimizer, anchor, self.ids,
                                                 self.num_fragments), self.host)

  def model(self, outer_states) -> Params:
    """θᵍ: every fragment's global copy."""
    return self.place(streaming.join([s.anchor for s in outer_states], self.ids,
                                     self.treedef))

  def on_step(self, outer_states, replicas, step: int, round_: int):
    return self._handle(step, list(outer_states), replicas, None, {"round": round_}, round_)

  def __call__(self, outer_states, replicas, loss_sum, round_: int):
    record = {"round": round_}
    outer_states, replicas = self._handle(round_ * self.h, list(outer_states), replicas,
                                          loss_sum, record, round_)
    return outer_states, replicas, self.model(outer_states), record

  def _handle(self, step: int, outer_states: list, replicas, loss_sum, record: dict,
              round_: int):
    for kind, p in self.events.get(step, ()):
      if kind == "send":
        own = record if p == 0 else {"round": round_}
        local = self.to_host(self._fragment(replicas.params, p), own)
        deltas_R = self.pseudo_gradients(outer_states[p].anchor, local)
        finite_R, replicas = self.check_finite(deltas_R, replicas)
        loss = loss_sum if p == 0 else np.zeros((), np.float32)
        self._pending[p] = self.submit(deltas_R, loss, finite_R, own, round_, key=p)
        continue
      pending = self._pending.pop(p)
      t = time.perf_counter()
      mean, ok = self.wait(pending, stats=p == 0)
      if ok:
        outer_states[p] = jax.block_until_ready(self._update(outer_states[p], mean))
      replicas = self._merge_in(replicas, p, outer_states[p].anchor)
      # The main thread's time in this sync: the wait for the mean, the update, the merge.
      pending.record["outer_update"] = time.perf_counter() - t
      self._account(pending.record, p)
    return outer_states, replicas

  def _fragment(self, params: Params, p: int) -> list:
    return streaming.split(params, self.ids, self.num_fragments)[p]

  def _merge_in(self, replicas, p: int, anchor_p: list):
    """θ_m,p ← α·θ_m,p + (1 − α)·θᵍ_p on the local devices (α = 0: the sync broadcast)."""
    placed = self.place(anchor_p)
    new = (self._broadcast(placed) if self.alpha == 0 else
           self._merge(self._fragment(replicas.params, p), placed))
    parts = streaming.split(replicas.params, self.ids, self.num_fragments)
    parts[p] = jax.block_until_ready(new)
    return replicas.replace(params=streaming.join(parts, self.ids, self.treedef))

  def _account(self, record: dict, p: int) -> None:
    """Fragment 0's record gets the traffic of every sync since its previous one."""
    if p != 0:
      self._synced.append(record)
      return
    synced, self._synced = [record, *self._synced], []
    sent = [r.get("bytes_sent", 0) for r in synced]
    total = lambda key: sum(r.get(key, 0.0) for r in synced)
    record.update(bytes_sent=sum(sent), bytes_peak=max(sent), fragments_synced=len(synced),
                  collective_time=total("collective_time"), outer_d2h=total("outer_d2h"),
                  outer_update=total("outer_update"))

  def drain(self, outer_states, replicas):
    return outer_states, replicas, self.model(outer_states)  # the last syncs were applied

  def inflight_like(self, params_R: Params) -> dict:
    like = super().inflight_like(params_R)
    return {**like, "deltas": self._fragment(params_R, 0)}
