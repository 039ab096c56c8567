"""Which hosts are in the job: one object the round loop asks, whatever the answer.

`Live` (every DiLoCo job of several hosts): the hosts of the coordinator's current epoch
sum over the epoch wire (`membership/collective.py`), any host may die and the others redo
the op it left and train on, every host keeps its own workdir's records, and the lowest
live host prints.

`Fixed` (one host, and ddp's hosts on `jax.distributed`): the hosts share fate, the
collective covers all of them, and a hash of the outer state travels through the
coordination service.

The round loop never asks which kind it has: it calls the same methods on both.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Protocol

import jax
import ml_collections
import numpy as np
from absl import logging

from diloco_jax.runtime import coordination
from diloco_jax.membership import world as world_lib
from diloco_jax.wire import collective as collective_lib
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib
from diloco_jax.wire import integrity


class Membership(Protocol):
  """What the round loop asks about the hosts in the job.

  Attributes:
    collective: the cross-host sum and allgather (over every host, or the live ones).
    riders: what every sum of pseudo-gradients carries for it (`wire.exchange.Rider`).
  """
  collective: Any
  riders: tuple[exchange_lib.Rider, ...]

  def connect(self, dispatcher: dispatch.Dispatcher) -> None:
    """Opens the collective's connections (every host, at start-up)."""

  def hash_exchange(self, dispatcher: dispatch.Dispatcher) -> integrity.HashExchange | None:
    """How hosts compare the outer state's hash (None: one host, nothing to compare)."""

  def figures(self, riders: Mapping[str, exchange_lib.Words]) -> dict[str, Any]:
    """A round's figures from the words its sum brought back (`Arrived.riders`)."""

  def started(self) -> None:
    """Training begins (after resume, before round 1 of this process)."""

  def join_due(self) -> bool:
    """Whether the hosts admit a host waiting to join at this round's end (live only)."""

  def prints(self, host: int) -> bool:
    """Whether `host` prints the run's lines now (one host does)."""

  def writes(self, host: int) -> bool:
    """Whether `host` evaluates and writes run.json, metrics and events to its workdir."""


class Fixed:
  """Every host for the whole run; one that dies stops the job (the launcher restarts it)."""
  riders = ()

  def __init__(self):
    self.collective = collective_lib.make_collective()
    self.host, self.num_hosts = jax.process_index(), jax.process_count()

  def connect(self, dispatcher: dispatch.Dispatcher) -> None:
    # gloo's connection line is third-party noise unless --verbosity asks for it
    dispatcher.run(self.collective.connect, logging.get_verbosity() < logging.INFO,
                   what="connecting the hosts")

  def hash_exchange(self, dispatcher: dispatch.Dispatcher) -> integrity.HashExchange | None:
    if self.num_hosts == 1:
      return None
    return integrity.StoreExchange(coordination.coordination_client(), self.host,
                                   self.num_hosts)

  @staticmethod
  def figures(riders: Mapping[str, exchange_lib.Words]) -> dict[str, Any]:
    del riders  # a fixed job's sums carry nothing for it
    return {}

  def started(self) -> None:
    pass

  @staticmethod
  def join_due() -> bool:
    return False  # a fixed job admits no one while it runs

  @staticmethod
  def prints(host: int) -> bool:
    return host == 0

  @staticmethod
  def writes(host: int) -> bool:
    return host == 0


class Live:
  """Live membership (train's --membership): the hosts of the coordinator's current epoch
  (`membership/collective.py`). Any host may die, host 0 included: the survivors redo the op it
  left unfinished and train on. Every host keeps its own workdir complete (checkpoints,
  run.json, metrics, events, eval), so the run's record survives any host; the lowest
  live host prints."""

  def __init__(self, world: world_lib.World, replicas_per_host: int):
    self.collective = world.collective
    self.host = world.host
    self.riders = (LiveReplicas(replicas_per_host, lambda: world.lease.pending),)
    self._join_due = False

  def connect(self, dispatcher: dispatch.Dispatcher) -> None:
    dispatcher.run(self.collective.connect, what="connecting the hosts")

  def hash_exchange(self, dispatcher: dispatch.Dispatcher) -> integrity.HashExchange:
    return integrity.CollectiveExchange(lambda words: dispatcher.run(
        self.collective.allgather, words, what="comparing the outer state's hash"), self.host)

  def figures(self, riders: Mapping[str, exchange_lib.Words]) -> dict[str, Any]:
    """The replicas in the round's mean and the hosts of the epoch it was summed in."""
    words = riders.get(LiveReplicas.name)
    if words is None:
      return {}
    self._join_due |= bool(words["pending"])
    return {"replicas": int(words["replicas"]), "live_hosts": int(words["hosts"])}

  def join_due(self) -> bool:
    """Whether a sum since the last call said that a host waits to join: the same answer
    on every member (it comes from the sums), so all of them admit it at the same round
    boundary (`loop/join.py`)."""
    due, self._join_due = self._join_due, False
    return due

  def started(self) -> None:
    pass

  def prints(self, host: int) -> bool:
    return host == min(self.collective.live)

  @staticmethod
  def writes(host: int) -> bool:
    del host
    return True

  def close(self, leave: bool = True,
            drained: Callable[[float], bool] = lambda timeout_s: True) -> None:
    """Leaves; `drained(seconds)`: whether the dispatch thread stopped within them (the
    wire's sockets are closed only then: `EpochCollective.close`)."""
    self.collective.close(leave, drained)


class LiveReplicas:
  """Live membership's rider of every sum: each host's replicas and a 1, summed into the
  replicas the mean divides by and the hosts that took part, and whether this host has
  seen a host waiting to join (`pending`: the coordinator's last word)."""
  name, keep, divisor = "members", False, "replicas"
  part = ("replicas", "hosts")  # 0 from a host catching up after its join (loop/join.py)

  def __init__(self, replicas_per_host: int, pending: Callable[[], bool] = lambda: False):
    self.replicas_per_host, self.pending = replicas_per_host, pending

  def words(self, round_: int) -> exchange_lib.Words:
    del round_
    return {"replicas": np.float32(self.replicas_per_host), "hosts": np.float32(1),
            "pending": np.float32(self.pending())}

  def like(self) -> exchange_lib.Words:
    return {"replicas": np.float32(0), "hosts": np.float32(0), "pending": np.float32(0)}


def of(world: world_lib.World, config: ml_collections.ConfigDict) -> Membership:
  """The membership of this job's hosts: live under a lease (train's --membership), else
  fixed."""
  if world.live:
    return Live(world, config.replicas_per_host)
  return Fixed()
