"""Cross-host sums over the hosts still alive: after a host is lost, the others regroup and
sum among themselves (`loop.membership` uses it for a job that outlives a host)."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from jax.sharding import Mesh

from diloco_jax.runtime import coordination
from diloco_jax.wire import collective as collective_lib


def _client():
  return coordination.coordination_client()


class LiveCollective(collective_lib.HostCollective):
  """`HostCollective` over the hosts still alive. `num_hosts` stays the world's size
  (replica flags keep their places); `live` lists the hosts summed over."""

  def __init__(self, timeout_s: int):
    super().__init__()
    self.timeout_s = timeout_s
    self._first_cpu = list(self.mesh.devices.flat)
    self.live = list(range(self.num_hosts))
    # Each host's incarnation at the start: a host that comes back has another one, and
    # does not count as live (it waits for the coordinated restart instead).
    self._incarnations = _client().get_live_nodes(self.live)
    self._generation = 0  # regroupings so far
    self._ops = 0  # collectives in this generation: names their barriers alike everywhere

  def _live_now(self) -> list[int]:
    """The hosts of the current group that the coordination service still sees, in the
    incarnation they started with (it drops a dead one after the heartbeat timeout)."""
    nodes = _client().get_live_nodes(list(range(self.num_hosts)))
    return [h for h in self.live if nodes.get(h) == self._incarnations.get(h)]

  def _run(self, op):
    """op() on the live hosts. First every live host meets at a barrier (coordination
    service), so that gloo's timeout covers the transfer alone; after a failure the
    survivors agree on who is left and do it again without the dead.

    The price of not wrapping each sum in a transaction: a host that dies exactly as a sum
    completes could leave one survivor a round ahead of another (debug_checks would see
    the outer states differ)."""
    deadline = time.monotonic() + 20 * self.timeout_s
    while True:
      try:
        live = self._live_now()
        if live != self.live:
          self._regroup(live)
        self._ops += 1
        _client().wait_at_barrier(f"diloco/live/g{self._generation}/op{self._ops}",
                                  self.timeout_s * 1000, self.live)
        return op()
      except Exception as e:  # noqa: BLE001 -- a peer is gone or late: look again
        if time.monotonic() > deadline:
          raise RuntimeError(f"live hosts: the hosts {self.live} could not complete a "
                             f"collective within {20 * self.timeout_s}s") from e
        sys.stderr.write(f"host {self.host_index}: collective failed ({type(e).__name__}: "
                         f"{str(e)[:160]}); checking which hosts are live\n")
        time.sleep(1.0)

  def _regroup(self, live: list[int]) -> None:
    """Moves to `live` once every host in it sees the same set (else the barrier, whose
    name holds the set, times out and the caller looks again)."""
    if 0 not in live:
      raise RuntimeError("live hosts: host 0 (the coordinator) is gone")
    key = "-".join(map(str, live))
    _client().wait_at_barrier(f"diloco/live/g{self._generation}/regroup{key}",
                              self.timeout_s * 1000, live)
    lost = sorted(set(self.live) - set(live))
    if self.host_index == 0:
      print(f"WARNING: host(s) {lost} stopped; continuing with hosts {live}",
            file=sys.stderr, flush=True)
    self._generation += 1
    self._ops = 0
    self.live = live
    self._use(Mesh(np.array([self._first_cpu[h] for h in live]), (collective_lib.HOSTS_AXIS,)))

  def sum(self, tree: Any) -> Any:
    return self._run(lambda: super(LiveCollective, self).sum(tree))

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[live hosts, *x.shape], in host order."""
    return self._run(lambda: super(LiveCollective, self).allgather(x))
