"""Resuming in another world than the one that checkpointed: more or fewer hosts, or hosts
that lost their own state.

The anchor and the outer optimizer state are the same on every host, so any host that
holds them (or receives them, checkpoints/recovery.py) can continue the run. What belongs to
one host does not carry over to another:

  - a host with a row of its own in the checkpoint keeps its replicas, their AdamW state
    and, unless the host count changed, its data iterators;
  - a host without one (new, wiped, or beyond the hosts that wrote it) starts its replicas
    from the anchor with fresh AdamW moments at the run's step (`loop.state.restore`);
  - a sum in flight in the checkpoint (async modes) is dropped on every host: the hosts
    without a row have no part in it, and a sum must have every host's part;
  - when the number of hosts changes, the data is cut anew into K' = hosts x
    replicas_per_host shards (replica g reads every K'-th sequence of the data's order from
    g, data/pipeline.py) and every replica starts a new pass over its shard. Within a pass
    the shards are disjoint, so no two replicas read the same sequence; what the old pass
    had not reached yet is not read before the new pass reaches it.

Modes whose outer state is partly per replica (eager) or whose model lives only in the
replicas (ddp) cannot start a replica without a row: their drivers say so
(`needs_own_rows`), and they are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diloco_jax.checkpoints import store
from diloco_jax.modes import registry


@dataclasses.dataclass(frozen=True)
class Change:
  """How the hosts resuming differ from those that wrote the checkpoint.

  Attributes: saved_hosts, the hosts that wrote the checkpoint; hosts, this run's;
  missing, this run's hosts without a row of their own (the same on every host)."""
  saved_hosts: int
  hosts: int
  missing: tuple[int, ...]

  @classmethod
  def of(cls, snap: store.Snapshot, hosts: int) -> Change:
    return cls(int(snap.meta["num_hosts"]), hosts, tuple(snap.missing))

  @property
  def changed(self) -> bool:
    return self.saved_hosts != self.hosts

  @property
  def partial(self) -> bool:
    """Some host resumes without its own row, or some row's host is gone."""
    return self.changed or bool(self.missing)

  def describe(self) -> dict[str, Any]:
    return {"checkpoint_hosts": self.saved_hosts, "hosts": self.hosts,
            "hosts_from_anchor": list(self.missing)}

  def message(self, r: int, *, replicas_per_host: int, inflight: bool) -> str:
    """Host 0's line saying what the resume changed."""
    keep = [h for h in range(self.hosts) if h not in self.missing]
    parts = []
    if self.changed:
      parts.append(f"checkpoint {r} was written by {self.saved_hosts} host(s), this run has "
                   f"{self.hosts}: the data is cut into {self.hosts * replicas_per_host} "
                   f"shards and every replica starts a new pass over its shard")
    if self.missing:
      parts.append(f"host(s) {list(self.missing)} start their replicas from the anchor")
    if keep:
      parts.append(f"host(s) {keep} keep their replicas")
    if inflight:
      parts.append(f"the sum in flight at round {r} is dropped (not every host has its part)")
    return "resuming with changes: " + "; ".join(parts)


def check_mode(change: Change, mode: str, where: str) -> None:
  """A CheckpointError if `change` leaves a replica without its row and `mode`'s replicas
  cannot start from the anchor."""
  needs_own_rows = registry.driver(mode).needs_own_rows
  if change.partial and needs_own_rows:
    who = (f"host(s) {list(change.missing)} have no row of their own in it" if change.missing
           else f"it was written by {change.saved_hosts} host(s), this run has {change.hosts}")
    raise store.CheckpointError(
        f"{where}: {who}, and mode {mode!r} {needs_own_rows.why}, so those replicas "
        f"cannot start from the anchor. Resume with the hosts and disks that wrote it. "
        f"Nothing was changed")


def without_inflight(own: dict | None) -> dict | None:
  """`own` without its sum in flight (module docstring)."""
  return None if own is None else {k: v for k, v in own.items() if k != "inflight"}
