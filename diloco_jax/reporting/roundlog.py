"""Each round's record and its line: the loop hands a round's figures to `RoundLog` (its own
when it ends, its sums' when they arrive, a round later in the async modes), which writes
the record once complete (`writers.py`: metrics.jsonl, TensorBoard, W&B) and prints its
line (`round_line`), one round late, so reading its device values (the eval loss) never
stalls the devices. Host 0 writes and prints (live membership: every host its own
workdir's files, the lowest live host prints).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any
from typing import Callable
from typing import Iterable
from typing import Mapping

import numpy as np

from diloco_jax.reporting import progress
from diloco_jax.reporting import writers
from diloco_jax.units import format_count
from diloco_jax.units import format_duration

# The parts of the outer step on the main thread's path (seconds; docs/monitoring.md).
OUTER_PARTS = ("outer_d2h", "outer_mean", "outer_update", "outer_h2d")


def round_line(r: Mapping[str, Any], num_rounds: int, total_steps: int) -> str:
  """The one line printed per round (docs/monitoring.md: "Reading the progress line")."""
  width = len(str(num_rounds))
  parts = [f"round {r['round']:>{width}}/{num_rounds}",
           f"step {r['inner_step']:>{len(str(total_steps))}}/{total_steps}",
           f"train {r['train_loss']:.4f}" + _bpb(r, "train")]
  if "eval_loss" in r:
    floor = f" (floor {r['floor']:.4f})" if r.get("floor") is not None else ""
    parts.append(f"eval {r['eval_loss']:.4f}{_bpb(r, 'eval')}{floor}")
  parts += [f"{int(r[k])} {unit}" for k, unit in (  # live: the replicas in the round's
      ("replicas", "replicas"), ("live_hosts", "hosts")) if k in r]  # mean, hosts in its sum
  if len(set(r.get("hosts_steps", ()))) > 1:  # balance 'speed': the slowest and fastest host's
    parts.append(f"steps/host {min(r['hosts_steps'])}-{max(r['hosts_steps'])}")
  parts.append(f"{format_count(r['tokens_per_sec'])} tok/s" + (
      f" (MFU {100 * r['mfu']:.1f}%)" if "mfu" in r else
      f" ({format_count(r['flops_per_sec'])}FLOP/s)" if "flops_per_sec" in r else ""))
  parts.append(f"outer {1e3 * r['outer_time']:.0f} ms")
  if "collective_time" in r:  # how long the cross-host sum took, and how much of it the
    # next inner phase hid (async modes; 0% in sync, which waits for all of it)
    parts.append(f"comm {1e3 * r['collective_time']:.0f} ms ({100 * r['overlap']:.0f}% hidden)")
  if r.get("bytes_sent"):
    parts.append(f"sent {format_count(r['bytes_sent'])}B")
  if "anchor_hash" in r:  # debug_checks: the same on every host, or the run has stopped
    parts.append(f"anchor {r['anchor_hash'][:8]} on all hosts")
  if "eta" in r:  # from this process's second round on
    parts.append(f"ETA {format_duration(r['eta'])}")
  return " | ".join(parts)


def _bpb(record: Mapping[str, Any], split: str) -> str:
  """' (1.234 bpb)' beside a loss in nats/token, where the record has bits per byte."""
  return f" ({record[split + '_bpb']:.3f} bpb)" if split + "_bpb" in record else ""


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
  """A loss in nats per token as bits per byte of text: comparable across tokenizers."""
  return nats_per_token / (math.log(2) * bytes_per_token)


@dataclasses.dataclass
class OpenRound:
  """A round whose record is not written yet.

  Attributes:
    figures: the record's fields so far, as they will be written (`writers.GROUPS` says
      under which group each is plotted).
    arrived: the round's sums that arrived (`wire.exchange.Arrived`; streaming: one per
      fragment), which give the record its bytes, times and overlap.
    diagnostics: fragment 0's per-replica statistics of Δ (a future), or None.
    loss_terms: how many inner losses the round's loss sum adds up (balance 'speed':
      Σ steps × R); None: every replica's H.
  """
  figures: dict[str, Any]
  arrived: list[Any] = dataclasses.field(default_factory=list)
  diagnostics: Any = None
  loss_terms: int | None = None


class RoundLog:
  """The open records of rounds not yet written; `write_through(r)` writes, in order, every
  record up to round r whose figures are all in (fragment 0's sum, with the loss, arrived)."""

  def __init__(self, writer: writers.MetricsWriter, bar: progress.ProgressBar, *,
               num_rounds: int, inner_steps: int, num_replicas: int,
               printing: bool | Callable[[], bool], tokens_per_round: int,
               bytes_per_token: Mapping[str, float] | None = None,
               flops_per_token: float | None = None, peak_flops: float | None = None,
               finish_estimate=lambda: 0.0, clock=time.monotonic):
    self.writer, self.bar = writer, bar
    # live membership: whether this host prints changes (the lowest live host prints)
    self._printing = printing if callable(printing) else lambda: printing
    self.num_rounds, self.h, self.num_replicas = num_rounds, inner_steps, num_replicas
    self.tokens_per_round = tokens_per_round
    self.bytes_per_token = bytes_per_token  # per split; None: no bits per byte
    # model FLOPs per token; the peak of all devices of all hosts (None: unknown, no MFU)
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self._open: dict[int, OpenRound] = {}
    self._round_times: list[float] = []
    self._steady_times: list[float] = []  # what the ETA counts
    self._clock = clock
    self._last_end: float | None = None  # when the previous round ended (on `clock`)
    self.finish_estimate = finish_estimate  # seconds the run takes after its last round
    self._ended: dict[int, float] = {}  # round -> when it ended (on `clock`), with an ETA

  @property
  def elapsed(self) -> float:
    """Seconds of the rounds trained by this process."""
    return float(np.sum(self._round_times))

  def timed(self, r: int, seconds: float, steady: bool = True,
            tokens: int | None = None) -> None:
    """Round r took `seconds` of wall time (it trained `tokens`, or `tokens_per_round`): its
    speed; and the time left: the rounds left at the mean wall time from one steady round's
    end to the next (its save included), plus the last checkpoint's write (`finish_estimate`).
    This process's first round (compiles, connections) and a profiled one are not steady."""
    now = self._clock()
    self._round_times.append(seconds)
    if steady and self._last_end is not None:
      self._steady_times.append(now - self._last_end)
    self._last_end = now
    speed = (self.tokens_per_round if tokens is None else tokens) / seconds
    self.add(r, round_time=seconds, tokens_per_sec=speed, elapsed=self.elapsed)
    if self._steady_times:  # from the end of round r; `_write` takes off what passed since
      self._ended[r] = now
      self.add(r, eta=float(np.mean(self._steady_times) * (self.num_rounds - r)
                            + self.finish_estimate()))
    if self.flops_per_token:  # over the whole round: inner steps, outer step, eval, saves
      self.add(r, flops_per_sec=speed * self.flops_per_token)
      if self.peak_flops:
        self.add(r, mfu=speed * self.flops_per_token / self.peak_flops)

  def open(self, r: int, loss_terms: int | None = None, **figures) -> None:
    self._open[r] = OpenRound({"round": r, **figures}, loss_terms=loss_terms)

  def figures(self, r: int) -> dict[str, Any]:
    """Round r's record so far, as it will be written (the log's own dict)."""
    return self._open[r].figures

  def add(self, r: int, **figures) -> None:
    self._open[r].figures.update(figures)

  def add_if_open(self, r: int, **figures) -> None:
    """Round r's figures, unless its record was written before a resume."""
    if r in self._open:
      self._open[r].figures.update(figures)

  def add_times(self, r: int, times: Mapping[str, float]) -> None:
    record = self._open[r].figures
    for key, seconds in times.items():
      record[key] = record.get(key, 0.0) + seconds

  def add_synced(self, synced: Iterable[Any]) -> None:
    """The sums that arrived (`skips.Synced`), each into the record of the round that sent
    it. A round with several (streaming's fragments) sums their bytes and times."""
    for s in synced:
      a, open_round = s.arrived, self._open.get(s.arrived.round)
      if open_round is None:  # logged before a resume: this is the drain of a finished run
        continue
      record = open_round.figures
      open_round.arrived.append(a)
      if a.key == 0:
        record["loss_sum"] = a.loss_sum
        open_round.diagnostics = a.diagnostics
      record["skipped_rounds"] = s.skipped_rounds
      if not s.applied:
        record["skipped"] = record.get("skipped", 0) + 1
      if s.bad_replicas:
        record["bad_replicas"] = ", ".join(filter(None, (record.get("bad_replicas"),
                                                         s.bad_replicas)))

  def complete(self, r: int) -> bool:
    return r in self._open and "loss_sum" in self._open[r].figures

  def settle(self, r: int) -> None:
    """Waits for the Δ diagnostics still being gathered for rounds <= r (before save r)."""
    for q in [q for q in sorted(self._open) if q <= r and self._open[q].diagnostics]:
      self._open[q].diagnostics.result()

  def forget(self) -> None:
    """Drops the records not yet written: a host dropped from a live job, joining it again,
    did not finish those rounds as the job did (the members' records hold them, and their
    figures may wait on ops that failed); the ETA's next interval does not count the time
    it was away."""
    self._open.clear()
    self._last_end = None

  def write_through(self, r: int) -> None:
    for q in sorted(self._open):
      if q > r or not self.complete(q):
        return
      self._write(self._open.pop(q))

  def _write(self, open_round: OpenRound) -> None:
    record, arrived, diagnostics = open_round.figures, open_round.arrived, open_round.diagnostics
    syncs = [a for a in arrived if a.collective_time is not None]
    live = int(record.get("replicas", self.num_replicas))  # live membership: the replicas
    terms = open_round.loss_terms or live * self.h
    record["train_loss"] = float(record.pop("loss_sum")) / terms
    if "eval_loss" in record:
      record["eval_loss"] = float(record["eval_loss"])
    for split in self.bytes_per_token or ():
      if f"{split}_loss" in record:
        record[f"{split}_bpb"] = bits_per_byte(record[f"{split}_loss"],
                                               self.bytes_per_token[split])
    record["outer_time"] = sum(record.get(k, 0.0) for k in OUTER_PARTS)
    if syncs:
      sent = [a.bytes_sent for a in syncs]
      collective, waited = (sum(a.collective_time for a in syncs), sum(a.wait for a in syncs))
      record.update(collective_time=collective, outer_wait=waited, bytes_sent=sum(sent),
                    bytes_peak=max(sent), fragments_synced=len(syncs),
                    overlap_steps=sum(a.overlap_steps for a in syncs),
                    overlap=float(np.clip(1 - waited / collective, 0, 1)) if collective else 0.0)
    elif any(a.bytes_sent for a in arrived):  # ddp: its per-step sums, timed by no one
      record["bytes_sent"] = sum(a.bytes_sent for a in arrived)
    # Written (and printed) one round late: the time left is counted from now.
    record["time"] = time.time()
    if record["round"] in self._ended:
      since = self._clock() - self._ended.pop(record["round"])
      # the last round's line comes once the final checkpoint is written: the end
      record["eta"] = max(record["eta"] - since, 0.0) if record["round"] < self.num_rounds else 0.0
    if diagnostics is not None:  # [hosts, R, 3] -> per replica, in replica order
      stats = np.asarray(diagnostics.result()).reshape(-1, 3)  # the live replicas
      record.update(delta_norm=stats[:, 0].tolist(), delta_cos=stats[:, 1].tolist(),
                    param_spread=float(np.sqrt(max(stats[:, 2].mean(), 0.0))))
    if self._printing():
      print(round_line(record, self.num_rounds, self.num_rounds * self.h), flush=True)
    self.writer.write(record)
