"""The start of a job on this host: which `World` it trains in.

- One host (no coordinator address, no host count, no cluster detected): a world of its own.
- `ddp` on several hosts: `jax.distributed` (runtime/cluster.py); its per-step gradient sums
  run inside XLA, and the hosts share fate.
- Every other multi-host job, in every DiLoCo mode, has live membership: no
  `jax.distributed` (each host's JAX is a world of its own, so no host's loss can end
  another's process); each host registers with a membership coordinator
  (membership/lease.py), opens the epoch wire's collective (membership/collective.py) and
  compares its config with every other host's over the wire (every host sees every
  difference and all refuse alike). The coordinator is `--membership=ADDR`, one on an
  always-on machine (`python -m diloco_jax.membership.coordinator`; no training host's loss
  ends the job), or else host 0 serves one itself at `--coordinator_address`, in a thread:
  the plain command of a fixed job starts a live one, whose seat is host 0 (its loss ends
  the job, as a jax.distributed coordinator's would).

`finish(world)` is the end of the job on this host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import ml_collections

from diloco_jax import compile_cache
from diloco_jax import config as config_lib
from diloco_jax.membership import client as client_lib
from diloco_jax.membership import collective as collective_lib
from diloco_jax.membership import coordinator as coordinator_lib
from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import programs as programs_lib
from diloco_jax.membership.world import World
from diloco_jax.runtime import cluster
from diloco_jax.runtime import security

LEASE_S = 10.0  # host 0's coordinator: a host silent this long is dropped (--heartbeat_timeout)
FINISH_S = 600.0  # host 0 serves the others this long after its own end, at most


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: membership, a standalone coordinator's "host:port" (None: host 0 serves
  one at the cluster's coordinator address); wire_address, where the other hosts reach
  this host's sums (None: a free port on the address that routes to the coordinator);
  min_hosts, the hosts that start the job (None: every one of num_hosts); last_epoch, the
  highest epoch number this host saw before (its newest checkpoint's: a coordinator started
  anew numbers its epochs above it)."""
  membership: str | None = None
  wire_address: str | None = None
  min_hosts: int | None = None
  last_epoch: int = 0


def start(config: ml_collections.ConfigDict, spec: cluster.Cluster,
          options: Options = Options()) -> World:
  """This host's world (module docstring). Must run before anything touches a jax
  backend; raises a StartupError (or a MembershipError) naming what is wrong."""
  from diloco_jax.modes import registry  # pylint: disable=import-outside-toplevel
  c = cluster.detected(spec.resolved())
  per_step = registry.driver(config.mode).per_step
  if options.membership is None and c.single:
    return World.fixed()
  if per_step:  # ddp: a gradient sum per step, inside XLA
    if options.membership is not None and not c.coordinator_address:
      raise cluster.StartupError(
          f"config.mode = {config.mode!r} sums gradients at every inner step, over "
          "jax.distributed: give --coordinator_address (host 0's host:port); --membership "
          "is for the DiLoCo modes")
    if options.membership is not None and c.host_id == 0:
      print(f"config.mode = {config.mode!r}: the hosts run on jax.distributed at "
            f"{c.coordinator_address}; --membership is not used", flush=True)
    cluster.initialize(c)
    cluster.check_same_config(config_lib.flatten(config), timeout_s=c.initialization_timeout)
    return World.fixed()
  return _start_live(config, c, options)


