"""The inner train step, knowing nothing about DiLoCo, and its jitted multi-replica forms.

`make_train_step` is one replica's plain optimizer step (with gradient accumulation).
`ReplicaStep` maps it over this host's replicas and jits it over the host's local mesh
(`mesh.Layout`): replicas over the `replica` device groups, the batch over `data` and
`fsdp`, params and optimizer state sharded over `fsdp`, so XLA's collectives stay within
a replica's devices and never reach another host. `EvalStep` evaluates one set of params
(`modes/ddp.py` has the data-parallel baseline's step).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_jax import compile_cache
from diloco_jax.algo import state as state_lib
from diloco_jax.algo.step import LossFn
from diloco_jax.algo.step import Params
from diloco_jax.algo.step import make_train_step
from diloco_jax.device import mesh as mesh_lib

local_mesh = mesh_lib.local_mesh  # where the inner step runs


def compiler_options(mesh: Mesh) -> dict[str, str] | None:
  """XLA options for the inner step's programs on `mesh`: on CPU, the scheduler that
  orders the program for the fewest live bytes rather than for running independent ops
  side by side: it plans fewer temporary bytes per step (the start-up line's "XLA's
  plan"), with the same bits and, on the CPUs this was checked on, the same step time
  within noise (`python -m bench.overhead`). None (XLA's defaults) elsewhere: GPU and
  TPU have schedulers of their own."""
  if mesh.devices.flat[0].platform != "cpu":
    return None
  return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def map_replicas(step):
  """Runs `step` over the leading replica axis of every argument, one replica at a time.

  `lax.map` rather than `vmap`: each replica runs exactly the program of a single replica
  (the same shapes, so the same rounding as one replica on its own host), activations are
  alive for one replica at a time, and on CPU it is faster than vmap over several tiny
  replicas, whose batched matmuls have poor cache use. One replica is run without the
  loop (the same result, bit for bit, without the loop's overhead: bench/overhead.py).
  """
  def run(*args):
    if jax.tree.leaves(args)[0].shape[0] == 1:
      return jax.tree.map(lambda x: x[None], step(*jax.tree.map(lambda x: x[0], args)))
    return jax.lax.map(lambda a: step(*a), args)
  return run


def map_replica_groups(step, groups: int):
  """`map_replicas(step)` on each of `groups` device groups side by side: [R, ...] is
  reshaped to [groups, R / groups, ...] (R is split over the `replica` mesh axis in
  contiguous blocks, so this moves no data) and the groups are vmapped over that axis,
  which XLA partitions over the groups' devices."""
  if groups == 1:
    return map_replicas(step)
  mapped = jax.vmap(map_replicas(step), spmd_axis_name=mesh_lib.REPLICA_AXIS)

  def run(*args):
    split = jax.tree.map(lambda x: x.reshape(groups, x.shape[0] // groups, *x.shape[1:]),
                         args)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), mapped(*split))
  return run


class Step:
  """What every jitted inner step over the local mesh shares: the shardings, a trace
  counter (tests use it to catch retracing), and a count of finished steps.

  `steps_finished()` tells how many steps the devices have finished, without waiting:
  `exchange` reads it on the dispatch thread around each collective, to report how many
  inner steps ran while the sum was in flight.
  """

  def __init__(self, mesh: Mesh):
    self.traces = 0
    self.layout = mesh_lib.Layout(mesh)
    self.batch_sharding = self.layout.batch  # [R, B, L+1]
    self._block = _must_block(mesh)
    self._lock = threading.Lock()
    self._running: collections.deque = collections.deque()  # losses of unfinished steps
    self._finished = 0

  def state_shardings(self, state: state_lib.ReplicaState) -> Any:
    """The shardings the step takes and returns `state` (or its shapes) with."""
    return self.layout.replicas(state)

  def place(self, state: state_lib.ReplicaState) -> state_lib.ReplicaState:
    """Puts a state on the mesh as the step expects it."""
    return jax.device_put(state, self.state_shardings(state))

  def init_replicas(self, optimizer: optax.GradientTransformation, params: Params,
                    num_replicas: int) -> state_lib.ReplicaState:
    """`num_replicas` replicas at `params` with fresh optimizer states, created sharded on
    the mesh (never whole on one device). Jitted once per Step."""
    if self._init is None:
      init = functools.partial(state_lib.init_replica_state, optimizer,
                               num_replicas=num_replicas)
      self._init = jax.jit(init, out_shardings=self.state_shardings(
          jax.eval_shape(init, params)))
    return self._init(jax.device_put(params, self.layout.params(params)))

  def no_losses(self, num_replicas: int) -> jax.Array:
    """The losses of a round this host trains no step in (a joiner's catch-up round):
    zeros placed where the step places its own, so that the round's loss sum runs the
    trained rounds' programs (jit keys a program by its arguments' shardings; unplaced
    zeros compiled two more, each time a host joined)."""
    return jax.device_put(np.zeros(num_replicas, np.float32), self.layout.per_replica)

  def __call__(self, state: state_lib.ReplicaState, batch_RxBxL1: np.ndarray):
    out = self._run(state, jax.device_put(batch_RxBxL1, self.batch_sharding))
    if self._block:
      out = jax.block_until_ready(out)
    with self._lock:
      self._running.append(out[1])
    self.steps_finished()  # drops what is done: the queue holds only unfinished steps
    return out

  def steps_finished(self) -> int:
    with self._lock:
      while self._running and self._running[0].is_ready():
        self._running.popleft()
        self._finished += 1
      return self._finished

  def _run(self, state, batch):
    if self._compiled is None:  # not compiled ahead (`compile`): on its first call
      self._compiled = self._jit(state)
    return self._compiled(state, batch)

  def _jit(self, state):
    """The step jitted for a state of this structure and shapes."""
    raise NotImplementedError

  _compiled = None
  _init = None

  def compile(self, state: state_lib.ReplicaState, batch_shape: tuple[int, ...],
              spec: Any = None) -> dict[str, int] | None:
    """Compiles the step for `state` and int32 batches of `batch_shape` before its first
    call, which then runs this executable (compiling is not paid twice), and returns what
    XLA says one device holds while it runs (`memory_per_device`).

    `spec`: what this step's function was built from (the caller's config: the loss, the
    optimizer, accumulation). With it the executable is kept whole and a start that
    finds it runs it without a trace (compile_cache.py), keyed by `spec`, this
    step's kind and mesh, and the arguments' shapes and shardings."""
    self.batch_shape = batch_shape  # what a batch of this run is (a rehearsal's zeros)
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=self.batch_sharding)
    if spec is None:
      self._compiled = self._jit(state).lower(state, batch).compile()
      return memory_per_device(self._compiled)
    key = {"step": type(self).__qualname__, "spec": spec, "mesh": repr(self.layout.mesh),
           "arguments": repr(jax.tree.map(
               lambda s: (s.shape, s.dtype, s.sharding),
               (state, batch), is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))}
    found = compile_cache.compiled("inner_step", key,
                                   lambda: self._jit(state).lower(state, batch),
                                   devices=list(self.layout.mesh.devices.flat),
                                   facts=memory_per_device)
    self._compiled = found.program
    return found.facts


class ReplicaStep(Step):
  """The jitted inner step of all this host's replicas: ReplicaState, batch -> state, loss_R.

  Compiled once for the whole run, with the state's shardings in and out (so the next
  call takes its output as it is). On accelerators the state is donated, so no second
  copy of the params or optimizer state is ever alive. On CPU it is not
  (`donates_state`): there the donated step was slower, not faster. A replica's update
  is computed on [...]-shaped slices of the [R, ...] state (the program of one replica,
  for the same bits on every host layout), and to write it into the donated [R, ...]
  buffers XLA:CPU copies every state leaf first, on every step (bench/overhead.py shows
  the cost), for one extra state's worth of host memory saved.
  """

  def __init__(self, loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
               mesh: Mesh, grad_accum_steps: int = 1):
    super().__init__(mesh)
    self._loss_fn, self._grad_accum_steps = loss_fn, grad_accum_steps
    self._set_optimizer(optimizer)
    self.donates_state = mesh.devices.flat[0].platform != "cpu"

  def reschedule(self, optimizer: optax.GradientTransformation) -> None:
    """From the next call on, steps with `optimizer` (the same state structure: another
    learning-rate schedule), compiled on that call."""
    self._set_optimizer(optimizer)
    self._compiled = None

  def _set_optimizer(self, optimizer: optax.GradientTransformation) -> None:
    replica_step = map_replica_groups(
        make_train_step(self._loss_fn, optimizer, self._grad_accum_steps), self.layout.groups)

    def traced(state: state_lib.ReplicaState, batch_RxBxL1):
      self.traces += 1  # Runs at trace time only.
      params, opt_state, loss_R = replica_step(state.params, state.opt_state, batch_RxBxL1)
      return state_lib.ReplicaState(params=params, opt_state=opt_state), loss_R

    self._traced = traced

  def _jit(self, state):
    shardings = self.state_shardings(state)
    return jax.jit(self._traced, in_shardings=(shardings, self.batch_sharding),
                   out_shardings=(shardings, self.layout.per_replica),
                   donate_argnums=0 if self.donates_state else (),
                   compiler_options=compiler_options(self.layout.mesh))


def memory_per_device(compiled: jax.stages.Compiled) -> dict[str, int] | None:
  """Bytes one device holds while `compiled` runs, as XLA planned them: its arguments
  (params, optimizer state, the batch), outputs and temporaries (activations, gradients),
  less the outputs written into donated arguments. None where the backend does not say."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  parts = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
           "temporaries": stats.temp_size_in_bytes, "aliased": stats.alias_size_in_bytes}
  return {"total": parts["arguments"] + parts["outputs"] + parts["temporaries"]
          - parts["aliased"], **parts}


def _must_block(mesh: Mesh) -> bool:
  # XLA:CPU can hang when steps over several CPU devices of one process are queued
  # without waiting (measured: 2 CPU devices in one process hung in 1/3 to 1/2 of runs);
  # waiting for each step there avoids it (0 hangs in 6).
  return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


class EvalStep:
  """Mean loss of one set of params over fixed held-out batches [E, B, L+1]."""

  def __init__(self, loss_fn: LossFn, *, mesh: Mesh):
    self.traces = 0

    def traced(params, batches_ExBxL1):
      self.traces += 1
      return jnp.mean(jax.lax.map(lambda b: loss_fn(params, b), batches_ExBxL1))

    layout = mesh_lib.Layout(mesh)
    self.batch_sharding = layout.eval_batch  # [E, B, L+1]: B split
    # The params come as the outer step places them (`Layout.params`).
    self._eval = jax.jit(traced, out_shardings=layout.replicated)

  def __call__(self, params, batches_ExBxL1):
    return self._eval(params, batches_ExBxL1)

  def compile(self, params, batches_ExBxL1) -> None:
    """Compiles the eval for these arguments' shapes without running it (the next call
    finds it compiled)."""
    self._eval.lower(params, batches_ExBxL1).compile()

  def put(self, batches_ExBxL1: np.ndarray) -> jax.Array:
    """Places the eval batches on the devices once, for the whole run."""
    return jax.device_put(batches_ExBxL1, self.batch_sharding)
