"""Everything one host builds before its first round, and what it checkpoints.

`Setup` validates the config, builds the data, the model, the local mesh, the membership,
the workdir lock, the checkpointer, the mode's driver with its inner step and exchange,
compiles the inner step before the state exists, and initializes the anchor and the
replicas. The round loop (`trainer.Trainer`) runs on what it built.
"""

from __future__ import annotations

import functools
import time

import jax
import ml_collections

from diloco_jax import config as config_lib
from diloco_jax._version import __version__
from diloco_jax.algo import optim
from diloco_jax.data import pipeline as data_lib
from diloco_jax.data import prepared
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.checkpoints import store
from diloco_jax.checkpoints import shared_dir
from diloco_jax.checkpoints import per_host
from diloco_jax.loop import membership as membership_lib
from diloco_jax.reporting import metrics
from diloco_jax.loop import pacing
from diloco_jax.reporting import profiling
from diloco_jax.reporting import writers
from diloco_jax.models import family
from diloco_jax.models import model as model_lib
from diloco_jax.models import pretrained
from diloco_jax.modes import base as modes_base
from diloco_jax.modes import registry
from diloco_jax.runtime import preemption
from diloco_jax.runtime import workdir as workdir_lib
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib
from diloco_jax.wire import integrity


class Setup:
  """The pieces of one host's run, built once: the config (validated and resolved), the
  data, the model, the local mesh, the membership and its collective, the workdir lock,
  the checkpointer, the inner step, the exchange, the mode's driver (`outer_step`), the
  outer state and replicas, the eval step, the round log, the preemption flag, the profile
  window and the anchor check."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               dispatcher: dispatch.Dispatcher, restart_from_scratch: bool = False,
               pseudo_gradient_hook: modes_base.PseudoGradientHook | None = None):
    config = prepared.resolved(config, announce=jax.process_index() == 0)
    config = pretrained.resolved(config, announce=jax.process_index() == 0)
    config_lib.validate(config, num_local_devices=jax.local_device_count(),
                        num_hosts=jax.process_count())
    driver = registry.driver(config.mode)
    try:  # before anything traces the model
      self.attention = model_lib.attention_kernel(
          family.ModelConfig.from_config(config.model, config.data.vocab_size),
          jax.local_devices()[0].platform)
    except model_lib.layers.AttentionError as e:
      raise config_lib.ConfigError(str(e)) from None
    mesh_lib.check_memory(config, config.data.vocab_size, jax.local_device_count(),
                          driver.memory_profile(config))
    self.config, self.workdir, self.dispatcher = config, workdir, dispatcher
    self.host, self.num_hosts = jax.process_index(), jax.process_count()
    self.is_host0 = self.host == 0
    self.replicas_per_host, self.h = config.replicas_per_host, config.inner_steps
    self.num_rounds = config.num_rounds
    self.num_replicas = self.replicas_per_host * self.num_hosts  # K
    self.tokens_per_replica_step = config.batch_size * config.model.seq_len
    self.tokens_per_step = self.num_replicas * self.tokens_per_replica_step
    # balance 'speed': each host's inner steps per round (loop/pacing.py)
    self.pacer = pacing.Pacer(config, host=self.host, num_hosts=self.num_hosts,
                              replicas_per_host=self.replicas_per_host)

    self.data = data_lib.make_host_data(
        config.data, seq_len=config.model.seq_len, batch_size=config.batch_size,
        replicas_per_host=self.replicas_per_host, num_eval_batches=config.eval_batches,
        host_index=self.host, num_hosts=self.num_hosts)
    self.spec = self.data.spec
    self.model_cfg = family.ModelConfig.from_config(config.model, self.spec.vocab_size)
    loss_fn = model_lib.make_loss_fn(self.model_cfg)
    inner_optimizer = optim.inner_optimizer(config.inner, self.num_rounds * self.h)
    self.mesh = inner.local_mesh(config.mesh.replicas, config.mesh.fsdp)
    self._await_steps_once = self.mesh.devices.flat[0].platform == "cpu"  # run_round
    self._schedule_steps = self.num_rounds * self.h  # the inner lr schedule's length
    self._compiles = True  # the next round is this process's first: not timed for balance
    store.check_writable(workdir)  # after the data's checks: they may refuse
    self.membership = membership_lib.of(config)
    self.collective = self.membership.collective
    self.membership.connect(dispatcher)
    # Before anything in the workdir is written: the lock, and whether the hosts share
    # one workdir or each has its own (runtime/workdir.py).
    claim = workdir_lib.claim(
        workdir, host=self.host, num_hosts=self.num_hosts,
        restart_from_scratch=restart_from_scratch,
        allgather=lambda words: dispatcher.run(self.collective.allgather, words,
                                               what="agreeing on the workdir"))
    self.lock = claim.lock
    self.shared_storage = claim.shared and not (self.num_hosts == 1
                                                and per_host.present(workdir))
    if not claim.shared and config.elastic:
      claim.release()
      raise store.CheckpointError(
          "config.elastic needs one --workdir shared by every host: with a workdir per "
          "host, a returning host's older checkpoints would roll the others back")
    # Opening the shared checkpoint directory waits at a barrier for every host (elastic:
    # for only `elastic_timeout` seconds): it comes right after the lock's agreement,
    # before the compiles that finish at different times on different hosts.
    if self.shared_storage:
      self.checkpointer = shared_dir.Checkpointer(
          workdir, keep=config.checkpoint.keep, dispatcher=dispatcher,
          collective=self.collective, save_timeout=self.membership.save_timeout,
          timeout=config.checkpoint.timeout)
    else:
      self.checkpointer = per_host.LocalCheckpointer(
          workdir, keep=config.checkpoint.keep, dispatcher=dispatcher,
          collective=self.collective, timeout=config.checkpoint.timeout)
    self.train_step = driver.inner_step(loss_fn, inner_optimizer, mesh=self.mesh,
                                        grad_accum_steps=config.grad_accum_steps,
                                        collective=self.collective, dispatcher=dispatcher,
                                        num_replicas=self.num_replicas)
    self.exchange = exchange_lib.Exchange(
        config.outer, collective=self.collective, dispatcher=dispatcher,
        replicas_per_host=self.replicas_per_host,
        steps_finished=self.train_step.steps_finished, extra=self.membership.sum_extra,
        # every host's steps and seconds ride on the round's sum: not on streaming's
        # fragments, nor in elastic mode, whose sums leave out the hosts that are away
        pace=self.pacer if config.mode in pacing.MODES and not config.elastic else None)
    param_shapes = family.param_shapes(self.model_cfg)
    self.outer_step = driver.from_config(config, mesh=self.mesh, exchange=self.exchange,
                                         params=param_shapes,
                                         pseudo_gradient_hook=pacing.weighted(
                                             self.pacer, pseudo_gradient_hook))
    self._init_replicas = functools.partial(self.train_step.init_replicas, inner_optimizer,
                                            num_replicas=self.outer_step.param_sets)
    # Compiled from the state's shapes before the state exists: compiling is start-up's
    # biggest use of host memory (LLVM), and the state (params and AdamW moments of every
    # replica) would add to that peak.
    self.step_memory = self.train_step.compile(
        jax.eval_shape(self._init_replicas, param_shapes),
        (self.replicas_per_host, config.batch_size, config.model.seq_len + 1))
    with jax.default_device(self.exchange.host_device):
      # init_from: zeros until `resume` knows that no checkpoint holds the state, and reads
      # the weights then (a resumed run needs only the directory's config.json).
      anchor = (jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), param_shapes)
                if config.model.init_from else
                model_lib.init_params(self.model_cfg, jax.random.key(config.seed)))
    self._init_source = None  # run.json's "init_from", read once (it hashes the files)
    self.num_params = model_lib.count_params(anchor)
    self.flops_per_token = model_lib.flops_per_token(self.model_cfg, self.num_params)
    peak = mesh_lib.peak_flops(self.mesh.devices.flat[0])  # every host has the same devices
    self.peak_flops = peak and peak * self.mesh.devices.size * self.num_hosts
    self.outer = self.outer_step.init(anchor)
    self.replicas = self._init_replicas(anchor)
    self.eval_step = inner.EvalStep(loss_fn, mesh=self.mesh)
    self.eval_batches = self.eval_step.put(self.data.eval_batches)
    self.bar = metrics.ProgressBar(self.num_rounds * self.h, enabled=self.is_host0)
    self.log = metrics.RoundLog(
        writers.MetricsWriter(workdir, enabled=False), self.bar, num_rounds=self.num_rounds,
        inner_steps=self.h, num_replicas=self.num_replicas, printing=self.is_host0,
        tokens_per_round=self.h * self.tokens_per_step, bytes_per_token=self.spec.bytes_per_token,
        flops_per_token=self.flops_per_token, peak_flops=self.peak_flops,
        # the run ends by writing a checkpoint and waiting for it: as long as the last did
        finish_estimate=lambda: self.checkpointer.write_seconds or 0.0)
    self.finished_before = False  # resumed from the checkpoint of a finished run
    self.run_id = ""  # this run's id, kept in its checkpoints (set by resume)
    self.start: dict = {}  # how this start resumed, for run.json (set by resume)
    self.preemption = preemption.Preemption()
    self.profile = profiling.ProfileWindow(
        workdir, self.host, start=config.profile.start_round,
        rounds=config.profile.num_rounds, last_round=self.num_rounds, announce=self.is_host0)
    self.anchor_check = integrity.AnchorCheck(
        self.membership.hash_exchange(dispatcher), every=config.anchor_check_every,
        last_round=self.num_rounds, always=config.debug_checks)

  def announce(self) -> None:
    """The start-up lines (every host prints its own)."""
    metrics.print_startup(
        host=self.host, num_hosts=self.num_hosts, mode=self.config.mode,
        devices=[f"{d.platform}:{jax.local_devices().index(d)}"  # this host's own numbering
                 for d in self.mesh.devices.flat],
        replicas_per_host=self.replicas_per_host, num_params=self.num_params,
        model=self.model_cfg.module or self.model_cfg.family, attention=self.attention,
        flops_per_token=self.flops_per_token, num_rounds=self.num_rounds, inner_steps=self.h,
        tokens=self.tokens_per_step * self.num_rounds * self.h, floor=self.spec.floor,
        unigram=self.spec.unigram_loss,
        storage=None if self.num_hosts == 1 else "one shared workdir" if self.shared_storage
        else "a workdir per host (each keeps its own checkpoints)")

  def write_run_json(self) -> None:
    """Host 0: the step's memory line and run.json."""
    metrics.print_memory(self.step_memory, self.mesh)
    metrics.write_run_json(self.workdir, self.config, hosts=self.num_hosts,
                           devices=self.mesh.devices.flat, num_params=self.num_params,
                           flops_per_token=self.flops_per_token,
                           tokens_per_step=self.tokens_per_step, peak_flops=self.peak_flops,
                           memory=self.step_memory,
                           layout=self.train_step.layout.describe(), start=self.start,
                           balance=self.pacer.describe(), attention=self.attention,
                           init_from=self.init_source())

  def start_from_pretrained(self) -> None:
    """The anchor and every replica from `config.model.init_from`'s weights: the same
    files on every host, the same anchor."""
    params = pretrained.params(self.config.model.init_from, self.model_cfg)
    self.outer = self.replicas = None  # the placeholders go first: one copy at a time
    anchor = jax.device_put(params, self.exchange.host_device)
    self.outer = self.outer_step.init(anchor)
    self.replicas = self._init_replicas(anchor)

  def init_source(self) -> dict | None:
    """`config.model.init_from`'s directory and the sha256 of its files (None: none)."""
    if self.config.model.init_from and self._init_source is None:
      try:
        self._init_source = pretrained.source(self.config.model.init_from)
      except (OSError, pretrained.PretrainedError):  # resumed: its weights may be gone
        self._init_source = {"path": self.config.model.init_from, "sha256": None}
    return self._init_source

  def snapshot(self, r: int, finished: bool = False) -> store.Snapshot:
    """Everything needed to continue after round r (after its outer step); `finished`:
    after the last round, with what was in flight applied (the final model)."""
    shared, own = self.outer_step.split(self.outer)
    return self._snapshot(r, shared, own, finished, bool(self.outer.inflight))

  def _snapshot(self, r, shared, own, finished, inflight) -> store.Snapshot:
    own = {"replicas": self.replicas,
           "data": store.encode_json(self.data.get_state()), **own}
    meta = {"round": r, "finished": finished, "inflight": inflight, "mode": self.config.mode,
            "num_hosts": self.num_hosts, "replicas_per_host": self.replicas_per_host,
            "data_state": self.data.get_state(),  # host 0's (meta is written by host 0)
            "run_id": self.run_id, "balance": self.pacer.state(),
            "config": self.config.to_dict(), "diloco_jax": __version__,
            "jax": jax.__version__, "saved_at": time.time()}
    return store.Snapshot(r, shared, own, meta)

  def _check_checkpoint(self, meta: dict) -> None:
    store.check_compatible(
        meta, self.config, num_hosts=self.num_hosts, replicas_per_host=self.replicas_per_host,
        where=f"checkpoint {meta['round']} in {self.checkpointer.directory}")
