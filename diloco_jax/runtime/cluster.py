"""Start-up across hosts: which hosts, from flags, environment or a cluster manager, and
`jax.distributed` for the jobs that run on it (`ddp`; membership/start.py decides).

Resolution order for each of coordinator address, number of hosts and host id: the
explicit argument (a `--flag` of `train.py`), then `DILOCO_COORDINATOR_ADDRESS`,
`DILOCO_NUM_HOSTS`, `DILOCO_HOST_ID`, then JAX's own cluster auto-detection (SLURM, Open
MPI, Kubernetes, TPU pods). With none of these, the run is a single host and nothing is
initialised.

After start-up every host publishes its resolved config (and package and jax versions)
in the coordination service's key-value store and compares it with every other host's;
a difference stops every host with an error listing the differing fields. The store is
gRPC, not a collective, so this needs no dispatcher. Before that, `security` refuses a
public coordinator address (unless allowed) and checks the hosts' join token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import jax

from diloco_jax import errors
from diloco_jax._version import __version__
from diloco_jax.runtime import coordination
from diloco_jax.runtime import security
from diloco_jax.runtime import watchdog

_ENV = {"coordinator_address": "DILOCO_COORDINATOR_ADDRESS", "num_hosts": "DILOCO_NUM_HOSTS",
        "host_id": "DILOCO_HOST_ID", "link_timeout": "DILOCO_LINK_TIMEOUT",
        "coordinator_grace": "DILOCO_COORDINATOR_GRACE"}
_LEFT = "diloco_jax/end/left/"  # a host's key once it is leaving (leave_together)
JAX_HEARTBEAT_S = 100  # jax.distributed's heartbeat timeout, unless --heartbeat_timeout
# Per process, as jax.distributed is: `initialize` starts it, `leave_together` stops it.
_watchdog: watchdog.LinkWatchdog | None = None  # this host's, when one runs


class StartupError(errors.DilocoError, RuntimeError):
  """The hosts could not form a job (a peer missing, mismatched configs, bad flags)."""
  prefix = "Start-up failed"


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Attributes: coordinator_address ('host:port', None for one host); num_hosts; host_id;
  initialization_timeout and heartbeat_timeout in seconds; link_timeout: seconds a host
  may be cut off from the others before every host stops with "link lost" (None: 40% of
  heartbeat_timeout; 0: never, JAX's heartbeat timeout aborts the job instead);
  join_token_file: the file holding the job's join token (None: DILOCO_JOIN_TOKEN_FILE
  or DILOCO_JOIN_TOKEN, else no token); allow_public_coordinator: run with a coordinator
  on a public address; insecure: listen beyond loopback without a join token;
  coordinator_grace: seconds a host waits for a membership coordinator that stopped
  answering before it stops."""
  coordinator_address: str | None = None
  num_hosts: int | None = None
  host_id: int | None = None
  initialization_timeout: int = 300
  heartbeat_timeout: int | None = None  # None: jax.distributed's 100 s, a lease's 10 s
  link_timeout: int | None = None
  join_token_file: str | None = None
  allow_public_coordinator: bool = False
  insecure: bool = False
  coordinator_grace: float | None = None  # None: the lease's default (600 s)

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


  @property
  def single(self) -> bool:
    """One host: told so, or told nothing (`detected` fills in a cluster manager's)."""
    return self.num_hosts == 1 or (
        self.coordinator_address is None and self.num_hosts is None and self.host_id is None)


