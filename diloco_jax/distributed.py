"""Start-up across hosts: `jax.distributed`, from flags, environment or a cluster manager.

Resolution order for each of coordinator address, number of hosts and host id: the
explicit argument (a `--flag` of `train.py`), then `DILOCO_COORDINATOR_ADDRESS`,
`DILOCO_NUM_HOSTS`, `DILOCO_HOST_ID`, then JAX's own cluster auto-detection (SLURM, Open
MPI, Kubernetes, TPU pods). With none of these, the run is a single host and nothing is
initialised.

After start-up every host publishes its resolved config (and package and jax versions)
in the coordination service's key-value store and compares it with every other host's;
a difference stops every host with an error listing the differing fields. The store is
gRPC, not a collective, so this needs no dispatcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Any

import jax
import ml_collections
from jax.experimental import multihost_utils

import diloco_jax
from diloco_jax import config as config_lib

_ENV = {"coordinator_address": "DILOCO_COORDINATOR_ADDRESS", "num_hosts": "DILOCO_NUM_HOSTS",
        "host_id": "DILOCO_HOST_ID"}


class StartupError(RuntimeError):
  """The hosts could not form a job (a peer missing, mismatched configs, bad flags)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Attributes: coordinator_address ('host:port', None for one host); num_hosts; host_id;
  initialization_timeout and heartbeat_timeout in seconds."""
  coordinator_address: str | None = None
  num_hosts: int | None = None
  host_id: int | None = None
  initialization_timeout: int = 300
  heartbeat_timeout: int = 100

  def resolved(self) -> Cluster:
    """Fills unset fields from DILOCO_* environment variables."""
    values = {}
    for field, env in _ENV.items():
      value = getattr(self, field)
      if value is None and os.environ.get(env):
        raw = os.environ[env]
        try:
          value = raw if field == "coordinator_address" else int(raw)
        except ValueError:
          raise StartupError(f"{env}={raw!r}: must be an integer") from None
      values[field] = value
    return dataclasses.replace(self, **values)


# The two private JAX APIs the project reaches, each behind one shim.


def coordination_client():
  """The coordination service's client of this process (key-value store, barriers, live
  hosts). Private: JAX has no public handle on it; `jax.distributed` would need to expose
  its client (or a key-value/barrier API) to replace this."""
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client


def _cluster_detected() -> bool:
  """Whether JAX's own cluster detectors (SLURM, Open MPI, Kubernetes, TPU) find one.
  Private: `jax.distributed.initialize()` runs them but does not say whether any matched;
  a public `jax.distributed.detect_cluster()` would replace this."""
  from jax._src import clusters
  return any(not env.opt_in_only_method and env.is_env_present()
             for env in clusters.ClusterEnv._cluster_types)


def initialize(cluster: Cluster) -> bool:
  """Starts `jax.distributed` unless this is a single host; True if it did.

  Must run before anything touches a jax backend.
  """
  c = cluster.resolved()
  explicit = (c.coordinator_address, c.num_hosts, c.host_id)
  if c.num_hosts == 1 or (all(v is None for v in explicit) and not _cluster_detected()):
    return False
  if c.num_hosts is not None and c.num_hosts < 1:
    raise StartupError(f"--num_hosts={c.num_hosts}: must be >= 1")
  if c.host_id is not None and c.num_hosts is not None and not 0 <= c.host_id < c.num_hosts:
    raise StartupError(f"--host_id={c.host_id}: must be in [0, --num_hosts={c.num_hosts})")
  for name, value in (("initialization_timeout", c.initialization_timeout),
                      ("heartbeat_timeout", c.heartbeat_timeout)):
    if value < 1:
      raise StartupError(f"--{name}={value}: must be >= 1 second")
  # Cross-host sums run on the CPU backend (gloo over TCP) on every kind of host.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = (f"host {c.host_id if c.host_id is not None else '?'} of "
           f"{c.num_hosts if c.num_hosts is not None else '?'} hosts")
  print(f"{where}: joining the job at coordinator {c.coordinator_address or '(auto-detected)'}; "
        f"waiting up to {c.initialization_timeout}s for every host", flush=True)
  # When a host never joins, JAX aborts the process from C++ at the deadline with a
  # generic message; this watchdog says what happened first, and exits non-zero itself.
  watchdog = threading.Timer(c.initialization_timeout, _missing_hosts, args=(where, c))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=c.coordinator_address, num_processes=c.num_hosts,
        process_id=c.host_id, initialization_timeout=c.initialization_timeout,
        heartbeat_timeout_seconds=c.heartbeat_timeout,
        # A clean exit waits this long for the other hosts at the shutdown barrier.
        shutdown_timeout_seconds=c.heartbeat_timeout)
  except Exception as e:  # noqa: BLE001 -- XLA raises several types here.
    raise StartupError(
        f"host {c.host_id} of {c.num_hosts}: could not join the job at coordinator "
        f"{c.coordinator_address} within --initialization_timeout={c.initialization_timeout}s "
        f"(did every host start, with the same --num_hosts and coordinator address, and is "
        f"the coordinator's port open?): {type(e).__name__}: {e}") from None
  finally:
    watchdog.cancel()
  return True


def _missing_hosts(where: str, c: Cluster) -> None:
  sys.stderr.write(
      f"Start-up failed: {where}: not every host joined the job at coordinator "
      f"{c.coordinator_address} within --initialization_timeout={c.initialization_timeout}s. "
      "Did every host start, with the same --num_hosts and coordinator address, and is the "
      "coordinator's port open? Stopping this host.\n")
  sys.stderr.flush()
  os._exit(1)


def describe(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What every host must agree on: the flattened config and the software versions."""
  return {"diloco_jax": diloco_jax.__version__, "jax": jax.__version__,
          **config_lib.flatten(config)}


