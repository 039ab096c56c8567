"""Start-up of a job whose membership is live (train's --membership).

No `jax.distributed`: each host's JAX is a world of its own, so no host's loss can abort
another's process, and there is no shutdown barrier to wait at. The host registers with the
membership coordinator (`runtime/lease.py`), opens the epoch wire's collective
(`wire/epochs.py`), says so to `runtime.world`, and compares its config with every other
host's over the wire (every host sees every difference and all refuse alike).
"""

from __future__ import annotations

import ml_collections

from diloco_jax import config as config_lib
from diloco_jax.runtime import cluster
from diloco_jax.runtime import lease as lease_lib
from diloco_jax.runtime import security
from diloco_jax.runtime import world
from diloco_jax.wire import epochs


def start(config: ml_collections.ConfigDict, spec: cluster.Cluster, membership: str,
          wire_address: str | None) -> lease_lib.Lease:
  """Registers this host at the coordinator `membership` ("host:port"), waits for
  `spec.num_hosts` hosts, connects them and checks their configs agree. Returns the lease
  (close it at the end: the others then need not wait for it to run out)."""
  c = spec.resolved()
  if c.num_hosts is None or c.host_id is None or not 0 <= c.host_id < c.num_hosts:
    raise cluster.StartupError(f"--membership needs --num_hosts and --host_id in "
                               f"[0, num_hosts) (got {c.num_hosts} and {c.host_id})")
  try:
    security.check_coordinator_address(membership, c.allow_public_coordinator)
    token = security.JoinToken.from_environment(c.join_token_file)
  except security.SecurityError as e:
    raise cluster.StartupError(str(e)) from None
  print(f"host {c.host_id} of {c.num_hosts} hosts: registering with the membership "
        f"coordinator at {membership}; waiting up to {c.initialization_timeout}s for every "
        "host", flush=True)
  lease = lease_lib.Lease.start(membership, host=c.host_id, num_hosts=c.num_hosts,
                                token=token, timeout_s=c.initialization_timeout,
                                address=wire_address)
  collective = epochs.EpochCollective(lease, token=token, timeout_s=config.elastic_timeout)
  world.set_live(lease, token, collective)
  if lease.joining:  # the job runs: its config comes with the members' state (loop/join.py)
    return lease
  collective.connect()
  cluster.check_same_config_over(collective.allgather, c.host_id, config_lib.flatten(config))
  return lease
