"""What one host's run is built from: `Parts`, four small groups of services and the
run's shape, made once by `build.build` and never changed after.

The groups say who a service works with: `Model` (the devices: the model, the mesh, the
compiled steps), `Sync` (the other hosts: membership, the sums, the mode's outer step,
the pacer, the stop flag riding the sums, the anchor check), `Storage` (the disk: the
workdir lock and the checkpoint store with its save policy) and `Reporting` (the round
log, the bar, the profile window, the start's phases). The run's shape (hosts, R, K, H,
rounds, tokens) is read from the config and the world, its only sources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import ml_collections

from diloco_jax.algo import optim
from diloco_jax.algo import state as algo_state
from diloco_jax.checkpoints import store as store_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.device import inner
from diloco_jax.loop import pacing
from diloco_jax.membership import manager as membership_lib
from diloco_jax.membership import world as world_lib
from diloco_jax.models import family
from diloco_jax.modes import base as modes_base
from diloco_jax.reporting import phases as phases_lib
from diloco_jax.reporting import profiling
from diloco_jax.reporting import progress
from diloco_jax.reporting import roundlog
from diloco_jax.runtime import preemption as preemption_lib
from diloco_jax.runtime import workdir as workdir_lib
from diloco_jax.wire import collective as collective_lib
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib
from diloco_jax.wire import integrity


@dataclasses.dataclass(frozen=True)
class Model:
  """What this host's devices run.

  Attributes:
    cfg, attention: the model (`family.ModelConfig`) and the attention kernel it uses.
    num_params, flops_per_token: its size, and the model FLOPs of one token.
    peak_flops: the peak of all devices of all hosts (None: unknown, no MFU).
    mesh: the local devices' mesh.
    inner: the jitted inner step of every local replica (the mode's).
    init_replicas: anchor -> this host's ReplicaState (fresh inner optimizer moments).
    eval_step, eval_batches: the eval and its batches, on the devices.
    step_memory: the compiled inner step's memory (run.json; None: not reported).
  """
  cfg: family.ModelConfig
  attention: str
  num_params: int
  flops_per_token: float
  peak_flops: float | None
  mesh: jax.sharding.Mesh
  inner: inner.Step
  init_replicas: Callable[[algo_state.Params], algo_state.ReplicaState]
  eval_step: inner.EvalStep
  eval_batches: jax.Array
  step_memory: dict[str, int] | None


@dataclasses.dataclass(frozen=True)
class Sync:
  """What this host does with the others.

  Attributes:
    membership, collective: who takes part in the sums, and the sums themselves.
    exchange: the cross-host sums of pseudo-gradients.
    driver: the mode's driver (`modes.base.Driver`: the outer step, whatever the mode).
    pacer: balance 'speed': each host's steps per round (`pacing.Pacer`).
    preemption: the stop flag (a word on every sum).
    anchor_check: the outer state's comparison across hosts.
  """
  membership: membership_lib.Membership
  collective: collective_lib.Collective
  exchange: exchange_lib.Exchange
  driver: modes_base.Driver
  pacer: pacing.Pacer
  preemption: preemption_lib.Preemption
  anchor_check: integrity.AnchorCheck


@dataclasses.dataclass(frozen=True)
class Storage:
  """This host's disk.

  Attributes:
    store: the checkpoint store (`checkpoints.store.Store`).
    policy: when the loop saves (`checkpoints.store.SavePolicy`).
    lock: the workdir lock (None: another host holds it).
    shared: whether the hosts share the workdir.
  """
  store: store_lib.Store
  policy: store_lib.SavePolicy
  lock: workdir_lib.Lock | None
  shared: bool


@dataclasses.dataclass(frozen=True)
class Reporting:
  """What the run says.

  Attributes:
    log, bar: the round log (its writer opened by the loop, once it knows the first round)
      and the progress bar.
    profile: the profile window.
    start_phases: where this host's start went, by phase (`reporting.phases.Phases`).
  """
  log: roundlog.RoundLog
  bar: progress.ProgressBar
  profile: profiling.ProfileWindow
  start_phases: phases_lib.Phases


@dataclasses.dataclass(frozen=True)
class Parts:
  """The services of one host's run, built once by `build.build`.

  Attributes:
    config: the config as the run uses it (validated; a prepared corpus's vocabulary and
      init_from's model fields resolved).
    workdir: where this host writes (live on a shared disk: its own host<i>/ in it).
    dispatcher: the thread that issues cross-host collectives.
    world: which host this is, among whom (`membership.world.World`: fixed, or live).
    data: this host's replicas' streams and the eval batches (`spec`: what the data is).
    model, sync, storage, reporting: the groups above.
  """
  config: ml_collections.ConfigDict
  workdir: str
  dispatcher: dispatch.Dispatcher
  world: world_lib.World
  data: data_lib.HostData
  model: Model
  sync: Sync
  storage: Storage
  reporting: Reporting

  @property
  def host(self) -> int:
    return self.world.host

  @property
  def num_hosts(self) -> int:
    return self.world.num_hosts

  @property
  def replicas_per_host(self) -> int:  # R
    return self.config.replicas_per_host

  @property
  def num_replicas(self) -> int:  # K
    return self.replicas_per_host * self.num_hosts

  @property
  def h(self) -> int:
    """Inner steps per round (the slowest host's, under balance 'speed')."""
    return self.config.inner_steps

  @property
  def num_rounds(self) -> int:
    return self.config.num_rounds

  @property
  def tokens_per_replica_step(self) -> int:
    return self.config.batch_size * self.config.model.seq_len

  @property
  def tokens_per_step(self) -> int:
    """Tokens all K replicas take in one step."""
    return self.num_replicas * self.tokens_per_replica_step

  @property
  def spec(self) -> data_lib.DataSpec:
    """What the data is (vocabulary, floor, bytes per token): the data's own."""
    return self.data.spec

  @property
  def writes(self) -> bool:
    """This host writes run.json, metrics and events (host 0; every host of a live job,
    each in its own workdir)."""
    return self.sync.membership.writes(self.host)

  @property
  def prints(self) -> bool:
    """This host prints the run's lines now (host 0; the lowest live host of a live job)."""
    return self.sync.membership.prints(self.host)

  @property
  def evaluates(self) -> bool:
    """This host evaluates the model now: the host that prints. The others' records have
    no eval: their hosts would compute the same loss from the same model (every host's
    is the same bits), and on hosts that share cores it would cost the round."""
    return self.prints

  def inner_optimizer(self, schedule_steps: int):
    """The inner optimizer whose learning-rate schedule spans `schedule_steps` steps."""
    return optim.inner_optimizer(self.config.inner, schedule_steps)
