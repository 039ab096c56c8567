"""What one host builds before its first round: the run's `parts.Parts`.

`build` validates the config and builds the data, then each group of `Parts` by a builder
of its own: the storage (the membership's connections first, the workdir lock, the
checkpoint store), the sync (the exchange, the mode's driver, the pacer), the model (its
inner step compiled before the state exists) and the reporting. The parts are services,
built once and never changed; what changes from round to round is the `state.RunState`
value that `build` makes and the round loop threads through `rounds.run_round` and
`resume.resume`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax import units
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
from diloco_jax.loop import parts as parts_lib
from diloco_jax.loop import state as state_lib
from diloco_jax.models import family
from diloco_jax.models import layers
from diloco_jax.models import model as model_lib
from diloco_jax.modes import base as modes_base
from diloco_jax.modes import registry
from diloco_jax.reporting import phases as phases_lib
from diloco_jax.reporting import profiling
from diloco_jax.reporting import progress
from diloco_jax.reporting import roundlog
from diloco_jax.reporting import writers
from diloco_jax.runtime import preemption as preemption_lib
from diloco_jax.membership import world as world_lib
from diloco_jax.runtime import workdir as workdir_lib
from diloco_jax.wire import collective as collective_lib
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib
from diloco_jax.wire import integrity


def build(config: ml_collections.ConfigDict, workdir: str, dispatcher: dispatch.Dispatcher,
          world: world_lib.World, restart_from_scratch: bool = False,
          pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None
          ) -> tuple[parts_lib.Parts, state_lib.RunState]:
  """This host's parts, and the state before any checkpoint is read (the anchor from the
  seed; init_from: zeros until `resume.resume` knows no checkpoint holds the state; a
  joiner: zeros until `join.receive` has the members' state)."""
  phases = phases_lib.Phases()  # "process": the interpreter, imports, jax.distributed
  if world.joining and world.programs is not None:
    _programs_from_a_member(world)  # before the checks, whose memory check traces the
    phases.done("programs")  # model's init: a wiped host's or a new id's, found here
  config, driver, attention = _checked(config, world.host, world.num_hosts)
  phases.done("checks")  # the config's, and the memory check (the model's shapes)
  data = data_lib.make_host_data(
      config.data, seq_len=config.model.seq_len, batch_size=config.batch_size,
      replicas_per_host=config.replicas_per_host, num_eval_batches=config.eval_batches,
      host_index=world.host, num_hosts=world.num_hosts)
  phases.done("data")
  store_lib.check_writable(workdir)  # after the data's checks: they may refuse
  membership = membership_lib.of(world, config)
  if not world.joining:  # a joiner talks to no one until the members admit it (join.py)
    membership.connect(dispatcher)
  storage, workdir = _storage(config, workdir, world, dispatcher, membership.collective,
                              restart_from_scratch)
  phases.done("connect")  # the membership's connections, the workdir, the store
  mesh = inner.local_mesh(config.mesh.replicas, config.mesh.fsdp)
  model_cfg = family.ModelConfig.from_config(config.model, data.spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(model_cfg)
  inner_optimizer = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  num_replicas = config.replicas_per_host * world.num_hosts  # K
  train_step = driver.inner_step(loss_fn, inner_optimizer, mesh=mesh,
                                 grad_accum_steps=config.grad_accum_steps,
                                 collective=membership.collective, dispatcher=dispatcher,
                                 num_replicas=num_replicas)
  sync = _sync(config, world, dispatcher, membership, driver, train_step, mesh,
               family.param_shapes(model_cfg), pseudo_gradient_hook)
  model, anchor = _model(config, world, model_cfg, attention, mesh, loss_fn, train_step,
                         inner_optimizer, sync, data.eval_batches, phases)
  phases.done("init")
  parts = parts_lib.Parts(
      config=config, workdir=workdir, dispatcher=dispatcher, world=world, data=data,
      model=model,
      sync=sync, storage=storage,
      reporting=_reporting(config, workdir, world, data, model, sync.membership,
                           storage.store, phases))
  outer = sync.driver.init(anchor)
  state = state_lib.RunState(
      outer=outer, replicas=model.init_replicas(anchor),
      schedule_steps=config.num_rounds * config.inner_steps,
      # run_round: on CPU the first round waits for its steps once
      await_steps_once=mesh.devices.flat[0].platform == "cpu",
      data=data.get_state(), pace=sync.pacer.state())
  phases.done("state")  # the outer state and every replica's, from the anchor
  return parts, state


def _programs_from_a_member(world: world_lib.World) -> None:
  """A joiner takes the compiled programs a member holds for this machine, which the build
  then loads as its own (membership/programs.py), and says where they came from."""
  taken = world.programs.take(world.lease.epoch)
  if taken is None:
    print(f"host {world.host}: no member has compiled programs for this machine; "
          "compiling them", flush=True)
    return
  print(f"host {world.host}: {taken['files']} compiled programs "
        f"({units.format_bytes(taken['bytes'])}) from host {taken['host']} in "
        f"{taken['seconds']:.1f} s", flush=True)


def _checked(config: ml_collections.ConfigDict, host: int, num_hosts: int
             ) -> tuple[ml_collections.ConfigDict, modes_base.Driver, str]:
  """The config resolved and validated, the mode's driver and the attention kernel, or a
  ConfigError before anything is built or traced."""
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
  return config, driver, attention


def _storage(config: ml_collections.ConfigDict, workdir: str, world: world_lib.World,
             dispatcher: dispatch.Dispatcher, collective: collective_lib.Collective,
             restart_from_scratch: bool) -> tuple[parts_lib.Storage, str]:
  """The workdir (claimed: its lock, whether the hosts share it) and the checkpoint store,
  before anything in the workdir is written; returns this host's workdir too (live on a
  shared disk: its host<i>/)."""
  host, num_hosts = world.host, world.num_hosts

  def claim(directory: str) -> workdir_lib.Claim:
    return workdir_lib.claim(
        directory, host=host, num_hosts=num_hosts, restart_from_scratch=restart_from_scratch,
        allgather=lambda words: dispatcher.run(collective.allgather, words,
                                               what="agreeing on the workdir"))

  if world.joining:
    claimed, workdir = workdir_lib.claim_joining(workdir, host=host, num_hosts=num_hosts,
                                                 restart_from_scratch=restart_from_scratch)
  else:
    claimed = claim(workdir)
  shared = claimed.shared and not (num_hosts == 1 and per_host.present(workdir))
  if claimed.shared and world.live and num_hosts > 1:
    # Live membership keeps every host's checkpoints and records its own, so that any host
    # may die: on a shared disk, in a directory per host.
    claimed.release()
    workdir = _host_dir(workdir, host, announce=host == min(collective.live))
    claimed, shared = claim(workdir), False
  # Opening the shared checkpoint directory waits at a barrier for every host: it comes
  # right after the lock's agreement, before the compiles that finish at different times
  # on different hosts.
  if shared:
    store = shared_dir.SharedDirStore(
        workdir, keep=config.checkpoint.keep, dispatcher=dispatcher, collective=collective,
        timeout=config.checkpoint.timeout)
  else:
    store = per_host.PerHostStore(
        workdir, host=host, keep=config.checkpoint.keep, dispatcher=dispatcher,
        collective=collective, timeout=config.checkpoint.timeout)
  policy = store_lib.SavePolicy(every=config.checkpoint.every, last_round=config.num_rounds)
  return parts_lib.Storage(store=store, policy=policy, lock=claimed.lock,
                           shared=shared), workdir


def _host_dir(workdir: str, host: int, announce: bool) -> str:
  """A live host's own directory in a shared --workdir."""
  fixed_checkpoints = os.path.join(workdir, "checkpoints")
  if os.path.isdir(fixed_checkpoints) and os.listdir(fixed_checkpoints):
    raise store_lib.CheckpointError(
        f"{workdir} holds the checkpoints of a job of several hosts written by a version "
        f"of diloco_jax before 0.2 (one directory for every host, by orbax); a job of "
        f"several hosts now keeps each host's under {workdir}/host<i>/ and cannot resume "
        "from them: resume it with the version that wrote it, or give this job another "
        "--workdir")
  directory = os.path.join(workdir, f"host{host}")
  os.makedirs(directory, exist_ok=True)
  if announce:
    print(f"live membership on a shared --workdir: each host keeps its checkpoints and "
          f"records in {workdir}/host<i>/", flush=True)
  return directory


def _sync(config: ml_collections.ConfigDict, world: world_lib.World,
          dispatcher: dispatch.Dispatcher, membership: membership_lib.Membership,
          driver: modes_base.Driver, train_step: inner.Step, mesh: jax.sharding.Mesh,
          param_shapes: Any, pseudo_gradient_hook: modes_base.PseudoGradientHook | None
          ) -> parts_lib.Sync:
  """What this host does with the others: the sums of pseudo-gradients and what rides
  them, and the mode's outer step."""
  host, num_hosts, collective = world.host, world.num_hosts, membership.collective
  exchange: exchange_lib.Exchange | None = None  # (built below, read only once running)
  pacer = pacing.Pacer(config, host=host, num_hosts=num_hosts,
                       replicas_per_host=config.replicas_per_host,
                       present=lambda: collective.live, idle=lambda r: exchange.idle_hosts(r))
  # A stop (SIGTERM, Ctrl-C) is a word on every round's sum (ddp: JAX's sync point); live,
  # the word is the coordinator's stop of the whole job, and a host's own stop is its own.
  preemption = preemption_lib.Preemption(
      rides_sums=not driver.per_step,
      job_stopping=(lambda: world.lease.stopping) if world.live else None,
      stop_job=world.coordinator.stop_job if world.coordinator is not None else None)
  exchange = exchange_lib.Exchange(
      config.outer, collective=collective, dispatcher=dispatcher,
      replicas_per_host=config.replicas_per_host, steps_finished=train_step.steps_finished,
      # every host's steps and seconds ride on the round's sum where the mode has one
      # sum per round (not streaming's fragments, not ddp's steps)
      riders=(*membership.riders, preemption, *((pacer,) if driver.carries_pace else ())))
  outer_step = driver.from_config(config, mesh=mesh, exchange=exchange, params=param_shapes,
                                  pseudo_gradient_hook=pacing.weighted(pacer,
                                                                       pseudo_gradient_hook))
  return parts_lib.Sync(
      membership=membership, collective=collective, exchange=exchange, driver=outer_step,
      pacer=pacer, preemption=preemption,
      anchor_check=integrity.AnchorCheck(
          membership.hash_exchange(dispatcher), every=config.anchor_check_every,
          last_round=config.num_rounds, always=config.debug_checks))


def _model(config: ml_collections.ConfigDict, world: world_lib.World,
           model_cfg: family.ModelConfig, attention: str, mesh: jax.sharding.Mesh,
           loss_fn: Any, train_step: inner.Step, inner_optimizer: Any, sync: parts_lib.Sync,
           eval_batches: np.ndarray, phases: phases_lib.Phases) -> tuple[parts_lib.Model, Any]:
  """The model's group (its inner step compiled before the state exists) and the anchor
  the run starts from (a placeholder until a resume or a join replaces it)."""
  param_shapes = family.param_shapes(model_cfg)

  def init_replicas(anchor):
    return train_step.init_replicas(inner_optimizer, anchor,
                                    num_replicas=sync.driver.param_sets)

  # Compiled from the state's shapes before the state exists: compiling is start-up's
  # biggest use of host memory (LLVM), and the state (params and AdamW moments of every
  # replica) would add to that peak.
  # A start that finds the step's executable kept whole runs it without a trace: the
  # config (and the model it resolves to) is everything the step is built from.
  step_memory = train_step.compile(
      jax.eval_shape(init_replicas, param_shapes),
      (config.replicas_per_host, config.batch_size, config.model.seq_len + 1),
      spec={"config": config.to_json_best_effort(sort_keys=True), "model": repr(model_cfg)})
  phases.done("inner_step")  # compiled, or loaded whole
  with jax.default_device(sync.exchange.host_device):
    # init_from: zeros until `resume` knows that no checkpoint holds the state, and reads
    # the weights then (a resumed run needs only the directory's config.json). A joiner
    # takes the members' state: zeros, without compiling the init (a fresh host's start
    # is mostly compiling: configs/peer.py's init was 1.7 s of 5.4).
    # (numpy's zeros, put as they are: jnp.zeros compiles a program per shape, 0.4 s)
    anchor = (jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), param_shapes)
              if config.model.init_from or world.joining else
              model_lib.init_params(model_cfg, jax.random.key(config.seed)))
  num_params = model_lib.count_params(anchor)
  peak = mesh_lib.peak_flops(mesh.devices.flat[0])  # every host has the same devices
  eval_step = inner.EvalStep(loss_fn, mesh=mesh)
  return parts_lib.Model(
      cfg=model_cfg, attention=attention, num_params=num_params,
      flops_per_token=model_lib.flops_per_token(model_cfg, num_params),
      peak_flops=peak and peak * mesh.devices.size * world.num_hosts,  # of the whole job
      mesh=mesh, inner=train_step, init_replicas=init_replicas, eval_step=eval_step,
      eval_batches=eval_step.put(eval_batches), step_memory=step_memory), anchor


