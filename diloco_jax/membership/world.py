"""Which host this process is, among how many: `jax.distributed`'s answer, or a live lease's.

A job of fixed membership runs in one `jax.distributed` world, and `jax.process_index()` says
which host this is. A live job (train's --membership) does not: each host's JAX is a world of
its own (so that no host's loss can end another's process), and the host id and the job's
host count come from the lease at the coordinator (`membership/lease.py`). Code that needs to
know which host it runs on asks `current()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diloco_jax.membership import lease as lease_lib
from diloco_jax.runtime import security


@dataclasses.dataclass(frozen=True)
class World:
  host: int
  num_hosts: int
  lease: lease_lib.Lease | None = None  # live membership: this host's lease
  token: security.JoinToken | None = None  # live membership: the key of the wire's frames
  collective: Any = None  # live membership: the sums among the epoch's hosts (wire/epochs)

  @property
  def live(self) -> bool:
    return self.lease is not None

  @property
  def joining(self) -> bool:
    """A live host that found the job running: it joins at a round boundary."""
    return self.lease is not None and self.lease.joining


_LIVE: World | None = None


def set_live(lease: lease_lib.Lease, token: security.JoinToken | None,
             collective: Any) -> World:
  """From now on this process is host `lease.host` of a live job of `lease.num_hosts`."""
  global _LIVE
  _LIVE = World(lease.host, lease.num_hosts, lease, token, collective)
  return _LIVE


def clear() -> None:
  global _LIVE
  _LIVE = None


def current() -> World:
  if _LIVE is not None:
    return _LIVE
  import jax  # pylint: disable=import-outside-toplevel
  return World(jax.process_index(), jax.process_count())
