"""What one host builds before its first round: the run's `Parts`.

`build` validates the config, builds the data, the model, the local mesh, the membership,
the workdir lock, the checkpoint store, the mode's driver with its inner step and exchange,
and compiles the inner step before the state exists. The parts are services, built once and
never replaced; what changes from round to round is the `state.RunState` value that
`initial_state` makes and the round loop threads through `rounds.run_round` and
`resume.resume`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from typing import Callable

import jax
import ml_collections
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.algo import optim
from diloco_jax.checkpoints import per_host
from diloco_jax.checkpoints import shared_dir
from diloco_jax.checkpoints import store as store_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.data import resolve
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.membership import manager as membership_lib
from diloco_jax.loop import pacing
from diloco_jax.loop import runinfo
from diloco_jax.loop import state as state_lib
from diloco_jax.models import family
from diloco_jax.models import layers
from diloco_jax.models import model as model_lib
from diloco_jax.modes import base as modes_base
from diloco_jax.modes import registry
from diloco_jax.reporting import profiling
from diloco_jax.reporting import progress
from diloco_jax.reporting import roundlog
from diloco_jax.reporting import writers
from diloco_jax.runtime import preemption as preemption_lib
from diloco_jax.membership import world as world_lib
from diloco_jax.runtime import workdir as workdir_lib
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib
from diloco_jax.wire import integrity


@dataclasses.dataclass(frozen=True)
class Parts:
  """The services of one host's run, built once by `build`.

  Attributes:
    config: the config as the run uses it (validated; a prepared corpus's vocabulary and
      init_from's model fields resolved).
    workdir, dispatcher: where the run writes; the thread that issues cross-host collectives.
    world: which host this is, among whom (`membership.world.World`: fixed, or live).
    host, num_hosts, replicas_per_host, num_replicas: this host's index, the hosts, R, K.
    h, num_rounds: inner steps per round (the slowest host's), rounds in the run.
    tokens_per_replica_step, tokens_per_step: tokens one replica / all K take in a step.
    data: this host's replicas' streams and the eval batches (`spec`: what the data is).
    model_cfg, attention, num_params, flops_per_token, peak_flops: the model and its sizes.
    mesh: the local devices' mesh; inner: the jitted inner step of every local replica;
      init_replicas: anchor -> this host's ReplicaState (fresh inner optimizer moments).
    membership, collective: who takes part in the sums, and the sums themselves.
    lock: the workdir lock (None once released); shared_storage: whether the hosts share
      the workdir; store: the checkpoint store (`checkpoints.store.Store`).
    exchange: the cross-host sums of pseudo-gradients; driver: the mode's driver
      (`modes.base.Driver`: the outer step, whatever the mode).
    pacer: balance 'speed': each host's steps per round (`pacing.Pacer`).
    eval_step, eval_batches: the eval; log, bar: the round log and the progress bar.
    preemption, profile, anchor_check: the preemption flag, the profile window, the
      outer state's comparison across hosts.
    step_memory: the compiled inner step's memory (run.json).
    start_phases: where this host's start went, by phase (`runinfo.Phases`).
  """
  config: ml_collections.ConfigDict
  workdir: str
  dispatcher: dispatch.Dispatcher
  world: world_lib.World
  host: int
  num_hosts: int
  replicas_per_host: int
  num_replicas: int
  h: int
  num_rounds: int
  tokens_per_replica_step: int
  tokens_per_step: int
  data: Any
  model_cfg: family.ModelConfig
  attention: str
  num_params: int
  flops_per_token: float
  peak_flops: float | None
  mesh: jax.sharding.Mesh
  inner: Any
  init_replicas: Callable[[Any], Any]
  membership: Any
  collective: Any
  lock: Any
  shared_storage: bool
  store: store_lib.Store
  exchange: exchange_lib.Exchange
  driver: Any
  pacer: pacing.Pacer
  eval_step: inner.EvalStep
  eval_batches: Any
  log: roundlog.RoundLog
  bar: progress.ProgressBar
  preemption: preemption_lib.Preemption
  profile: profiling.ProfileWindow
  anchor_check: integrity.AnchorCheck
  step_memory: Any
  start_phases: runinfo.Phases

  @property
  def spec(self):
    """What the data is (vocabulary, floor, bytes per token): the data's own."""
    return self.data.spec

  @property
  def is_host0(self) -> bool:
    return self.host == 0

  @property
  def writes(self) -> bool:
    """This host writes run.json, metrics and events (host 0; every host of a live job,
    each in its own workdir)."""
    return self.membership.writes(self.host)

  @property
  def prints(self) -> bool:
    """This host prints the run's lines now (host 0; the lowest live host of a live job)."""
    return self.membership.prints(self.host)

  @property
  def evaluates(self) -> bool:
    """This host evaluates the model now: the host that prints. The others' records have
    no eval: their hosts would compute the same loss from the same model (every host's
    is the same bits), and on hosts that share cores it would cost the round."""
    return self.prints

  def inner_optimizer(self, schedule_steps: int):
    """The inner optimizer whose learning-rate schedule spans `schedule_steps` steps."""
    return optim.inner_optimizer(self.config.inner, schedule_steps)


def build(config: ml_collections.ConfigDict, workdir: str, dispatcher: dispatch.Dispatcher,
          world: world_lib.World, restart_from_scratch: bool = False,
          pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None
          ) -> tuple[Parts, state_lib.RunState]:
  """This host's parts, and the state before any checkpoint is read (the anchor from the
  seed; init_from: zeros until `resume.resume` knows no checkpoint holds the state; a
  joiner: zeros until `join.receive` has the members' state)."""
  phases = runinfo.Phases()  # "process": the interpreter, imports, jax.distributed
  host, num_hosts = world.host, world.num_hosts
  config = resolve.resolved(config, announce=host == 0)
  config_lib.validate(config, num_local_devices=jax.local_device_count(), num_hosts=num_hosts)
  driver = registry.driver(config.mode)
  try:  # before anything traces the model
    attention = model_lib.attention_kernel(
        family.ModelConfig.from_config(config.model, config.data.vocab_size),
        jax.local_devices()[0].platform)
  except layers.AttentionError as e:
    raise config_lib.ConfigError(str(e)) from None
  mesh_lib.check_memory(config, config.data.vocab_size, jax.local_device_count(),
                        driver.memory_profile(config))
  phases.done("checks")  # the config's, and the memory check (the model's shapes)
  replicas_per_host, h, num_rounds = config.replicas_per_host, config.inner_steps, config.num_rounds
  num_replicas = replicas_per_host * num_hosts  # K
  tokens_per_replica_step = config.batch_size * config.model.seq_len

  data = data_lib.make_host_data(
      config.data, seq_len=config.model.seq_len, batch_size=config.batch_size,
      replicas_per_host=replicas_per_host, num_eval_batches=config.eval_batches,
      host_index=host, num_hosts=num_hosts)
  phases.done("data")
  model_cfg = family.ModelConfig.from_config(config.model, data.spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(model_cfg)
  inner_optimizer = optim.inner_optimizer(config.inner, num_rounds * h)
  mesh = inner.local_mesh(config.mesh.replicas, config.mesh.fsdp)
  store_lib.check_writable(workdir)  # after the data's checks: they may refuse
  membership = membership_lib.of(world, config)
  collective = membership.collective
  pacer = pacing.Pacer(config, host=host, num_hosts=num_hosts,
                       replicas_per_host=replicas_per_host, present=lambda: collective.live,
                       idle=lambda r: exchange.idle_hosts(r))  # (built below)
  # A host joining a live job talks to no one until the members admit it (loop/join.py).
  if world.joining:
    claim, workdir = workdir_lib.claim_joining(workdir, host=host, num_hosts=num_hosts,
                                               restart_from_scratch=restart_from_scratch)
  else:
    membership.connect(dispatcher)
    # Before anything in the workdir is written: the lock, and whether the hosts share one
    # workdir or each has its own (runtime/workdir.py).
    claim = workdir_lib.claim(
        workdir, host=host, num_hosts=num_hosts, restart_from_scratch=restart_from_scratch,
        allgather=lambda words: dispatcher.run(collective.allgather, words,
                                               what="agreeing on the workdir"))
  shared_storage = claim.shared and not (num_hosts == 1 and per_host.present(workdir))
  if claim.shared and world.live and num_hosts > 1:
    # Live membership keeps every host's checkpoints and records its own, so that any host
    # may die: on a shared disk, in a directory per host.
    claim.release()
    fixed_checkpoints = os.path.join(workdir, "checkpoints")
    if os.path.isdir(fixed_checkpoints) and os.listdir(fixed_checkpoints):
      raise store_lib.CheckpointError(
          f"{workdir} holds the checkpoints of a job of several hosts written by a version "
          f"of diloco_jax before 0.2 (one directory for every host, by orbax); a job of "
          f"several hosts now keeps each host's under {workdir}/host<i>/ and cannot resume "
          "from them: resume it with the version that wrote it, or give this job another "
          "--workdir")
    workdir = os.path.join(workdir, f"host{host}")
    os.makedirs(workdir, exist_ok=True)
    if host == min(collective.live):
      print(f"live membership on a shared --workdir: each host keeps its checkpoints and "
            f"records in {os.path.dirname(workdir)}/host<i>/", flush=True)
    claim = workdir_lib.claim(
        workdir, host=host, num_hosts=num_hosts, restart_from_scratch=restart_from_scratch,
        allgather=lambda words: dispatcher.run(collective.allgather, words,
                                               what="agreeing on the workdir"))
    shared_storage = False
  # Opening the shared checkpoint directory waits at a barrier for every host: it comes
  # right after the lock's agreement, before the compiles that finish at different times
  # on different hosts.
  if shared_storage:
    store = shared_dir.SharedDirStore(
        workdir, keep=config.checkpoint.keep, dispatcher=dispatcher, collective=collective,
        timeout=config.checkpoint.timeout)
  else:
    store = per_host.PerHostStore(
        workdir, host=host, keep=config.checkpoint.keep, dispatcher=dispatcher,
        collective=collective, timeout=config.checkpoint.timeout)
  phases.done("connect")  # the membership's connections, the workdir, the store
  train_step = driver.inner_step(loss_fn, inner_optimizer, mesh=mesh,
                                 grad_accum_steps=config.grad_accum_steps,
                                 collective=collective, dispatcher=dispatcher,
                                 num_replicas=num_replicas)
  # A stop (SIGTERM, Ctrl-C) is a word on every round's sum (ddp: JAX's sync point); live,
  # the word is the coordinator's stop of the whole job, and a host's own stop is its own.
  preemption = preemption_lib.Preemption(
      rides_sums=not driver.per_step,
      job_stopping=(lambda: world.lease.stopping) if world.live else None,
      stop_job=world.coordinator.stop_job if world.coordinator is not None else None)
  exchange = exchange_lib.Exchange(
      config.outer, collective=collective, dispatcher=dispatcher,
      replicas_per_host=replicas_per_host, steps_finished=train_step.steps_finished,
      # every host's steps and seconds ride on the round's sum where the mode has one
      # sum per round (not streaming's fragments, not ddp's steps)
      riders=(*membership.riders, preemption, *((pacer,) if driver.carries_pace else ())))
  param_shapes = family.param_shapes(model_cfg)
  outer_step = driver.from_config(config, mesh=mesh, exchange=exchange, params=param_shapes,
                                  pseudo_gradient_hook=pacing.weighted(pacer,
                                                                       pseudo_gradient_hook))

  def init_replicas(anchor):
    return train_step.init_replicas(inner_optimizer, anchor, num_replicas=outer_step.param_sets)

  # Compiled from the state's shapes before the state exists: compiling is start-up's
  # biggest use of host memory (LLVM), and the state (params and AdamW moments of every
  # replica) would add to that peak.
  # A start that finds the step's executable kept whole runs it without a trace: the
  # config (and the model it resolves to) is everything the step is built from.
  step_memory = train_step.compile(
      jax.eval_shape(init_replicas, param_shapes),
      (replicas_per_host, config.batch_size, config.model.seq_len + 1),
      spec={"config": config.to_json_best_effort(sort_keys=True), "model": repr(model_cfg)})
  phases.done("inner_step")  # compiled, or loaded whole
  with jax.default_device(exchange.host_device):
    # init_from: zeros until `resume` knows that no checkpoint holds the state, and reads
    # the weights then (a resumed run needs only the directory's config.json). A joiner
    # takes the members' state: zeros, without compiling the init (a fresh host's start
    # is mostly compiling: configs/peer.py's init was 1.7 s of 5.4).
    # (numpy's zeros, put as they are: jnp.zeros compiles a program per shape, 0.4 s)
    anchor = (jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), param_shapes)
              if config.model.init_from or world.joining else
              model_lib.init_params(model_cfg, jax.random.key(config.seed)))
  phases.done("init")
  num_params = model_lib.count_params(anchor)
  flops_per_token = model_lib.flops_per_token(model_cfg, num_params)
  peak = mesh_lib.peak_flops(mesh.devices.flat[0])  # every host has the same devices
  peak_flops = peak and peak * mesh.devices.size * num_hosts  # of the whole job
  eval_step = inner.EvalStep(loss_fn, mesh=mesh)
  bar = progress.ProgressBar(num_rounds * h, enabled=host == 0)
  tokens_per_step = num_replicas * tokens_per_replica_step
  log = roundlog.RoundLog(
      writers.MetricsWriter(workdir, enabled=False), bar, num_rounds=num_rounds,
      inner_steps=h, num_replicas=num_replicas, printing=membership.prints(host),
      tokens_per_round=h * tokens_per_step, bytes_per_token=data.spec.bytes_per_token,
      flops_per_token=flops_per_token, peak_flops=peak_flops,
      # the run ends by writing a checkpoint and waiting for it: as long as the last did
      finish_estimate=lambda: store.write_seconds or 0.0)
  parts = Parts(
      config=config, workdir=workdir, dispatcher=dispatcher, world=world, host=host,
      num_hosts=num_hosts,
      replicas_per_host=replicas_per_host, num_replicas=num_replicas, h=h,
      num_rounds=num_rounds, tokens_per_replica_step=tokens_per_replica_step,
      tokens_per_step=tokens_per_step, data=data, model_cfg=model_cfg,
      attention=attention, num_params=num_params, flops_per_token=flops_per_token,
      peak_flops=peak_flops, mesh=mesh, inner=train_step,
      init_replicas=init_replicas, membership=membership, collective=collective,
      lock=claim.lock, shared_storage=shared_storage, store=store, exchange=exchange,
      driver=outer_step, pacer=pacer, eval_step=eval_step,
      eval_batches=eval_step.put(data.eval_batches), log=log, bar=bar,
      preemption=preemption,
      profile=profiling.ProfileWindow(
          workdir, host, start=config.profile.start_round, rounds=config.profile.num_rounds,
          last_round=num_rounds, announce=host == 0),
      anchor_check=integrity.AnchorCheck(
          membership.hash_exchange(dispatcher), every=config.anchor_check_every,
          last_round=num_rounds, always=config.debug_checks),
      step_memory=step_memory, start_phases=phases)
  outer = outer_step.init(anchor)
  state = state_lib.RunState(
      outer=outer, replicas=init_replicas(anchor), schedule_steps=num_rounds * h,
      # run_round: on CPU the first round waits for its steps once
      await_steps_once=mesh.devices.flat[0].platform == "cpu",
      data=data.get_state(), pace=pacer.state())
  phases.done("state")  # the outer state and every replica's, from the anchor
  return parts, state