def detected(c: Cluster) -> Cluster:
  """`c` with what a cluster manager (SLURM, Open MPI, Kubernetes, TPU pods; JAX's own
  detectors) says filled in where it is unset."""
  if c.num_hosts == 1 or not _cluster_detected():
    return c
  from jax._src import clusters  # pylint: disable=import-outside-toplevel
  address, num_hosts, host_id, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
      c.coordinator_address, c.num_hosts, c.host_id, None, None, c.initialization_timeout)
  return dataclasses.replace(c, coordinator_address=address, num_hosts=num_hosts,
                             host_id=host_id)


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
  c = dataclasses.replace(c, heartbeat_timeout=c.heartbeat_timeout or JAX_HEARTBEAT_S)
  for name, value in (("initialization_timeout", c.initialization_timeout),
                      ("heartbeat_timeout", c.heartbeat_timeout)):
    if value < 1:
      raise StartupError(f"--{name}={value}: must be >= 1 second")
  if c.link_timeout is not None and c.link_timeout < 0:
    raise StartupError(f"--link_timeout={c.link_timeout}: must be >= 0 (0: off)")
  token, bind = _security_checks(c)
  # Cross-host sums run on the CPU backend (gloo over TCP) on every kind of host.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = (f"host {c.host_id if c.host_id is not None else '?'} of "
           f"{c.num_hosts if c.num_hosts is not None else '?'} hosts")
  print(f"{where}: joining the job at coordinator {c.coordinator_address or '(auto-detected)'}; "
        f"waiting up to {c.initialization_timeout}s for every host", flush=True)
  # When a host never joins, JAX aborts the process from C++ at the deadline with a
  # generic message; this timer says what happened first, and exits non-zero itself.
  missing = threading.Timer(c.initialization_timeout, _missing_hosts, args=(where, c))
  missing.daemon = True
  missing.start()
  try:
    _start_jax(c, bind)
    _agree_on_token(token, c.initialization_timeout)
  finally:
    missing.cancel()
  if jax.process_index() == 0:
    service = f"listening on {bind}" if bind else "listening on every interface"
    auth = (f"hosts authenticated by the join token from {token.source}" if token else
            "the job is unauthenticated: any process that reaches the coordinator port can "
            f"join it (set ${security.TOKEN_ENV} on every host; docs/security.md)")
    print(f"host 0: coordination service {service}; {auth}", flush=True)
  _keep_coordinator_connections(c.heartbeat_timeout)
  link_timeout = (c.link_timeout if c.link_timeout is not None
                  else max(1, c.heartbeat_timeout * 2 // 5))
  if link_timeout:
    global _watchdog
    _watchdog = watchdog.LinkWatchdog(link_timeout)
    _watchdog.start()
  return True



def leave_together(timeout_s: int = 600) -> None:
  """The clean end of a job of several hosts on `jax.distributed` (it ran to the end, or
  stopped at a preemption's round with a checkpoint): every host meets the others at a
  barrier of its own, then exits 0 without JAX's shutdown, host 0 (whose coordination
  service the others use until then) last, once each has said it is leaving.

  JAX's own shutdown (its preemption manager, then a barrier that waits
  `shutdown_timeout_seconds`) aborted hosts with signal 6 in CI after a preemption: host 0
  still inside the preemption manager's shutdown while host 1's barrier ran out. Nothing
  is left to do at this point (checkpoints, metrics and logs are closed), so it is skipped.
  """
  client = coordination.coordination_client()
  me, hosts = jax.process_index(), jax.process_count()
  if _watchdog is not None:
    _watchdog.stop()  # marks this host done: no false alarm while the others finish
  try:
    client.wait_at_barrier("diloco_jax/end", timeout_s * 1000)
    if me == 0:
      # The others' keys, not their liveness: a host that has exited is seen as dead only
      # after the heartbeat timeout.
      deadline = time.monotonic() + 10
      while (len(client.key_value_dir_get(_LEFT)) < hosts - 1
             and time.monotonic() < deadline):
        time.sleep(0.05)
    else:
      client.key_value_set(f"{_LEFT}{me}", "1")
  except Exception as e:  # noqa: BLE001 -- the store's errors: a host gone, a timeout
    sys.stderr.write(f"host {me}: the hosts did not all reach the end together "
                     f"({type(e).__name__}); this host's work is saved, exiting\n")
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def _security_checks(c: Cluster) -> tuple[security.JoinToken | None, str | None]:
  """Before anything listens or connects: refuses a public coordinator address (unless
  allowed) and an unreadable token. Returns the token and host 0's bind address."""
  try:
    if c.coordinator_address:
      security.check_coordinator_address(c.coordinator_address, c.allow_public_coordinator)
    token = security.JoinToken.from_environment(c.join_token_file)
  except security.SecurityError as e:
    raise StartupError(str(e)) from None
  bind = None
  if (c.coordinator_address and c.host_id in (0, None)
      and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")):  # the user's choice stands
    bind = security.bind_address(c.coordinator_address)
  return token, bind


def _start_jax(c: Cluster, bind: str | None) -> None:
  if c.host_id not in (0, None) and c.coordinator_address:
    _wait_for_coordinator(c.coordinator_address, c.initialization_timeout)
  try:
    jax.distributed.initialize(
        coordinator_address=c.coordinator_address, num_processes=c.num_hosts,
        process_id=c.host_id, initialization_timeout=c.initialization_timeout,
        heartbeat_timeout_seconds=c.heartbeat_timeout,
        # A clean exit waits this long for the other hosts at the shutdown barrier.
        shutdown_timeout_seconds=c.heartbeat_timeout,
        # Host 0's service listens on the coordinator's interface only, where it can.
        coordinator_bind_address=bind)
  except Exception as e:  # noqa: BLE001 -- XLA raises several types here.
    raise StartupError(
        f"host {c.host_id} of {c.num_hosts}: could not join the job at coordinator "
        f"{c.coordinator_address} within --initialization_timeout={c.initialization_timeout}s "
        f"(did every host start, with the same --num_hosts and coordinator address, and is "
        f"the coordinator's port open?): {type(e).__name__}: {e}") from None


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once host 0's coordination service accepts connections (or after `timeout_s`,
  leaving the error to JAX's connect).

  A host whose gRPC client connects before the service listens is refused, and gRPC tries
  again only after its reconnect backoff (1 s at first): hosts started together would all
  wait that second, every start. Polling the port every 10 ms costs a refused TCP connect.
  """
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
        return
    except OSError:
      time.sleep(0.01)


def _agree_on_token(token: security.JoinToken | None, timeout_s: int) -> None:
  me = jax.process_index()
  try:
    security.agree_on_token(coordination.coordination_client(), me, jax.process_count(), token,
                            timeout_s)
  except security.SecurityError as e:
    raise StartupError(str(e)) from None
  except Exception as e:  # noqa: BLE001 -- the store's errors (a host gone, a timeout)
    raise StartupError(f"host {me}: the hosts did not agree on the join token within "
                       f"{timeout_s}s: {type(e).__name__}: {e}") from None


def _keep_coordinator_connections(heartbeat_timeout: int) -> None:
  """Host 0: the coordination service keeps a host's connection through a network outage
  as long as its heartbeat timeout allows, not gRPC's 20 s.

  gRPC's server sets TCP_USER_TIMEOUT = 20 s on every connection it accepts (seen with
  getsockopt on the service's sockets, jaxlib 0.10.2; JAX passes no channel argument to
  change it). When a
  link is down for 20 s while the service has a reply outstanding (a barrier, a key-value
  get), the kernel drops the connection; when the link returns the host's gRPC channel gets
  "Connection reset by peer", its error polling fails, and JAX aborts the process. A thread
  raises the option on each of the service's connections (they are this process's own
  sockets) to the heartbeat timeout, after which the service gives up on the host anyway.
  DILOCO_COORDINATOR_TCP_USER_TIMEOUT (seconds; 0: leave gRPC's) overrides the value.
  """
  state = coordination.jax_distributed_state()
  if state.service is None or not state.coordinator_address:
    return
  seconds = int(os.environ.get("DILOCO_COORDINATOR_TCP_USER_TIMEOUT", heartbeat_timeout))
  if seconds <= 0 or not hasattr(socket, "TCP_USER_TIMEOUT") or not os.path.isdir(
      "/proc/self/fd"):
    return
  port = int(state.coordinator_address.rsplit(":", 1)[1])
  threading.Thread(target=_raise_user_timeouts, args=(port, seconds * 1000),
                   name="diloco-coordinator-sockets", daemon=True).start()


def _raise_user_timeouts(port: int, timeout_ms: int) -> None:
  seen: set[str] = set()  # socket inodes already looked at
  while True:
    try:
      fds = os.listdir("/proc/self/fd")
    except OSError:
      return
    for fd in fds:
      try:
        inode = os.readlink(f"/proc/self/fd/{fd}")
        if not inode.startswith("socket:") or inode in seen:
          continue
        sock = socket.socket(fileno=os.dup(int(fd)))
      except (OSError, ValueError):
        continue
      seen.add(inode)
      with sock:
        try:
          if (sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port
              and sock.getpeername()):  # an accepted connection, not the listener
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_ms)
        except (OSError, IndexError, TypeError):
          pass
    time.sleep(1.0)


def _missing_hosts(where: str, c: Cluster) -> None:
  sys.stderr.write(
      f"Start-up failed: {where}: not every host joined the job at coordinator "
      f"{c.coordinator_address} within --initialization_timeout={c.initialization_timeout}s. "
      "Did every host start, with the same --num_hosts and coordinator address, and is the "
      "coordinator's port open? Stopping this host.\n")
  sys.stderr.flush()
  os._exit(1)


def describe(fields: dict[str, Any]) -> dict[str, Any]:
  """What every host must agree on: the config's fields ({"config.a.b": value}, as
  `config.flatten` gives them) and the software versions."""
  return {"diloco_jax": __version__, "jax": jax.__version__, **fields}


def differing_fields(described: list[dict[str, Any]]) -> dict[str, list[Any]]:
  """field -> [value on host 0, host 1, ...] for every field that is not the same on all."""
  fields = sorted(set().union(*described))
  return {f: [d.get(f, "<missing>") for d in described] for f in fields
          if len({json.dumps(d.get(f, "<missing>"), default=str) for d in described}) > 1}


def check_same_config_over(allgather, me: int, fields: dict[str, Any]) -> None:
  """`check_same_config` for a live job, whose hosts have no coordination service:
  every host's description crosses `allgather` ([hosts, *x.shape] in host order), so
  every host sees every difference and all refuse alike."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  mine = np.frombuffer(json.dumps(describe(fields), default=str).encode(), np.uint8)
  sizes = allgather(np.array([mine.size], np.int64))[:, 0]
  rows = allgather(np.pad(mine, (0, int(sizes.max()) - mine.size)))
  described = [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]
  _refuse_differences(me, described)


def check_same_config(fields: dict[str, Any], timeout_s: int) -> None:
  """Stops every host with a StartupError if any two hosts resolved different configs
  (`fields`: this host's, flattened)."""
  if jax.process_count() == 1:
    return
  client = coordination.coordination_client()
  me, n = jax.process_index(), jax.process_count()
  client.key_value_set(f"diloco_jax/config/{me}", json.dumps(describe(fields), default=str))
  try:
    described = [json.loads(client.blocking_key_value_get(f"diloco_jax/config/{h}",
                                                          timeout_s * 1000)) for h in range(n)]
  except Exception as e:  # noqa: BLE001
    raise StartupError(f"host {me}: did not get every host's config within {timeout_s}s: "
                       f"{e}") from None
  # Nobody leaves (and takes the coordination service down) before everyone has read.
  client.wait_at_barrier("diloco_jax/config_compared", timeout_s * 1000)
  _refuse_differences(me, described)


def _refuse_differences(me: int, described: list[dict[str, Any]]) -> None:
  diff = differing_fields(described)
  if diff:
    lines = [f"  {f}: " + ", ".join(f"host {h}={v!r}" for h, v in enumerate(values))
             for f, values in diff.items()]
    raise StartupError(f"host {me}: the hosts' configs differ in {len(diff)} field(s); "
                       "every host must run the same config and version:\n" + "\n".join(lines))
