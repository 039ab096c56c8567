"""Pseudo-gradients across hosts: `submit` → a `Pending` sum, `wait` → an immutable `Arrived`.

Everything that moves Δ between hosts is here. Each sum is one job on the dispatch thread
(the only thread that issues cross-host collectives); the main thread keeps training while
it runs and later waits for the `Arrived` value: the mean Δ̄ over all K replicas, which
replicas had NaN/Inf in their Δ (a [K] flag vector summed with Δ, so every host sees the
same flags), the round's loss summed over hosts, timings and bytes.

The wire names no feature. What a feature of the loop needs summed over the hosts in the
same collective (each host's steps and seconds, the replicas taking part) rides along as a
`Rider`: a name and small arrays of words, summed with Δ and given back by name in
`Arrived.riders`; a rider may also say which of its words counts the replicas in the mean.

On the wire (docs/algorithms.md §7). With `outer.compression = 'none'` and
`outer.aggregation = 'mean'` a host sends the Σ of its replicas' Δ through the
collective's plain all-reduce. Otherwise it hands `collective.reduce_encoded` rows of
float32: one row (its replicas' Σ) for the mean, or one row per replica for a trimmed mean
or median (an order statistic needs every replica's value: R× the bytes of a sum), whose
chunk owner combines all K rows and returns Δ̄ itself.

Error feedback (lossy formats): what the wire did not carry of a row, x − decode(encode(x)),
is added to the same row at the next send of the same fragment. Residuals are values: a
send takes the residual going in, and its `Arrived` holds the one coming out (reset to 0
where it is not finite). A `Pending` keeps what went into its sum, so a checkpoint can
hold it and a resumed run issue it again with the same bits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
import types
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diloco_jax.algo import aggregate
from diloco_jax.algo import diloco
from diloco_jax.wire import collective as collective_lib

Params = Any
Words = dict[str, np.ndarray]
_SAVED = ("deltas", "loss", "finite", "round", "key")  # a checkpointed sum's own entries


class Rider(Protocol):
  """Words a feature adds to every sum of pseudo-gradients: summed over the hosts with Δ,
  given back by name (`Arrived.riders`). The wire never reads them, except the count of
  `divisor`.

  Attributes:
    name: its key in `Arrived.riders` and, if `keep`, in a checkpointed sum in flight.
    keep: a sum in flight keeps its words, so that a resumed run sends the same ones (they
      decide something) rather than new ones.
    divisor: the word whose sum counts the replicas in the mean (None: the mean is over
      all K). A host that takes no part in a round (`Exchange.idle`) sends it as 0, and
      with it any other word its rider names in `part` (a count of the hosts taking part).
  """
  name: str
  keep: bool
  divisor: str | None

  def words(self, round_: int) -> Words | None:
    """This host's words for the sum of round `round_` (None: none). Every host gives the
    same names and shapes."""

  def like(self) -> Words:
    """Arrays shaped as `words` gives them, to restore a checkpointed sum in flight."""


class Pending(NamedTuple):
  """A cross-host sum in flight, and what this host put into it."""
  round: int
  key: int  # the fragment (0 outside streaming)
  deltas_R: Params  # this host's Δ_m, in host memory
  loss_sum: Any  # this host's loss sum of the round (0 for fragments other than 0)
  finite_R: np.ndarray  # [R] bool: which of this host's Δ_m were finite
  residual: np.ndarray | None  # the error feedback that went into the send
  future: concurrent.futures.Future
  riders: Mapping[str, Words] = types.MappingProxyType({})  # the words of riders that keep


@dataclasses.dataclass(frozen=True)
class Arrived:
  """A sum that arrived. Every field but the timings is identical on every host.

  Attributes:
    round, key: the round in which it was sent, and the fragment.
    mean: Δ̄ over all K replicas (or over those a rider's `divisor` counts), in host memory.
    bad_K: [K] bool, the replicas whose Δ had NaN or Inf.
    loss_sum: the round's inner losses summed over every replica of every host.
    residual: this host's error feedback after the send (None without feedback).
    collective_time: seconds the dispatch thread spent in the collective.
    bytes_sent: what this host put on the wire.
    overlap_steps: inner steps the devices finished while the collective ran.
    wait: seconds the main thread waited for it.
    diagnostics: a future of [hosts, R, 3] per replica ‖Δ_m‖, cos(Δ_m, Δ̄), ‖Δ_m − Δ̄‖²
      (gathered on the dispatch thread, read when the round is logged), or None.
    riders: each rider's words summed over the hosts, by the rider's name (numpy).
    replicas: the replicas the mean is over: K, or fewer where a rider's `divisor` counts
      the replicas that took part (live membership: a host that left takes its out).
    aggregation: how the replicas' Δ were combined: `outer.aggregation`, or 'mean' where
      the replicas present were too few for it (`aggregate.for_replicas`).
    tolerated: how many non-finite Δ that combination leaves out (0 for the mean).
  """
  round: int
  key: int
  mean: Params
  bad_K: np.ndarray
  loss_sum: float
  residual: np.ndarray | None
  collective_time: float
  bytes_sent: int
  overlap_steps: int
  wait: float = 0.0
  diagnostics: concurrent.futures.Future | None = None
  riders: Mapping[str, Words] = dataclasses.field(default_factory=dict)
  replicas: int = 0
  aggregation: str = "mean"
  tolerated: int = 0


def entries(tree: Params) -> int:
  return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))


def _delta_stats(deltas_R: Params, mean: Params) -> jax.Array:
  """[R, 3]: per replica ‖Δ_m‖, cos(Δ_m, Δ̄) and ‖Δ_m − Δ̄‖² (float32)."""
  leaves_R, mean_leaves = jax.tree.leaves(deltas_R), jax.tree.leaves(mean)
  f32 = lambda x: x.astype(jnp.float32)
  dot = sum(jnp.sum(f32(d) * f32(m)[None], axis=tuple(range(1, d.ndim)))
            for d, m in zip(leaves_R, mean_leaves))
  sq = sum(jnp.sum(jnp.square(f32(d)), axis=tuple(range(1, d.ndim))) for d in leaves_R)
  mean_sq = sum(jnp.sum(jnp.square(f32(m))) for m in mean_leaves)
  cos = dot / jnp.maximum(jnp.sqrt(sq * mean_sq), 1e-30)
  return jnp.stack([jnp.sqrt(sq), cos, sq - 2 * dot + mean_sq], axis=1)


class Exchange:
  """This host's side of the cross-host mean of pseudo-gradients.

  `steps_finished`: how many inner steps the devices have finished (read on the dispatch
  thread around each collective, for `overlap_steps`); `riders`: what every sum carries
  besides Δ (`Rider`), whatever features they serve.
  """

  def __init__(self, outer: ml_collections.ConfigDict, *, collective, dispatcher,
               replicas_per_host: int, steps_finished: Callable[[], int] = lambda: 0,
               riders: Sequence[Rider] = ()):
    self.collective, self.dispatcher = collective, dispatcher
    self.replicas_per_host = replicas_per_host
    self.num_replicas = replicas_per_host * collective.num_hosts  # K
    self.steps_finished, self.riders = steps_finished, tuple(riders)
    names = [r.name for r in self.riders]
    if len(set(names)) < len(names) or set(names) & set(_SAVED):
      raise ValueError(f"riders {names}: each needs its own name, none of {_SAVED}")
    divisors = [r for r in self.riders if r.divisor is not None]
    if len(divisors) > 1:
      raise ValueError(f"riders {names}: only one may count the replicas in the mean")
    self.divisor = divisors[0] if divisors else None
    self.compression, self.aggregation = outer.compression, outer.aggregation
    self.trim = outer.trim
    self.wire_options = dict(topk_fraction=outer.topk_fraction, topk_chunk=outer.topk_chunk,
                             value_bits=outer.topk_value_bits)
    self.decay = outer.error_feedback_decay  # β: SparseLoCo's accumulator decay
    self.feedback = outer.error_feedback and outer.compression != "none"
    self.plain = outer.compression == "none" and outer.aggregation == "mean"
    self.aggregates = outer.aggregation != "mean"  # the wire returns Δ̄, not Σ Δ
    self.host_device = collective.device or jax.local_devices(backend="cpu")[0]
    self._sum_R = jax.jit(diloco.replica_sum)
    self._mean = jax.jit(lambda total: diloco.divide(total, self.num_replicas))
    self._mean_by = jax.jit(diloco.divide)  # by the replicas a rider counts
    self._stats = jax.jit(_delta_stats)
    self._idle: dict[int, frozenset[int]] = {}  # round -> hosts taking no part (`idle`)
    self._whole: frozenset[int] = frozenset()  # a rehearsal's rounds counted as all K

  def count_all(self, rounds: Sequence[int]) -> None:
    """A rehearsal alone on its wire (loop/join.py): its sums of `rounds` say all K
    replicas took part, as a whole job's do (the static K of `diloco.arrived_k`)."""
    self._whole = frozenset(rounds)

  def idle(self, round_: int, hosts: Sequence[int]) -> None:
    """`hosts` take no part in the sums of round `round_`: a host admitted at the end of
    the round before catches up in it (loop/join.py). Each of them sends zeros and counts
    no replicas (its divisor word is 0), and a robust aggregation leaves its rows out, so
    the mean is the other hosts' bit for bit (docs/algorithms.md §11). Set on the dispatch
    thread ahead of that round's sums, or by the host itself before it sends them."""
    idle = {r: h for r, h in self._idle.items() if r >= round_ - 1}
    idle[round_] = idle.get(round_, frozenset()) | frozenset(hosts)
    self._idle = idle  # one assignment: the other thread reads the old dict or the new

  def idle_hosts(self, round_: int) -> frozenset[int]:
    """The hosts that take no part in round `round_`'s sums (`idle`)."""
    return self._idle.get(round_, frozenset())

  def idle_here(self, round_: int) -> bool:
    """Whether this host takes no part in round `round_`'s sums (`idle`)."""
    return self.collective.host_index in self.idle_hosts(round_)

  def init_residuals(self, sizes: dict[int, int]) -> dict[int, np.ndarray]:
    """Zero error-feedback residuals for fragments of these sizes ({} without feedback)."""
    if not self.feedback:
      return {}
    rows = self.replicas_per_host if self.aggregates else 1
    return {key: np.zeros((rows, n), np.float32) for key, n in sizes.items()}

  def submit(self, deltas_R: Params, loss_sum, finite_R: np.ndarray, *, round_: int,
             key: int = 0, residual: np.ndarray | None = None,
             kept: Mapping[str, Words] | None = None) -> Pending:
    """Queues the sum over hosts of this host's Δ_m, with the loss, the bad flags and every
    rider's words (`kept`: words a checkpointed sum kept, sent again instead of asking)."""
    host, r = self.collective.host_index, self.replicas_per_host
    idle = self.idle_here(round_)
    if idle:  # zeros whatever the driver measured (streaming's merge leaves a difference),
      # put where Δ is (jnp.zeros_like would compile a program per shape: the members wait)
      deltas_R = jax.tree.map(lambda d: jax.device_put(np.zeros(d.shape, d.dtype),
                                                       getattr(d, "sharding", None)), deltas_R)
      finite_R = np.ones(r, bool)
    bad_K = np.zeros(self.num_replicas, np.float32)  # each host fills its own replicas'
    bad_K[host * r:(host + 1) * r] = ~np.asarray(finite_R, bool)
    payload = {"loss": loss_sum, "bad": bad_K}
    rows = None
    if self.aggregates:  # every replica's Δ: no local sum
      rows = deltas_R
    elif self.plain:
      payload["delta"] = self._sum_R(deltas_R)
    else:
      rows = jax.tree.map(lambda x: x[None], self._sum_R(deltas_R))
    kept = kept or {}
    words = {r.name: kept[r.name] if r.name in kept else r.words(round_) for r in self.riders}
    words = {name: w for name, w in words.items() if w is not None}
    if idle and self.divisor is not None and self.divisor.name in words:
      counts = getattr(self.divisor, "part", (self.divisor.divisor,))
      words[self.divisor.name] = {word: np.zeros_like(x) if word in counts else x
                                  for word, x in words[self.divisor.name].items()}
    if words:
      payload["riders"] = words
    job = functools.partial(self._job, payload, rows, residual, round_, key)
    future = self.dispatcher.submit(job, round_=round_,
                                    what="cross-host sum of pseudo-gradients")
    keep = {r.name: words[r.name] for r in self.riders if r.keep and r.name in words}
    return Pending(round_, key, deltas_R, loss_sum, np.asarray(finite_R, bool), residual,
                   future, types.MappingProxyType(keep))

  def _job(self, payload, rows, residual, round_: int, key: int) -> Arrived:
    """On the dispatch thread: the collective, then the mean."""
    t, done, sent = time.perf_counter(), self.steps_finished(), self.collective.bytes_sent

    def op(c):  # the words and Δ over the same hosts, even if one is lost meanwhile
      total = c.sum(payload)
      carried, aggregation = residual, self.aggregation
      if rows is not None:
        # K of this op: a live job's sums are over the hosts present (the epoch's), less
        # those that take no part in this round
        idle = self.idle_hosts(round_)
        present = [i for i, h in enumerate(_hosts(c)) if h not in idle]
        aggregation = aggregate.for_replicas(
            self.aggregation, len(present) * self.replicas_per_host, self.trim)
        total["delta"], carried = self._reduce_rows(
            c, rows, residual, aggregation, present, self.idle_here(round_))
      return total, carried, aggregation
    total, residual, aggregation = self.collective.atomic("the sum of pseudo-gradients", op)
    jax.block_until_ready(total)
    collective_time, overlap_steps = time.perf_counter() - t, self.steps_finished() - done
    riders = {name: {word: np.asarray(x) for word, x in words.items()}
              for name, words in total.get("riders", {}).items()}
    replicas, count = self.num_replicas, None
    if self.divisor is not None and self.divisor.name in riders:
      count = riders[self.divisor.name][self.divisor.divisor]
      replicas = self.num_replicas if round_ in self._whole else int(count)
    if self.aggregates:  # the wire combined the rows itself
      mean = jax.device_put(total["delta"], self.host_device)
    elif count is not None and not count:  # every host took no part: nothing moves
      mean = jax.device_put(jax.tree.map(np.zeros_like, total["delta"]), self.host_device)
    elif count is not None:
      mean = self._mean_by(total["delta"], count)
    else:
      mean = self._mean(total["delta"])
    return Arrived(round_, key, jax.block_until_ready(mean), np.asarray(total["bad"]) > 0,
                   float(np.asarray(total["loss"])), residual, collective_time,
                   self.collective.bytes_sent - sent, overlap_steps,
                   riders=types.MappingProxyType(riders), replicas=replicas,
                   aggregation=aggregation,
                   tolerated=aggregate.tolerated(aggregation, replicas, self.trim))

  def _reduce_rows(self, collective, rows: Params, residual: np.ndarray | None,
                   aggregation: str, present: Sequence[int], idle: bool):
    """Σ over the replicas (aggregation 'mean': rows of host sums) or their `aggregation`
    (rows of replicas) of `rows`, sent encoded over `collective`; the same bytes on every
    host. `present`: the positions of the hosts taking part among the op's (an aggregation
    leaves the others' rows out); `idle`: this host is not one of them (its rows are zeros,
    its residual kept for its next send). Returns it and the residual after this send."""
    leaves, treedef = jax.tree.flatten(rows)
    x = np.concatenate([np.asarray(v, np.float32).reshape(v.shape[0], -1) for v in leaves],
                       axis=1)
    if self.feedback and not idle:  # the accumulator: e ← β e + Δ (β = 1: plain feedback)
      x = x + (residual if self.decay == 1 else np.float32(self.decay) * residual)
    combine = collective_lib.sum_rows
    if self.aggregates:
      combine = functools.partial(aggregate.aggregate, aggregation=aggregation, trim=self.trim)
    if len(present) < collective.num_hosts:  # rows in host-major order
      r = x.shape[0]
      kept = np.array([i * r + m for i in present for m in range(r)])
      combine = functools.partial(_rows_of, kept, combine)
    out, carried = collective.reduce_encoded(x, self.compression, combine, **self.wire_options)
    if idle:
      return _unflatten(out, leaves, treedef), residual
    if self.feedback:
      residual = x - carried
      residual = np.where(np.isfinite(residual), residual, np.float32(0))
    return _unflatten(out, leaves, treedef), residual

  def wait(self, pending: Pending, diagnostics: bool = True) -> Arrived:
    """The sum of `pending`, once it arrives; with `diagnostics`, the per-replica Δ
    figures start their gather on the dispatch thread (read when the round is logged)."""
    t = time.perf_counter()
    arrived = pending.future.result()
    waited = time.perf_counter() - t
    gathered = None
    if diagnostics:
      stats = np.asarray(self._stats(pending.deltas_R, arrived.mean))
      gathered = self.dispatcher.submit(self.collective.allgather, stats,
                                        round_=pending.round, what="gather of Δ diagnostics")
    return dataclasses.replace(arrived, wait=waited, diagnostics=gathered)

  def arrived_mean(self, mean: Params) -> Params:
    """A mean that arrived elsewhere (a joiner's sum in flight) of the kind this host's
    sums give, by their program (Δ̄/1 is Δ̄, bit for bit)."""
    return jax.block_until_ready(self._mean_by(mean, np.float32(1)))

  def mean_over_replicas(self, params_R: Params) -> Params:
    """(1/K) Σ of every replica's params over all hosts (eager mode's final model)."""
    total = self.dispatcher.run(self.collective.sum, self._sum_R(params_R),
                                what="cross-host mean of the final params")
    live = self.collective.live  # live membership: the hosts left
    if len(live) == self.collective.num_hosts:
      return self._mean(total)
    return self._mean_by(total, np.float32(len(live) * self.replicas_per_host))

  # A sum in flight at a checkpoint: saved, and issued again on resume.

  @staticmethod
  def inflight(pending: Pending) -> dict[str, Any]:
    """What a checkpoint holds of a sum in flight: what this host put into it, and beside
    it, each under its name, the words of the riders that keep theirs."""
    saved = {"deltas": pending.deltas_R, "loss": np.float32(pending.loss_sum),
             "finite": pending.finite_R, "round": np.int32(pending.round),
             "key": np.int32(pending.key)}
    saved.update(pending.riders)
    return saved

  def inflight_like(self, deltas_R: Params) -> dict[str, Any]:
    """The structure of `inflight(...)` for a Δ shaped like `deltas_R`, for restoring it."""
    like = {"deltas": deltas_R, "loss": np.zeros((), np.float32),
            "finite": np.ones(self.replicas_per_host, bool), "round": np.int32(0),
            "key": np.int32(0)}
    like.update({r.name: r.like() for r in self.riders if r.keep})
    return like

  def resubmit(self, saved: dict[str, Any], residuals: dict[int, np.ndarray]) -> Pending:
    """Issues again the sum that was in flight when the checkpoint was written; the
    residual that went into it is still `residuals[key]` (residuals move on only when a
    sum arrives)."""
    key = int(saved["key"])
    kept = {r.name: {word: np.asarray(saved[r.name][word], x.dtype)
                     for word, x in r.like().items()}
            for r in self.riders if r.keep and r.name in saved}
    return self.submit(jax.device_put(saved["deltas"], self.host_device), saved["loss"],
                       np.asarray(saved["finite"]), round_=int(saved["round"]), key=key,
                       residual=residuals.get(key), kept=kept)


def _hosts(collective) -> Sequence[int]:
  """The hosts of a collective's op, in the order of its rows: a live epoch's members, or
  every host."""
  epoch = getattr(collective, "epoch", None)
  return epoch.hosts if epoch is not None else range(collective.num_hosts)


def _rows_of(kept: np.ndarray, combine, rows: np.ndarray) -> np.ndarray:
  """`combine` over the rows of the hosts taking part (none: zeros, nothing moves)."""
  return combine(rows[kept]) if len(kept) else np.zeros(rows.shape[1:], rows.dtype)


def _unflatten(out: np.ndarray, leaves, treedef) -> Params:
  """[N] -> the tree of `leaves` without their row axis."""
  sizes = [int(np.prod(leaf.shape[1:])) for leaf in leaves]
  parts = np.split(out, np.cumsum(sizes)[:-1])
  return jax.tree.unflatten(treedef, [p.reshape(leaf.shape[1:])
                                      for p, leaf in zip(parts, leaves)])
