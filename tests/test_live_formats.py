"""Every wire format and rule while the replicas in a sum change (docs/algorithms.md, "K
per round"), against independent float64 numpy implementations written here.

Four hosts of one replica each run `wire.exchange.Exchange` over the epoch wire in one
process (a membership coordinator in a thread, each host a thread with its lease, epoch
collective and dispatch thread): hosts 0-3 sum rounds 1-2, host 3 then leaves and hosts
0-2 sum rounds 3-4, and host 3, started again (a new incarnation with nothing of the old
one), joins at the boundary after round 4, catches up in round 5 (it sends its Δ, which
the exchange replaces by zeros that no mean counts: `Exchange.idle`), and all four sum
rounds 6-7. K goes 4 -> 3 -> 4. Each round replica h sends `wire_deltas(h, 0, round)`;
every host's means must be the same bits, and equal numpy's:
- int8 with error feedback: each host's accumulator e_h <- e_h + Δ_h sends Q(e_h) (256-entry
  blocks, absmax scale), the chunk owners sum the decoded rows and send the sum encoded
  again; Δ̄ = Q(Σ_h Q(e_h)) / K_r, and the joiner's accumulator starts at 0 (and stays 0
  through its catch-up round);
- SparseLoCo (chunk top-k, 2-bit values, e_h <- β e_h + Δ_h): Δ̄ = Σ_h Q(e_h) / K_r;
- the trimmed mean with trim 0.25: 4 replicas trim one from each end; 3 are too few for
  it, so those rounds take the mean (and the printing host says so, once a round), the
  catch-up round too: the joiner's rows are left out.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.algo import state as state_lib
from diloco_jax.membership import manager as membership
from diloco_jax.modes import skips
from diloco_jax.membership import coordinator
from diloco_jax.membership import lease as lease_lib
from diloco_jax.wire import dispatch
from diloco_jax.membership import collective as epochs
from diloco_jax.wire import exchange
from tests import multihost
from tests.test_sparseloco import BETA
from tests.test_sparseloco import OUTER as SPARSELOCO
from tests.test_sparseloco import np_chunk_topk_2bit
from tests.wire_main import wire_deltas

pytestmark = pytest.mark.multihost  # hosts on the epoch wire (threads of this process)

SIZE, ROUNDS = 1000, 7
PRESENT = [(0, 1, 2, 3)] * 2 + [(0, 1, 2)] * 3 + [(0, 1, 2, 3)] * 2  # hosts in each mean
LEAVES_AFTER, JOINS_AFTER = 2, 4  # host 3
CATCHES_UP = JOINS_AFTER + 1  # the joiner's round without a part in the mean
FORMATS = {
    "int8": {"compression": "int8", "error_feedback": True},
    "sparseloco": SPARSELOCO,
    "trimmed_mean": {"aggregation": "trimmed_mean", "trim": 0.25},
}


def np_int8(x: np.ndarray) -> np.ndarray:
  """Blocks of 256 entries from the start (the last zero-padded), each scaled by
  max|x| / 127 and rounded to the nearest integer (halves to even)."""
  padded = np.concatenate([x, np.zeros(-x.size % 256)]).reshape(-1, 256)
  scale = np.abs(padded).max(axis=1, keepdims=True) / 127
  q = np.rint(padded / np.where(scale > 0, scale, 1))
  return (q * scale).ravel()[:x.size]


def np_trimmed_mean(rows: np.ndarray, trim: float) -> np.ndarray:
  k, t = len(rows), int(np.floor(trim * len(rows)))
  if t < 1 or 2 * t >= k:  # too few replicas for the trim: the mean
    return rows.mean(axis=0)
  return np.sort(rows, axis=0)[t:k - t].mean(axis=0)


def np_means(fmt: str) -> tuple[np.ndarray, dict[int, np.ndarray]]:
  """Δ̄ of every round and each host's last error-feedback accumulator, in float64."""
  e = {h: np.zeros(SIZE) for h in range(4)}
  means = []
  for t, present in enumerate(PRESENT, start=1):
    if t == JOINS_AFTER + 1:
      e[3] = np.zeros(SIZE)  # the joiner's own, from zero
    deltas = {h: wire_deltas(h, 0, t, SIZE).astype(np.float64) for h in present}
    if fmt == "trimmed_mean":
      means.append(np_trimmed_mean(np.stack([deltas[h] for h in present]), 0.25))
      continue
    sent = []
    for h in present:
      e[h] = (BETA * e[h] if fmt == "sparseloco" else e[h]) + deltas[h]
      sent.append(np_chunk_topk_2bit(e[h]) if fmt == "sparseloco" else np_int8(e[h]))
      e[h] = e[h] - sent[-1]
    total = sum(sent)
    means.append((total if fmt == "sparseloco" else np_int8(total)) / len(present))
  return np.stack(means), e


@contextlib.contextmanager
def membership_coordinator(max_hosts: int):
  """A membership coordinator in a thread of this process; yields its address."""
  stop = threading.Event()
  for _ in range(3):  # a port free a moment ago may be taken by the time it binds
    port = multihost.free_port()
    failed = []
    thread = threading.Thread(target=lambda: _serve(port, max_hosts, stop, failed),
                              daemon=True)
    thread.start()
    time.sleep(0.2)
    if not failed:
      break
  try:
    yield f"127.0.0.1:{port}"
  finally:
    stop.set()
    thread.join(10)


def _serve(port, max_hosts, stop, failed):
  try:
    coordinator.serve(port, max_hosts, 1.0, coordinator.key_for(None), stop=stop,
                      log=lambda line: None)
  except coordinator.CoordinatorError as e:
    failed.append(e)


