"""What the round loop asks of a mode: the `Driver` protocol and the values it passes.

Every mode's driver (`outer.OuterStep` for sync, delayed and eager over a `diloco` rule,
`streaming.StreamingOuterStep`, `ddp.DDPRound`) is looked up by name in `registry.py`
and used only through the members declared here, by the round loop (`loop/trainer.py`),
a host that starts from the shared state (`membership/manager.py`, `loop/join.py`) and the
reader of a run's model (`readback/trained.py`). Every call of a running driver returns new values (an `Update`, an
`Outer`), never a mutation of what it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_jax.algo import state as state_lib
from diloco_jax.algo import step as step_lib
from diloco_jax.device import inner
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.modes import skips
from diloco_jax.wire import dispatch
from diloco_jax.wire import exchange as exchange_lib

Params = Any
# read(items) -> {item: numpy tree} of a checkpoint read in one process (orbax gives
# dataclasses and tuples back as dicts and lists). "shared": the driver's shared tree of
# `split`; "hosts": every host's own tree of `split`, each leaf [hosts, ...], beside the
# loop's "replicas" (the ReplicaState, [hosts, R, ...]) and "data".
Read = Callable[[tuple[str, ...]], dict]


class Outer(NamedTuple):
  """What the outer step carries from round to round.

  Attributes:
    state: the mode's outer state on the host (a rule's state; streaming: one OuterState
      per fragment; ddp: None).
    skips: the NaN-skip counters (checkpointed with the state).
    residuals: error feedback per fragment, this host's ({} without feedback).
    inflight: the sums still in flight (exchange.Pending), oldest first.
  """
  state: Any
  skips: state_lib.SkipCounters
  residuals: dict[int, np.ndarray]
  inflight: tuple[exchange_lib.Pending, ...] = ()


class Update(NamedTuple):
  """What one call of a driver returns. `times`: the main thread's seconds in it, by part
  (outer_d2h, outer_mean, outer_update, outer_h2d); `synced`: the sums that arrived."""
  outer: Outer
  replicas: state_lib.ReplicaState
  times: dict[str, float]
  synced: tuple[skips.Synced, ...] = ()


class PseudoGradientHook(Protocol):
  """A tool's transform of this host's pseudo-gradients, the supported way to reach in
  (bench/poison.py replaces one replica's Δ with an attack).

  Called with Δ of every local replica ([R, ...] per leaf, on the host) once per send
  (streaming: once per fragment's send), before the NaN check and the exchange, so what
  it returns is what the other hosts receive and what the NaN policy judges. `round_`:
  the round the Δ belongs to; `fragment`: streaming's fragment (0 in the other modes).
  Not called in mode 'ddp', which has no pseudo-gradients.
  """

  def __call__(self, deltas_R: Params, *, round_: int, fragment: int) -> Params:
    ...


class Trait(NamedTuple):
  """A yes or no about a mode, with the reason its errors give (`why`: for a yes or a
  no, whichever is the exception). Truthy when yes."""
  yes: bool
  why: str = ""

  def __bool__(self) -> bool:
    return self.yes


class Driver(Protocol):
  """A mode's outer step on one host, and what the mode says before a run exists.

  The traits are class attributes, read before a run exists by those that must not ask a
  mode by its name: config validation, the planner, `simulate`, the resume of a checkpoint
  written by other hosts, and the loop's build.

  Attributes:
    asynchronous: a round's mean is applied one round late, its sum hidden behind the
      next inner phase (delayed, eager).
    per_step: the hosts sum gradients at every inner step: one set of params, no
      pseudo-gradients, nothing encoded on the wire (ddp). Its hosts run on
      jax.distributed; every other mode's have live membership (`membership/start.py`).
    fragments: it syncs fragments of the model mid-round (streaming); config.outer's
      fragment fields apply to it alone.
    carries_pace: one sum per round, which can carry each host's inner steps and seconds
      (balance 'speed'); `why` says why not.
    needs_own_rows: a replica cannot start from the anchor, so a checkpoint resumes only
      with the rows of the hosts that wrote it; `why` says why.
    needs_mean: refuses robust aggregation; `why` says why.
    departure: how far its math departs from plain (sync) DiLoCo: 0 the same or a
      baseline, more for applying means later (the planner's recommendation keeps it small).
    param_sets: the sets of params the inner step holds on this host (R; ddp: 1).
  """
  asynchronous: bool
  per_step: bool
  fragments: bool
  carries_pace: Trait
  needs_own_rows: Trait
  needs_mean: Trait
  departure: int
  param_sets: int

  # The mode, before a run: looked up on the class.

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, *, mesh: Mesh,
                  exchange: exchange_lib.Exchange, params: Params,
                  pseudo_gradient_hook: PseudoGradientHook | None = None) -> Driver:
    """This host's driver of `config.mode` (`params`: the model's param shapes)."""
    ...

  @staticmethod
  def inner_step(loss_fn: step_lib.LossFn, optimizer: optax.GradientTransformation, *,
                 mesh: Mesh, grad_accum_steps: int, collective: Any,
                 dispatcher: dispatch.Dispatcher, num_replicas: int) -> inner.Step:
    """The inner step this mode's replicas take."""
    ...

  @staticmethod
  def memory_profile(config: ml_collections.ConfigDict) -> mesh_lib.MemoryProfile:
    """What a run of `config` holds besides the model, for `mesh.check_memory`."""
    ...

  @classmethod
  def trained_params(cls, config: ml_collections.ConfigDict, meta: dict, template: Params,
                     read: Read) -> Params:
    """The params a run evaluates (numpy, in `template`'s tree), from a checkpoint."""
    ...

  # A run: the round loop's calls, in the order it makes them.

  def init(self, anchor: Params) -> Outer:
    """The carry before round 1, from the initial anchor (on the host)."""
    ...

  def after_step(self, outer: Outer, replicas: state_lib.ReplicaState, step: int,
                 round_: int) -> Update:
    """After inner step `step` of round `round_`, before its last (streaming's syncs)."""
    ...

  def end_round(self, outer: Outer, replicas: state_lib.ReplicaState, loss_sum: jax.Array,
                round_: int) -> Update:
    """The round's outer step; `loss_sum`: this host's losses of the round, summed."""
    ...

  def drain(self, outer: Outer, replicas: state_lib.ReplicaState) -> Update:
    """After the last round: what is still in flight arrives and is applied."""
    ...

  def final(self, outer: Outer, replicas: state_lib.ReplicaState) -> Params:
    """The trained params on the local devices (eager: the mean over all K replicas)."""
    ...

  def model(self, outer: Outer, replicas: state_lib.ReplicaState | None) -> Params:
    """The params to evaluate during the run, on the local devices (replicas None: a
    host rejoining from the shared state alone)."""
    ...

  def replicated(self, outer: Outer, replicas: state_lib.ReplicaState) -> Any:
    """What must be identical on every host after every outer step (hashed and compared)."""
    ...

  def split(self, outer: Outer) -> tuple[dict, dict]:
    """(shared, own) trees of the carry for a checkpoint at a round boundary."""
    ...

  def split_like(self, outer: Outer, replicas: state_lib.ReplicaState,
                 inflight: bool) -> tuple[dict, dict]:
    """The structure of `split`, with a sum in flight if `inflight` (for restoring)."""
    ...

  def join(self, shared: dict, own: dict | None) -> Outer:
    """The carry of a checkpoint's trees, its sum in flight issued again (own None: a
    host that was away starts from the shared state)."""
    ...


def fill(template: Any, raw: Any) -> Any:
  """`template`'s tree with the leaves found at the same paths in `raw`, a tree `Read`
  returns (orbax gives dataclasses and tuples back as dicts and lists)."""
  def find(path, _):
    node = raw
    for key in path:
      node = node[getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))]
    return np.asarray(node)
  return jax.tree_util.tree_map_with_path(find, template)


def host_rows(tree: Any) -> Any:
  """[hosts, R, ...] -> [K, ...]: every replica of every host, host-major."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)
