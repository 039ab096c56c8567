"""A run's round time, compute utilization and bytes per host, predicted before it runs.

One round on host h is its inner phase, C_h = steps_h x t_h (t_h: seconds per inner step
of all its replicas), the round's own work besides (f: evaluation, checkpoints, logging)
and the round's sync. The sync puts W bytes per host on a link of
bandwidth B (the slower direction; a ring sends and receives as much) and takes

  T_x(W) = W / (efficiency x B) + 2(n - 1) x rtt / 2        (a ring's 2(n - 1) hops)
  T_sync = overhead + T_x(W) + codec x N + outer x N

with N the params, `codec` the encode + decode seconds per entry of the format and
`outer` the outer step's (host copies, Nesterov) per param. By mode, with C = max_h C_h
(the round waits for the slowest host):

  sync       C + T_sync
  streaming  C + P x max(0, T_sync(W / P, N / P) - overlap_steps x t): P fragments, each
             hidden behind the steps that overlap it
  eager,     max(C, T_x(W) + codec x N) + overhead + async + outer x N: the sum crosses
  delayed    the link while the next inner phase trains; `async` is the round's own cost
             of running it on the background thread (hand-offs, copies, the host's
             cores shared with the inner phase)
  ddp        H x (t + overhead + T_x(gradient all-reduce)): every step waits

Compute utilization is what the round would take without DiLoCo's communication over
what it takes, C_h + f over the round, averaged over hosts (bench/wan.py's measure: the
same hosts as independent jobs, against the run). W is the pseudo-gradient's bytes as the
wire code counts them (`bytes_per_host`; the round's few small sums besides, tens of bytes,
are left out); the constants (`Constants`) are fitted to measured runs (bench/plan.py,
bench/results/plan_fit.json). Which formula is a mode's, its driver's traits say
(`modes.base.Driver`: per_step, fragments, asynchronous), and the steps each host trains
under balance 'speed' are the trainer's own decision (`algo.balance.speed_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from diloco_jax import errors
from diloco_jax.algo import balance as balance_lib
from diloco_jax.algo import compress
from diloco_jax.modes import names
from diloco_jax.modes import registry

BALANCES = ("fixed", "speed")
# How far a setting departs from plain DiLoCo (float32, sync, the smallest H), which a
# recommendation keeps small: a step per format coarser than bf16 (bf16 loses nothing the
# outer step feels), the mode's own (its driver's `departure`: one for eager, two for
# delayed), one per doubling of H.
FORMAT_RANK = ("none", "bf16", "int8", "4bit", "2bit", "topk", "chunk_topk")
FORMAT_COST = {"none": 0, "bf16": 0, "int8": 1, "4bit": 2, "2bit": 3, "topk": 3,
               "chunk_topk": 4}


@dataclasses.dataclass(frozen=True)
class Constants:
  """What the model cannot know from the setting; fitted by bench/plan.py."""
  round_overhead_s: float  # per round besides the steps and the sync: eval, checkpoints, logs
  overhead_s: float  # seconds per sync besides the payload: small collectives, dispatch
  link_efficiency: float  # payload bytes moved / (bandwidth x time)
  codec_s_per_entry: float  # encode + decode of a compressed format, per entry
  async_overhead_s: float  # per round of eager/delayed: the background sum's own cost
  outer_s_per_param: float  # the outer step on the host: copies and Nesterov, per param


@dataclasses.dataclass(frozen=True)
class Setting:
  """A run to predict. step_time: seconds per inner step of each host's replicas (one
  value: every host); bandwidth in Mbit/s each way, rtt in ms."""
  num_params: int
  hosts: int
  step_time: tuple[float, ...]
  up_mbit: float
  down_mbit: float
  rtt_ms: float = 0.0
  mode: str = names.PLAIN
  inner_steps: int = 25
  compression: str = "none"
  fragments: int = 1
  overlap_steps: int = 0
  replicas_per_host: int = 1
  balance: str = "fixed"
  balance_tolerance: float = 0.1
  balance_max_factor: int = 4
  num_rounds: int = 1
  topk_fraction: float = 0.01
  topk_chunk: int = 4096
  topk_value_bits: int = 2

  def times(self) -> tuple[float, ...]:
    return self.step_time * self.hosts if len(self.step_time) == 1 else self.step_time


@dataclasses.dataclass(frozen=True)
class Prediction:
  round_s: float  # one round's wall time
  compute_s: float  # the slowest host's inner phase
  wait_share: float  # the round's share not spent computing, on the slowest host
  utilization: float  # the hosts' mean share of the round spent computing
  bytes_per_host: float  # what one host puts on the wire per round
  wall_s: float  # num_rounds rounds
  host_steps: tuple[int, ...]  # inner steps each host trains per round


class PlanError(errors.DilocoError, ValueError):
  """A setting that cannot be planned; the message names the input."""
  prefix = "Cannot plan"


def check(s: Setting) -> None:
  """A PlanError naming the first impossible input."""
  mode = registry.DRIVERS.get(s.mode)  # None: not a mode (the rule below names them)
  rules = [
      (s.hosts >= 1, f"hosts = {s.hosts}: must be >= 1"),
      (s.num_params >= 1, f"params = {s.num_params}: must be >= 1"),
      (s.inner_steps >= 1, f"inner_steps (H) = {s.inner_steps}: must be >= 1"),
      (min(s.up_mbit, s.down_mbit) > 0,
       f"bandwidth {s.up_mbit:g}/{s.down_mbit:g} Mbit/s: must be > 0"),
      (s.rtt_ms >= 0, f"rtt_ms = {s.rtt_ms:g}: must be >= 0"),
      (all(t > 0 for t in s.step_time), f"step_time = {list(s.step_time)}: must be > 0"),
      (len(s.step_time) in (1, s.hosts),
       f"step_time: {len(s.step_time)} values for {s.hosts} hosts (give 1 or {s.hosts})"),
      (mode is not None, f"mode = {s.mode!r}: one of {', '.join(registry.names())}"),
      (s.compression in compress.FORMATS,
       f"compression = {s.compression!r}: one of {', '.join(compress.FORMATS)}"),
      (s.compression == "none" or not (mode and mode.per_step),
       f"compression = {s.compression!r}: mode {s.mode!r} sums float32 gradients"),
      (s.fragments == 1 or (mode and mode.fragments),
       f"fragments = {s.fragments}: only mode "
       f"{registry.listed(registry.names(lambda d: d.fragments))} syncs fragments"),
      (s.fragments >= 1 and s.inner_steps % max(s.fragments, 1) == 0,
       f"fragments = {s.fragments}: must divide inner_steps = {s.inner_steps}"),
      (s.balance in BALANCES, f"balance = {s.balance!r}: one of {', '.join(BALANCES)}"),
      (s.num_rounds >= 1, f"num_rounds = {s.num_rounds}: must be >= 1"),
  ]
  for ok, message in rules:
    if not ok:
      raise PlanError(message)


@functools.cache
def bytes_per_entry(fmt: str, topk_fraction: float = 0.01, topk_chunk: int = 4096,
                    topk_value_bits: int = 2) -> float:
  """Encoded bytes per entry of the pseudo-gradient: compress.encode's own output on a
  sample of whole blocks and chunks, so the scales and offsets are counted as sent."""
  size = 16 * max(compress.BLOCK, topk_chunk)
  sample = np.random.default_rng(0).standard_normal(size).astype(np.float32)
  options = dict(topk_fraction=topk_fraction, topk_chunk=topk_chunk,
                 value_bits=topk_value_bits) if fmt == "chunk_topk" else (
                     dict(topk_fraction=topk_fraction) if fmt == "topk" else {})
  return compress.encode(sample, fmt, **options).nbytes / size


def bytes_per_host(s: Setting, num_params: int | None = None) -> float:
  """What one host sends in one sync of `num_params` (default: all), as the wire code
  counts it (wire/collective.py): a ring all-reduce of the host's float32 sum; compressed
  formats send each replica's row encoded to its chunk's owner and all-gather the encoded
  reduced chunks; sparse all-gathered formats send each row whole to every other host."""
  n, entries = s.hosts, num_params or s.num_params
  if n == 1:
    return 0.0
  if s.compression == "none":
    return 2 * (n - 1) / n * 4 * entries
  encoded = entries * bytes_per_entry(s.compression, s.topk_fraction, s.topk_chunk,
                                      s.topk_value_bits)
  if s.compression in compress.GATHERED:
    return (n - 1) * s.replicas_per_host * encoded
  return (s.replicas_per_host * (n - 1) / n + (n - 1) / n) * encoded


def host_steps(s: Setting) -> tuple[int, ...]:
  """Inner steps per host and round: H each ('fixed'), or the trainer's decision for these
  speeds ('speed', `algo.balance.speed_steps`: the slowest host and those within the
  tolerance H, the others H x t_slowest / t_h, at most max_factor x H)."""
  if s.balance == "fixed":
    return (s.inner_steps,) * s.hosts
  return tuple(balance_lib.speed_steps(s.times(), s.inner_steps, tolerance=s.balance_tolerance,
                                       max_factor=s.balance_max_factor))


def predict(s: Setting, c: Constants) -> Prediction:
  check(s)
  times, steps = s.times(), host_steps(s)
  phases = [n * t for n, t in zip(steps, times)]
  compute = max(phases)
  bandwidth = min(s.up_mbit, s.down_mbit) * 1e6 / 8  # bytes/s
  hops = 2 * (s.hosts - 1) * s.rtt_ms / 2e3 if s.hosts > 1 else 0.0
  codec = c.codec_s_per_entry if s.compression != "none" else 0.0

  def transfer(w: float) -> float:
    return w / (c.link_efficiency * bandwidth) + hops if w else 0.0

  w = bytes_per_host(s)
  n = s.num_params
  if s.hosts == 1:
    sync = c.outer_s_per_param * n
  else:
    sync = c.overhead_s + transfer(w) + (codec + c.outer_s_per_param) * n
  f = c.round_overhead_s
  mode = registry.driver(s.mode)
  if mode.per_step:
    grad = 2 * (s.hosts - 1) / s.hosts * 4 * n
    per_step = (c.overhead_s + transfer(grad)) if s.hosts > 1 else 0.0
    round_s = s.inner_steps * (max(times) + per_step)
  elif mode.fragments:
    p, t = s.fragments, max(times)
    part = (c.overhead_s + transfer(w / p) + (codec + c.outer_s_per_param) * n / p
            if s.hosts > 1 else c.outer_s_per_param * n / p)
    round_s = compute + p * max(0.0, part - s.overlap_steps * t)
  elif mode.asynchronous:  # eager, delayed: the sum overlaps the next inner phase
    hidden = transfer(w) + codec * n if s.hosts > 1 else 0.0
    extra = c.overhead_s + c.async_overhead_s if s.hosts > 1 else 0.0
    round_s = max(compute, hidden) + extra + c.outer_s_per_param * n
  else:  # sync: the round waits for its sum
    round_s = compute + sync
  round_s += f
  utilization = float(np.mean([(p + f) / round_s for p in phases]))
  return Prediction(round_s=round_s, compute_s=compute, wait_share=1 - (compute + f) / round_s,
                    utilization=utilization, bytes_per_host=w if not mode.per_step else
                    s.inner_steps * 2 * (s.hosts - 1) / s.hosts * 4 * n,
                    wall_s=s.num_rounds * round_s, host_steps=steps)


def recommend(rows: list[tuple[Setting, Prediction]], target: float
              ) -> tuple[Setting, Prediction, bool]:
  """Of `rows`, the setting that reaches `target` utilization with the least departure
  from plain DiLoCo (FORMAT_COST + the mode's departure + log2 of H over the smallest H
  tried; ties: the less compressed, then `mode_order`, then the smaller H), and True; if
  none does, the one that comes closest, and False."""
  reaching = [(s, p) for s, p in rows if p.utilization >= target]
  if not reaching:
    return (*max(rows, key=lambda row: row[1].utilization), False)
  smallest = min(s.inner_steps for s, _ in rows)

  def departure(row):
    s = row[0]
    return (FORMAT_COST[s.compression] + registry.driver(s.mode).departure
            + math.log2(s.inner_steps / smallest),
            FORMAT_RANK.index(s.compression), mode_order(s.mode), s.inner_steps)

  s, p = min(reaching, key=departure)
  return s, p, True


def mode_order(mode: str) -> tuple[bool, int, bool]:
  """The order of modes among equal departures: DiLoCo before the per-step baseline, the
  nearer to plain DiLoCo first, the whole model before fragments (sync, streaming, eager,
  delayed, ddp)."""
  d = registry.driver(mode)
  return (d.per_step, d.departure, d.fragments)