def _start_live(config: ml_collections.ConfigDict, c: cluster.Cluster,
                options: Options) -> World:
  if c.num_hosts is None or c.host_id is None or not 0 <= c.host_id < c.num_hosts:
    raise cluster.StartupError(f"several hosts need --num_hosts and --host_id in "
                               f"[0, num_hosts) (got {c.num_hosts} and {c.host_id})")
  min_hosts = options.min_hosts
  if min_hosts is not None and not 1 <= min_hosts <= c.num_hosts:
    raise cluster.StartupError(f"--min_hosts={min_hosts}: must be in [1, --num_hosts="
                               f"{c.num_hosts}]")
  address = options.membership or c.coordinator_address
  if not address:
    raise cluster.StartupError("several hosts need --coordinator_address (host 0's "
                               "host:port) or --membership (a coordinator's host:port)")
  try:
    security.check_coordinator_address(address, c.allow_public_coordinator)
    token = security.JoinToken.from_environment(c.join_token_file)
  except security.SecurityError as e:
    raise cluster.StartupError(str(e)) from None
  wire = client_lib.wire_address(address, options.wire_address)
  serves = options.membership is None and c.host_id == 0
  listens = {f"host {c.host_id}'s wire": wire}
  if serves:
    listens["host 0's coordinator"] = f"{_listen(address)}:{security.split_address(address)[1]}"
  try:
    warning = security.require_token(token, listens, security.insecure(c.insecure))
  except security.SecurityError as e:
    raise cluster.StartupError(f"host {c.host_id}: {e}") from None
  if warning:
    print(warning, flush=True)
  serving = _serve(address, c, token) if serves else None
  offer = _offer(wire, token)
  wanted = ("every host" if min_hosts in (None, c.num_hosts)
            else f"{min_hosts} of the {c.num_hosts} hosts")
  print(f"host {c.host_id} of {c.num_hosts} hosts: registering with the membership "
        f"coordinator at {address}; waiting up to {c.initialization_timeout}s for {wanted}",
        flush=True)
  seat = "the coordinator's" if options.membership else "host 0's"
  try:
    lease = lease_lib.Lease.start(
        address, host=c.host_id, num_hosts=c.num_hosts, token=token,
        timeout_s=c.initialization_timeout, address=wire,
        min_hosts=min_hosts, waiting=_refused(serving, c.host_id),
        last_epoch=options.last_epoch, programs=offer.address if offer else "",
        grace_s=lease_lib.GRACE_S if c.coordinator_grace is None else c.coordinator_grace)
  except BaseException as e:  # (its programs' server, if any, ends with the start)
    if offer is not None:
      offer.close()
    if isinstance(e, client_lib.TokenMismatch):
      raise cluster.StartupError(f"host {c.host_id}: join token mismatch: {seat} join "
                                 f"token differs from this host's ({e})") from None
    raise
  collective = collective_lib.EpochCollective(lease, token=token,
                                              timeout_s=config.wire_timeout)
  world = World(c.host_id, c.num_hosts, lease, token, collective, serving, offer)
  if lease.joining:  # the job runs: its config comes with the members' state (loop/join.py)
    return world
  collective.connect()
  try:
    cluster.check_same_config_over(collective.allgather, c.host_id, config_lib.flatten(config))
  except cluster.StartupError:
    # Every host refuses alike. Each leaves, and host 0's coordinator answers until the
    # others have left: one still waiting for the comparison's commit would otherwise
    # take host 0's exit for a coordinator lost, and wait out --coordinator_grace.
    finish(world, timeout_s=c.initialization_timeout)
    raise
  return world


def _serve(address: str, c: cluster.Cluster,
           token: security.JoinToken | None) -> coordinator_lib.Serving:
  """Host 0's coordinator, at the job's coordinator address."""
  host, port = security.split_address(address)
  listen = _listen(address)
  try:
    serving = coordinator_lib.Serving(port, c.num_hosts, c.heartbeat_timeout or LEASE_S,
                                      coordinator_lib.key_for(token), listen)
  except coordinator_lib.CoordinatorError as e:
    raise cluster.StartupError(f"host 0: {e}") from None
  auth = (f"hosts authenticated by the join token from {token.source}" if token else
          "the job is unauthenticated: any process that reaches the coordinator port can "
          f"join it (set ${security.TOKEN_ENV} on every host; docs/security.md)")
  print(f"host 0: membership coordinator listening on {listen}:{port} ({host}:{port} for "
        f"the hosts); {auth}", flush=True)
  return serving


def _offer(wire: str, token: security.JoinToken | None) -> programs_lib.Offer | None:
  """This host's compiled programs, served to joiners on its wire's IP (None where the
  compilation cache is off: nothing is kept to serve)."""
  cache = compile_cache.directory()
  if cache is None:
    return None
  return programs_lib.Offer(security.split_address(wire)[0], token, os.path.dirname(cache))


def _listen(address: str) -> str:
  """The IP host 0's coordinator binds: the coordinator address's own, where it is one of
  this machine's, else every interface."""
  if security.split_address(address)[0] == "localhost":
    return "127.0.0.1"
  bind = security.bind_address(address)
  return security.split_address(bind)[0] if bind else "0.0.0.0"


def _refused(serving: coordinator_lib.Serving | None, me: int) -> Callable[[], None]:
  """Host 0, waiting for the others: says once that a request or a handshake failed this
  job's key (a host with another join token, or none where this one has one). Said, not
  fatal: a stranger's connection fails the same way, and must not stop the job; the host
  with the other token stops itself, and this one at its --initialization_timeout."""
  said = []

  def check() -> None:
    if serving is not None and serving.refused and not said:
      peer, claimed, why = serving.refused[0]
      who = (f"host {claimed}" if claimed is not None else
             f"a host at {peer}" if peer else "a connection")
      print(f"host {me}: {who} failed this job's key: {why}; a host with another join "
            "token (or none) cannot join this job", flush=True)
      said.append(True)

  return check


def finish(world: World, timeout_s: float = FINISH_S) -> None:
  """The end of this host's job: a live host leaves (the others need not wait for its
  lease), and host 0 serves the others until they have left too (at most `timeout_s`)."""
  if world.programs is not None:  # first: leaving is the last this host does before its end
    world.programs.close()
  if world.collective is not None:
    world.collective.close()
  if world.coordinator is not None and not world.coordinator.finish(timeout_s):
    print(f"host 0: hosts still in the job {timeout_s:g} s after this host's end; its "
          "coordinator stops now (their work is in their checkpoints)", flush=True)
