"""Unequal hosts (`config.balance`): how many inner steps each host trains in each round.

Under 'fixed' every host trains H steps. Under 'speed' a host twice as fast as the
slowest trains about 2H (`algo/balance.py`), so no host idles while the slowest finishes,
and the outer step weights each replica by the tokens it trained (docs/algorithms.md §9):
this host's Δ is scaled by s = K·w_host / Σw before anything judges or sends it
(`weighted`), exactly 1.0 when the steps are equal.

The speeds ride the round's sum of pseudo-gradients (the `Pacer` is the exchange's rider
"pace", in the modes whose driver `carries_pace`, under 'fixed' too, for the records), so
measuring them costs no collective and every host reads the same numbers: each host puts
into the sum its replicas' steps ([K] words, one per replica: tokens = steps × batch ×
seq_len) and its seconds of inner phase ([hosts] words; 0: not measured, a round that
compiled). When the sum of a round r with r % balance_every == 0 arrives, every host
decides the same steps from the window's per-host median seconds per step; they hold from
the next round on.

Under live membership a sum holds the hosts present (those with steps in it): the weights
are over the hosts of the epoch a round's Δ is sent in (`present`), a set of hosts that
differs from the last sum's restarts the measurements, and a decision is over the hosts
present (one away keeps H steps until it is measured again).

The decisions and the window's timings are part of the checkpoint (`state`), so a resumed
run replays what the uninterrupted one decided instead of measuring again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from diloco_jax import errors
from diloco_jax.algo import balance


class BalanceError(errors.DilocoError, RuntimeError):
  """The hosts disagree on the steps of a round: their configs or code differ."""


class Decision(NamedTuple):
  """From round `first` on, host h trains `steps[h]` inner steps per round."""
  first: int
  steps: tuple[int, ...]


class Pacer:
  """This host's side of `config.balance`; every host holds the same decisions. A rider
  of the round's sum (`wire.exchange.Rider`): under 'speed' its words decide the steps, so
  a sum in flight keeps them and a resumed run sends the same ones."""
  name = "pace"
  divisor = None

  def __init__(self, config: ml_collections.ConfigDict, *, host: int, num_hosts: int,
               replicas_per_host: int, present: Callable[[], Sequence[int]] | None = None,
               idle: Callable[[int], Collection[int]] = lambda r: ()):
    self.speed = self.keep = config.balance == "speed"
    self.h, self.num_rounds = config.inner_steps, config.num_rounds
    self.every, self.tolerance = config.balance_every, config.balance_tolerance
    self.max_factor = config.balance_max_factor
    self.host, self.num_hosts, self.replicas_per_host = host, num_hosts, replicas_per_host
    self.decisions = [Decision(1, (self.h,) * num_hosts)]
    self.seconds: dict[int, list[float]] = {}  # round -> per host s/step (0: not measured)
    self.busy: dict[int, float] = {}  # the latest round's inner-phase seconds (`measured`)
    self.changed = False  # a decision was taken since `take_changed` was last asked
    # the hosts in the next sum (live membership: the epoch's); every host by default
    self.present = present or (lambda: range(num_hosts))
    self.idle = idle  # the hosts present that take no part in a round (a joiner catching up)
    self.last_present: tuple[int, ...] | None = None  # the hosts in the last sum

  def steps(self, r: int) -> tuple[int, ...]:
    """Every host's inner steps in round r."""
    return next(d.steps for d in reversed(self.decisions) if d.first <= r)

  def my_steps(self, r: int) -> int:
    return self.steps(r)[self.host]

  def scale(self, r: int) -> np.float32:
    """s = K·w_host / Σ_k w_k for this host's replicas in round r, over the hosts present:
    hosts·n_host / Σ n (the replicas per host cancel); 1.0 exactly when they train the
    same steps. (A host lost in the sum leaves that round's weights summing to a little
    less or more than the replicas left: the mean is off by that much, once.)"""
    steps = self.steps(r)
    idle = self.idle(r)
    if self.host in idle:  # it sends zeros (wire/exchange.py: `idle`)
      return np.float32(1)
    present = [steps[h] for h in self.present() if h not in idle]
    return np.float32(len(present) * steps[self.host] / sum(present))

  def schedule_steps(self, host: int | None = None) -> int:
    """The length of a host's learning-rate schedule, in its own steps: num_rounds × H
    until a decision first gives it other steps; from then on what it trains in the run
    if that decision held to the end. Set once, so that a host's inner step is compiled
    again at most once in a run: later decisions move its steps by little (the schedule
    then ends a little before or after the run's last round)."""
    host = self.host if host is None else host
    first = next((d for d in self.decisions if d.steps[host] != self.h), None)
    if first is None:
      return self.num_rounds * self.h
    return (self.steps_done(first.first - 1, host)
            + (self.num_rounds - first.first + 1) * first.steps[host])

  def steps_done(self, r: int, host: int | None = None) -> int:
    """The inner steps each replica of a host has trained after round r."""
    host = self.host if host is None else host
    return sum(n * steps[host] for n, steps in self._segments(r))

  def tokens_through(self, r: int, tokens_per_replica_step: int) -> int:
    """Tokens every replica of every host has trained after round r."""
    steps = sum(self.steps_done(r, host) for host in range(self.num_hosts))
    return steps * self.replicas_per_host * tokens_per_replica_step

  def _segments(self, r: int) -> list[tuple[int, tuple[int, ...]]]:
    """(rounds, steps) of each decision within rounds 1..r."""
    ends = [d.first for d in self.decisions[1:]] + [r + 1]
    return [(max(min(end, r + 1) - d.first, 0), d.steps) for d, end in zip(self.decisions, ends)]

  # The words each round's sum carries.

  def measured(self, r: int, busy: float) -> None:
    """This host's inner phase of round r took `busy` seconds (0: not measured)."""
    self.busy = {r: busy}

  def words(self, r: int) -> dict[str, np.ndarray]:
    """This host's part of round r's sum: its replicas' steps and its inner-phase seconds."""
    busy = self.busy.get(r, 0.0)
    steps_K = np.zeros(self.num_hosts * self.replicas_per_host, np.float32)
    mine = slice(self.host * self.replicas_per_host, (self.host + 1) * self.replicas_per_host)
    steps_K[mine] = self.my_steps(r)
    busy_hosts = np.zeros(self.num_hosts, np.float32)
    busy_hosts[self.host] = busy
    return {"steps": steps_K, "busy": busy_hosts}

  def like(self) -> dict[str, np.ndarray]:
    """The structure of `words`, for restoring a sum in flight."""
    return {"steps": np.zeros(self.num_hosts * self.replicas_per_host, np.float32),
            "busy": np.zeros(self.num_hosts, np.float32)}

  def arrived(self, r: int, pace: dict[str, np.ndarray], now: int) -> dict[str, Any]:
    """Round r's sum arrived during round `now` with `pace` (the words summed over hosts):
    checks the hosts agree on r's steps, keeps their speeds, decides at the window's end
    (taking effect at round now + 1). Returns round r's per-host figures for its record."""
    steps = np.asarray(pace["steps"]).reshape(self.num_hosts, self.replicas_per_host)[:, 0]
    present = tuple(int(h) for h in np.flatnonzero(steps))  # a host away sent nothing
    decided = self.steps(r)
    if any(int(steps[h]) != decided[h] for h in present):
      raise BalanceError(f"round {r}: the hosts trained {steps.astype(int).tolist()} inner "
                         f"steps, this host decided {list(decided)}: their configs or "
                         f"versions differ")
    if self.last_present is not None and present != self.last_present:
      self.seconds = {}  # other hosts: measure them anew
    self.last_present = present
    busy = [float(b) for b in np.asarray(pace["busy"])]
    self.seconds[r] = [b / s if b > 0 and s > 0 else 0.0 for b, s in zip(busy, decided)]
    if self.speed and r % self.every == 0 and now < self.num_rounds:
      self._decide(r, now + 1, present)
    slowest = max(busy)
    return {"hosts_steps": list(self.steps(r)), "hosts_busy": busy,
            "hosts_idle": [slowest - b for b in busy]}

  def _decide(self, r: int, first: int, present: tuple[int, ...]) -> None:
    window = [self.seconds[q] for q in range(r - self.every + 1, r + 1) if q in self.seconds]
    per_host = [[w[h] for w in window if w[h] > 0] for h in present]
    for q in [q for q in self.seconds if q <= r]:
      del self.seconds[q]
    if not all(per_host):  # a host measured no round of the window: keep the steps
      return
    decided = balance.speed_steps([statistics.median(s) for s in per_host], self.h,
                                  tolerance=self.tolerance, max_factor=self.max_factor)
    steps = [self.h] * self.num_hosts  # a host away trains H once back, until measured
    for h, n in zip(present, decided):
      steps[h] = n
    # A host's steps change only by more than the tolerance: timings jitter, and a change
    # recompiles that host's inner step (its learning-rate schedule's length).
    current = self.steps(first)
    steps = tuple(new if abs(new - old) > self.tolerance * old else old
                  for new, old in zip(steps, current))
    if steps != current:
      self.decisions.append(Decision(first, steps))
      self.changed = True

  def take_changed(self) -> bool:
    changed, self.changed = self.changed, False
    return changed

  # In the checkpoint (JSON, the same on every host) and run.json.

  def state(self) -> dict[str, Any]:
    return {"decisions": [[d.first, list(d.steps)] for d in self.decisions],
            "seconds": {str(q): s for q, s in self.seconds.items()},
            "present": None if self.last_present is None else list(self.last_present)}

  def restore(self, state: dict[str, Any] | None, *, same_world: bool) -> None:
    """The decisions of a checkpoint (none under 'fixed', or from before a host-count
    change: the new world starts at H steps each and measures anew)."""
    if not self.speed or not state or not same_world:
      return
    self.decisions = [Decision(int(f), tuple(int(s) for s in steps))
                      for f, steps in state["decisions"]]
    self.seconds = {int(q): [float(x) for x in s] for q, s in state["seconds"].items()}
    present = state.get("present")  # (checkpoints of before live membership: none)
    self.last_present = None if present is None else tuple(int(h) for h in present)

  def describe(self) -> dict[str, Any] | None:
    """For run.json: the rule and its decisions."""
    if not self.speed:
      return None
    return {"balance": "speed", "every": self.every,
            "decisions": [{"from_round": d.first, "steps": list(d.steps)}
                          for d in self.decisions]}


def weighted(pacer: Pacer, hook=None):
  """The pseudo-gradient hook (`modes.base.PseudoGradientHook`) that scales this host's
  Δ by `pacer.scale(round)` before a tool's `hook` sees it; None when no scaling is due
  (balance 'fixed', no hook)."""
  if not pacer.speed:
    return hook

  def scaled(deltas_R, *, round_: int, fragment: int):
    s = pacer.scale(round_)
    if s != 1:  # x · 1.0 is x: equal steps keep the unweighted bits without a pass
      deltas_R = jax.tree.map(lambda d: d * s.astype(d.dtype), deltas_R)
    return deltas_R if hook is None else hook(deltas_R, round_=round_, fragment=fragment)

  return scaled

