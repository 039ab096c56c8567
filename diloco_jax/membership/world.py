"""Which host this process is, among how many, and with whom it sums: a value.

The entry point builds it (`membership.start.start`) and hands it down (`loop.parts.Parts`);
no module keeps it. A single host, and a `ddp` job on `jax.distributed`, are *fixed*: the
hosts are `jax.process_index()` of `jax.process_count()` for the whole run. Every
multi-host DiLoCo job is *live*: each host's JAX is a world of its own (so that no host's
loss can end another's process), the host id and the job's host count come from the lease
at the membership coordinator (`membership/lease.py`), and the sums run over the epoch
wire (`membership/collective.py`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from diloco_jax.membership import collective as collective_lib
  from diloco_jax.membership import coordinator as coordinator_lib
  from diloco_jax.membership import lease as lease_lib
  from diloco_jax.membership import programs as programs_lib
  from diloco_jax.runtime import security


@dataclasses.dataclass(frozen=True)
class World:
  """Attributes:
    host, num_hosts: this host's id and the job's host count (live: its ids go up to
      num_hosts - 1, whether or not each is present).
    lease: live membership: this host's lease at the coordinator (None: fixed).
    token: the join token that keys the wire's frames (None: unauthenticated).
    collective: live membership: the sums among the epoch's members.
    coordinator: the membership coordinator this process serves (host 0 of a job started
      with --coordinator_address), else None.
    programs: live, with the compilation cache on: where this host serves its compiled
      programs to joiners (membership/programs.py).
  """
  host: int
  num_hosts: int
  lease: lease_lib.Lease | None = None
  token: security.JoinToken | None = None
  collective: collective_lib.EpochCollective | None = None
  coordinator: coordinator_lib.Serving | None = None
  programs: programs_lib.Offer | None = None

  @property
  def live(self) -> bool:
    return self.lease is not None

  @property
  def joining(self) -> bool:
    """A live host that found the job running: it joins at a round boundary."""
    return self.lease is not None and self.lease.joining

  @classmethod
  def fixed(cls) -> World:
    """The hosts of `jax.distributed` (one, unless it was started): a single host, or
    `ddp`'s job."""
    import jax  # pylint: disable=import-outside-toplevel
    return cls(jax.process_index(), jax.process_count())