class Host:
  """One host's lease, epoch collective and exchange (one replica)."""

  def __init__(self, address: str, host: int, outer):
    self.lease = lease_lib.Lease.start(address, host=host, num_hosts=4, token=None,
                                       timeout_s=30)
    self.collective = epochs.EpochCollective(self.lease, timeout_s=30, log=lambda line: None)
    self.dispatcher = dispatch.Dispatcher()
    self.exchange = exchange.Exchange(
        outer, collective=self.collective, dispatcher=self.dispatcher, replicas_per_host=1,
        riders=(membership.LiveReplicas(1, lambda: self.lease.pending),))
    self.residual = self.exchange.init_residuals({0: SIZE}).get(0)
    self.means, self.arrived = {}, {}

  def round(self, t: int) -> None:
    deltas = {"w": wire_deltas(self.collective.host_index, 0, t, SIZE)[None]}
    pending = self.exchange.submit(deltas, np.float32(0), np.ones(1, bool), round_=t,
                                   residual=self.residual)
    arrived = self.exchange.wait(pending, diagnostics=False)
    self.residual = arrived.residual
    self.means[t], self.arrived[t] = np.asarray(arrived.mean["w"]), arrived

  def boundary(self) -> tuple[int, ...]:
    """The end of a round at which a host waiting to join is admitted."""
    deadline = time.monotonic() + 30
    while not self.lease.pending:  # every member learns of it from the coordinator
      assert time.monotonic() < deadline, "no host waiting to join"
      time.sleep(0.02)
    return self.dispatcher.run(self.collective.boundary, what="a round boundary")

  def close(self, leave: bool = True) -> None:
    self.dispatcher.close()
    self.collective.close(leave)


def run_hosts(outer) -> dict[str, dict]:
  """The scenario of the module docstring; per host incarnation ('0'..'3', '3 again'), its
  means and `Arrived` by round and its last residual."""
  results, errors = {}, []
  with membership_coordinator(4) as address:
    started = threading.Barrier(4)
    left = threading.Event()

    def member(h: int) -> None:
      host = Host(address, h, outer)
      started.wait()
      try:
        for t in range(1, ROUNDS + 1):
          if h == 3 and t == LEAVES_AFTER + 1:
            host.close()
            left.set()
            break
          host.round(t)
          if t == JOINS_AFTER:
            assert host.boundary() == (3,)
            host.exchange.idle(CATCHES_UP, (3,))
      finally:
        results[str(h)] = host
        if not (h == 3 and left.is_set()):
          host.close()

    def joiner() -> None:
      left.wait(60)
      host = Host(address, 3, outer)
      assert host.lease.joining
      host.lease.join()
      host.collective.admitted()
      host.exchange.idle(CATCHES_UP, (3,))
      for t in range(JOINS_AFTER + 1, ROUNDS + 1):
        host.round(t)
      results["3 again"] = host
      host.close()

    def guarded(fn, *args):
      try:
        fn(*args)
      except BaseException as e:  # noqa: BLE001 -- reported by the test
        errors.append(e)

    threads = [threading.Thread(target=guarded, args=(member, h)) for h in range(4)]
    threads.append(threading.Thread(target=guarded, args=(joiner,)))
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(120)
  assert not errors, errors
  return results


@pytest.fixture(scope="module", params=sorted(FORMATS))
def formats_run(request):
  outer = config_lib.get_default_config().outer
  outer.update(FORMATS[request.param])
  return request.param, run_hosts(outer)


def test_means_over_the_replicas_present_equal_numpy(formats_run):
  fmt, hosts = formats_run
  want, accumulators = np_means(fmt)
  for t, present in enumerate(PRESENT, start=1):
    got = [hosts[h].means[t] for h in hosts if t in hosts[h].means]
    assert len(got) == len(present) + (t == CATCHES_UP), (t, sorted(hosts))
    for other in got[1:]:  # every host holds the same mean, bit for bit
      np.testing.assert_array_equal(other, got[0])
    # float32 against float64: the same entries kept and the same levels chosen
    np.testing.assert_allclose(got[0], want[t - 1], rtol=2e-5, atol=1e-5, err_msg=f"round {t}")
    arrived = hosts["0"].arrived[t]
    assert arrived.replicas == len(present)
    want_rule = "mean" if fmt != "trimmed_mean" or len(present) < 4 else "trimmed_mean"
    assert arrived.aggregation == want_rule, t
  if fmt != "trimmed_mean":  # each host's own error feedback; the joiner's from zero
    for name, h in (("0", 0), ("1", 1), ("2", 2), ("3 again", 3)):
      np.testing.assert_allclose(hosts[name].residual[0], accumulators[h], rtol=2e-5,
                                 atol=1e-5, err_msg=name)


def test_a_round_too_few_for_the_trim_says_so_once_and_leaves_no_replica_out(capsys):
  """The arrival of a sum whose replicas were too few for the trimmed mean: the printing
  host says so in one line, and a non-finite Δ in it skips the outer step (the mean it
  fell back to leaves nothing out); the other hosts say nothing."""
  arrived = exchange.Arrived(5, 0, {}, np.array([False, True, False]), 0.0, None, 0.0, 0,
                             0, replicas=3, aggregation="mean", tolerated=0)
  for prints in (True, False):
    _, synced = skips.decide(state_lib.SkipCounters.of(0, 0), arrived, replicas_per_host=1,
                             max_skipped_rounds=3, aggregation="trimmed_mean", prints=prints)
    assert not synced.applied
  lines = capsys.readouterr().out.splitlines()
  assert lines == ["WARNING: round 5: 3 replicas in the sum are too few for trimmed_mean: "
                   "their mean instead",
                   "WARNING: round 5: NaN or Inf in the pseudo-gradient of host 1 replica 0; "
                   "outer step skipped on every host (1 in a row)"]