def _reporting(config: ml_collections.ConfigDict, workdir: str, world: world_lib.World,
               data: data_lib.HostData, model: parts_lib.Model,
               membership: membership_lib.Membership, store: store_lib.Store,
               phases: phases_lib.Phases) -> parts_lib.Reporting:
  """The round log (its writer opens once the loop knows the first round), the bar, the
  profile window."""
  num_rounds, h, host = config.num_rounds, config.inner_steps, world.host
  bar = progress.ProgressBar(num_rounds * h, enabled=host == 0)
  num_replicas = config.replicas_per_host * world.num_hosts
  tokens_per_step = num_replicas * config.batch_size * config.model.seq_len
  log = roundlog.RoundLog(
      writers.MetricsWriter(workdir, enabled=membership.writes(host),
                            wandb=dict(project=config.log.wandb_project,
                                       mode=config.log.wandb_mode, config=config.to_dict())),
      bar, num_rounds=num_rounds, inner_steps=h,
      num_replicas=num_replicas,
      printing=lambda: membership.prints(host), tokens_per_round=h * tokens_per_step,
      bytes_per_token=data.spec.bytes_per_token, flops_per_token=model.flops_per_token,
      peak_flops=model.peak_flops,
      # the run ends by writing a checkpoint and waiting for it: as long as the last did
      finish_estimate=lambda: store.write_seconds or 0.0)
  return parts_lib.Reporting(
      log=log, bar=bar, start_phases=phases,
      profile=profiling.ProfileWindow(
          workdir, host, start=config.profile.start_round, rounds=config.profile.num_rounds,
          last_round=num_rounds, announce=host == 0))