def differing_fields(described: list[dict[str, Any]]) -> dict[str, list[Any]]:
  """field -> [value on host 0, host 1, ...] for every field that is not the same on all."""
  fields = sorted(set().union(*described))
  return {f: [d.get(f, "<missing>") for d in described] for f in fields
          if len({json.dumps(d.get(f, "<missing>"), default=str) for d in described}) > 1}


def check_same_config(config: ml_collections.ConfigDict, timeout_s: int) -> None:
  """Stops every host with a StartupError if any two hosts resolved different configs."""
  if jax.process_count() == 1:
    return
  client = coordination_client()
  me, n = jax.process_index(), jax.process_count()
  client.key_value_set(f"diloco_jax/config/{me}", json.dumps(describe(config), default=str))
  try:
    described = [json.loads(client.blocking_key_value_get(f"diloco_jax/config/{h}",
                                                          timeout_s * 1000)) for h in range(n)]
  except Exception as e:  # noqa: BLE001
    raise StartupError(f"host {me}: did not get every host's config within {timeout_s}s: "
                       f"{e}") from None
  # Nobody leaves (and takes the coordination service down) before everyone has read.
  client.wait_at_barrier("diloco_jax/config_compared", timeout_s * 1000)
  diff = differing_fields(described)
  if diff:
    lines = [f"  {f}: " + ", ".join(f"host {h}={v!r}" for h, v in enumerate(values))
             for f, values in diff.items()]
    raise StartupError(f"host {me}: the hosts' configs differ in {len(diff)} field(s); "
                       "every host must run the same config and version:\n" + "\n".join(lines))


class Preemption:
  """Whether any host got a preemption notice (SIGTERM); the run then stops after the
  round with a checkpoint. Several hosts: JAX's preemption notifier (on by default)
  turns SIGTERM into a sync point that every host reaches at the same round, through the
  coordination service. One host: a SIGTERM handler installed for the run."""

  def __init__(self):
    self._requested = threading.Event()

  def request(self) -> None:
    self._requested.set()

  def reached(self, r: int) -> bool:
    """Whether to stop after round r: the same answer on every host."""
    if jax.process_count() == 1:
      return self._requested.is_set()
    try:
      return multihost_utils.reached_preemption_sync_point(r)
    except RuntimeError:  # the preemption service is off
      return False

  @contextlib.contextmanager
  def on_sigterm(self):
    """One host, on the main thread: SIGTERM requests a stop for as long as this lasts."""
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
      yield
      return
    previous = signal.signal(signal.SIGTERM, lambda *_: self.request())
    try:
      yield
    finally:
      signal.signal(signal.SIGTERM, previous)
