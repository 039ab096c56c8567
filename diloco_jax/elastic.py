"""Experimental elasticity (config.elastic, sync mode): the job outlives a dead host.

What JAX 0.10 on CPU allows (measured; see README, "Preemption and resume"):
- With `jax_enable_recoverability`, the survivors of a dead non-coordinator host keep
  running; the coordination service drops the dead host after the heartbeat timeout, and
  a new mesh over the survivors' devices carries their sums.
- A restarted host reconnects to the coordination service but cannot join the survivors'
  collectives (gloo keys its connections by device list, with no generation). So a
  returning host only announces itself; at the next round boundary the survivors write a
  checkpoint and every host exits with EXIT_RESTART; the launcher starts the whole world
  again, which resumes from that checkpoint with the returning host's replicas restarted
  from the anchor.

`ElasticCollective` is the cross-host sum for this mode: the live hosts meet at a
coordination-service barrier before each collective, and after a failure agree on the
new set of live hosts and do it again. (`multihost_utils.live_devices` would count a
returning host as live and wait for it.) The job still dies with host 0 (the coordinator).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from diloco_jax import checkpoint
from diloco_jax import collective as collective_lib
from diloco_jax import distributed
from diloco_jax import state as state_lib

EXIT_RESTART = 75  # every host exits with this to ask the launcher for a restart
_RUNNING = "diloco/elastic/running"
_REJOIN = "diloco/elastic/rejoin/"
_RESTART = "diloco/elastic/restart"


def _client():
  return distributed.coordination_client()


def enable(collective_timeout_s: int) -> None:
  """Before jax.distributed starts: survivors outlive a dead host, and a sum waiting on a
  dead peer times out instead of hanging."""
  jax.config.update("jax_enable_recoverability", True)
  flag = f"--xla_cpu_collective_timeout_seconds={collective_timeout_s}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  # Orbax's barriers (coordination service) otherwise wait 300 s for a dead host.
  checkpoint.set_barrier_timeout(collective_timeout_s)


def mark_running() -> None:
  """Host 0, once training starts: a host that connects later is a returning one."""
  _client().key_value_set(_RUNNING, "1")


def is_returning() -> bool:
  try:
    return _client().key_value_try_get(_RUNNING) == "1"
  except Exception:  # noqa: BLE001 -- not found
    return False


def return_and_wait(timeout_s: int = 24 * 3600) -> None:
  """A returning host: asks to join and waits for the survivors' restart signal."""
  host = jax.process_index()
  print(f"host {host}: the job is running without this host; asking to rejoin. The "
        f"hosts will checkpoint at the next round boundary and restart together.",
        flush=True)
  _client().key_value_set(f"{_REJOIN}{host}", "1")
  # The survivors ask the coordination service who is alive before every collective, a
  # call that waits for every alive host, this one included: keep answering it.
  threading.Thread(target=_answer_liveness_checks, daemon=True).start()
  _client().blocking_key_value_get(_RESTART, timeout_s * 1000)


def _answer_liveness_checks() -> None:
  hosts = list(range(jax.process_count()))
  while True:
    try:
      _client().get_live_nodes(hosts)
    except Exception:  # noqa: BLE001 -- the job is restarting
      time.sleep(0.1)


def rejoin_requested() -> list[int]:
  """Host 0: returning hosts waiting to join."""
  return sorted(int(k.rsplit("/", 1)[1]) for k, _ in _client().key_value_dir_get(_REJOIN))


def signal_restart() -> None:
  _client().key_value_set(_RESTART, "1")


def rejoin(outer_step, snap, init_replicas, data, inner_steps: int):
  """A host back after the others trained without it, resuming from a checkpoint that has
  no row of its own: the shared outer state, its replicas from the anchor with fresh AdamW
  moments (the step count, which drives the lr schedule, set to the run's), and its data
  iterators where host 0's are (every replica has read the same number of batches of its
  own shard). Returns the outer step's carry and the replicas."""
  outer = outer_step.join(snap.shared, None)
  replicas = init_replicas(outer_step.model(outer, None))
  step = snap.round * inner_steps
  replicas = replicas.replace(opt_state=state_lib.with_step_count(replicas.opt_state, step))
  data.set_state(snap.meta["data_state"])
  print(f"host {jax.process_index()}: rejoining at round {snap.round + 1}: replicas from the "
        f"anchor with fresh optimizer moments (step {step})", flush=True)
  return outer, replicas


def finish() -> None:
  """The end of an elastic run. Under recoverability JAX's shutdown no longer waits for
  everyone, and a host that leaves first can abort the others: the live hosts meet at a
  barrier, then exit (host 0, which runs the coordination service, last)."""
  client, host = _client(), jax.process_index()
  live = sorted(client.get_live_nodes(list(range(jax.process_count()))))
  client.wait_at_barrier("diloco/elastic/end", 600_000, live)
  if host == 0:
    deadline = time.monotonic() + 10
    while len(client.get_live_nodes(live)) > 1 and time.monotonic() < deadline:
      time.sleep(0.05)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


class ElasticCollective(collective_lib.HostCollective):
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
        _client().wait_at_barrier(f"diloco/elastic/g{self._generation}/op{self._ops}",
                                  self.timeout_s * 1000, self.live)
        return op()
      except Exception as e:  # noqa: BLE001 -- a peer is gone or late: look again
        if time.monotonic() > deadline:
          raise RuntimeError(f"elastic: the hosts {self.live} could not complete a "
                             f"collective within {20 * self.timeout_s}s") from e
        sys.stderr.write(f"host {self.host_index}: collective failed ({type(e).__name__}: "
                         f"{str(e)[:160]}); checking which hosts are live\n")
        time.sleep(1.0)

  def _regroup(self, live: list[int]) -> None:
    """Moves to `live` once every host in it sees the same set (else the barrier, whose
    name holds the set, times out and the caller looks again)."""
    if 0 not in live:
      raise RuntimeError("elastic: host 0 (the coordinator) is gone")
    key = "-".join(map(str, live))
    _client().wait_at_barrier(f"diloco/elastic/g{self._generation}/regroup{key}",
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
    return self._run(lambda: super(ElasticCollective, self).sum(tree))

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[live hosts, *x.shape], in host order."""
    return self._run(lambda: super(ElasticCollective, self).allgather(x))
