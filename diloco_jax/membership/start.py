"""Start-up of a job whose membership is live (train's --membership).

No `jax.distributed`: each host's JAX is a world of its own, so no host's loss can abort
another's process, and there is no shutdown barrier to wait at. The host registers with the
membership coordinator (`membership/lease.py`), opens the epoch wire's collective
(`membership/collective.py`), says so to `runtime.world`, and compares its config with every other
host's over the wire (every host sees every difference and all refuse alike).
"""

from __future__ import annotations

import ml_collections

from diloco_jax import config as config_lib
from diloco_jax.runtime import cluster
from diloco_jax.membership import lease as lease_lib
from diloco_jax.runtime import security
from diloco_jax.membership import world
from diloco_jax.membership import collective as epochs


def start(config: ml_collections.ConfigDict, spec: cluster.Cluster, membership: str,
          wire_address: str | None, min_hosts: int | None = None) -> lease_lib.Lease:
  """Registers this host at the coordinator `membership` ("host:port"), waits for
  `min_hosts` hosts (None: `spec.num_hosts`), connects them and checks their configs agree;
  or, if the job already runs, returns to join it later (`lease.joining`). Returns the
  lease (close it at the end: the others then need not wait for it to run out)."""
  c = spec.resolved()
  if c.num_hosts is None or c.host_id is None or not 0 <= c.host_id < c.num_hosts:
    raise cluster.StartupError(f"--membership needs --num_hosts and --host_id in "
                               f"[0, num_hosts) (got {c.num_hosts} and {c.host_id})")
  if min_hosts is not None and not 1 <= min_hosts <= c.num_hosts:
    raise cluster.StartupError(f"--min_hosts={min_hosts}: must be in [1, --num_hosts="
                               f"{c.num_hosts}]")
  try:
    security.check_coordinator_address(membership, c.allow_public_coordinator)
    token = security.JoinToken.from_environment(c.join_token_file)
  except security.SecurityError as e:
    raise cluster.StartupError(str(e)) from None
  wanted = ("every host" if min_hosts in (None, c.num_hosts)
            else f"{min_hosts} of the {c.num_hosts} hosts")
  print(f"host {c.host_id} of {c.num_hosts} hosts: registering with the membership "
        f"coordinator at {membership}; waiting up to {c.initialization_timeout}s for {wanted}",
        flush=True)
  lease = lease_lib.Lease.start(membership, host=c.host_id, num_hosts=c.num_hosts,
                                token=token, timeout_s=c.initialization_timeout,
                                address=wire_address, min_hosts=min_hosts)
  collective = epochs.EpochCollective(lease, token=token, timeout_s=config.elastic_timeout)
  world.set_live(lease, token, collective)
  if lease.joining:  # the job runs: its config comes with the members' state (loop/join.py)
    return lease
  collective.connect()
  cluster.check_same_config_over(collective.allgather, c.host_id, config_lib.flatten(config))
  return lease
