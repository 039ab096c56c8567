"""A host joins a live job at a round boundary; no member stops, and none waits for it.

A host started while the job runs (a restarted id, its disk wiped or not, or a new id) finds
itself pending at the coordinator (`membership/lease.py`): it builds everything it needs,
rehearses a round's end alone (`rehearse`), then registers again, ready, and waits. Each
member's sums carry whether it has seen a host waiting (`membership.manager.LiveReplicas`),
so every member learns it from the same sum and, at the end of the same round r, all of
them run `admit`: each copies its state after round r to host memory and queues, on the
dispatch thread, behind whatever is in flight (a sum of the async modes arrives first),

  1. the boundary op (`EpochCollective.boundary`), whose commit admits the waiting hosts
     into a new epoch;
  2. the transfer op (`EpochCollective.transfer`): the lowest member that was there sends
     each joiner, point to point, the run's state after round r in the one encoding of a
     checkpoint (`loop/state.py`'s snapshot; checkpoints/files.py: meta.json and
     safetensors files, each with its sha256): the shared outer state, in eager mode the
     sender's first replica's own outer state (`own`), and each sum in flight as it
     arrived (`arrived`: the means; meta.json its round, loss, flags and riders). If the
     sender dies mid-way the members left send it again from the lowest of them; if a
     joiner dies, the op is redone without it.

and trains round r+1 meanwhile: its sums queue behind the transfer. Round r+1 is the
joiners' catch-up round (docs/algorithms.md §11): they train no step in it and send zeros
that no mean counts (`wire.exchange.Exchange.idle`), so its means are the members' alone;
they apply its outer step like every member and train from round r+2.

The joiner (`receive`) checks meta.json's own sha256 and every file against it, its config
against meta.json's and the shared state against its fingerprint, and restores the state
(`state.restore`) as a host without rows of its own (docs/algorithms.md, "A host that
joins"):
  - the outer state is the shared one; its replicas start from the anchor with fresh AdamW
    moments at the run's step count after round r+1 (eager: every replica takes the
    sender's θ_m, b_m and Δ_m,prev, so that its delayed correction cancels the sender's
    fresh term as the sender's own does); the pacer's decisions are the sender's;
  - a sum that was in flight arrives on the joiner too, as it arrived on the members (the
    second sync of the async protocol): the joiner had no part in it, applies its mean like
    every member, and its own Δ of that round is zero;
  - its data iterators take the sender's position (every replica has read as many batches
    of its own shard): what its shard holds between the position where the host stopped
    and this one is not read in this pass.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import types
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import units
from diloco_jax.algo import state as algo_state
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import store
from diloco_jax.loop import parts as parts_lib
from diloco_jax.loop import rounds
from diloco_jax.loop import state as state_lib
from diloco_jax.membership import collective as collective_lib
from diloco_jax.runtime import collector
from diloco_jax.runtime import hostmem
from diloco_jax.wire import exchange as exchange_lib


def admit(parts: parts_lib.Parts, state: state_lib.RunState, r: int) -> None:
  """A member, at the end of round r when a host waits to join (module docstring): the
  state is copied to host memory now (round r+1 replaces it), and the boundary and the
  transfer are queued on the dispatch thread; round r+1 trains meanwhile."""
  collective, exchange = parts.sync.collective, parts.sync.exchange
  held = _hold(parts, state, r)

  def join_op() -> None:
    t = time.perf_counter()
    admitted = collective.boundary()
    if not admitted:
      return  # the waiting host left, or was admitted by an earlier boundary
    exchange.idle(r + 1, admitted)  # they catch up in round r+1: in its sums from r+2
    sent = {}

    def message() -> list[bytes]:
      sent["parts"] = _encode(parts, held)
      return sent["parts"]

    def fingerprint() -> str:  # every member's, for the joiner to check the source's against
      return algo_state.fingerprint(held.snap.shared)
    source, _, _ = collective.transfer(admitted, message, fingerprint)
    if parts.prints:
      size = (f"state {units.format_bytes(sum(len(p) for p in sent['parts']))} " if sent
              else "state ")
      print(f"host(s) {list(admitted)} joined at round {r}: {size}from host {source} in "
            f"{time.perf_counter() - t:.1f} s", flush=True)
  parts.dispatcher.submit(join_op, round_=r, what="admitting the hosts waiting to join")


class _Held(NamedTuple):
  """A member's state after round r in host memory, for a joiner: the snapshot of
  `state_lib.snapshot` (shared tree and, in eager mode, the first replica's own outer
  state, as numpy) and the sums in flight (their futures: they arrive before the transfer
  runs, on the same thread)."""
  snap: store.Snapshot
  own_outer: Any
  inflight: tuple


def _hold(parts: parts_lib.Parts, state: state_lib.RunState, r: int) -> _Held:
  outer = state.outer
  snap = state_lib.snapshot(parts, state.replace(outer=outer._replace(inflight=())), r)
  own = None
  if "outer" in snap.own:  # eager: per-replica outer state; the sender's first replica's
    own = jax.tree.map(lambda x: np.array(np.asarray(x)[:1]), snap.own["outer"])
  shared = jax.tree.map(lambda x: np.array(x), snap.shared)  # a copy: never donated
  return _Held(dataclasses.replace(snap, shared=shared, own={}), own, outer.inflight)


def message_of(parts: parts_lib.Parts, state: state_lib.RunState, r: int) -> list[bytes]:
  """What a member sends a joiner after round r: meta.json, then its files by name."""
  return _encode(parts, _hold(parts, state, r))


def _encode(parts: parts_lib.Parts, held: _Held) -> list[bytes]:
  arrived = [p.future.result() for p in held.inflight]  # queued before the transfer
  snap = held.snap
  items = {"shared": snap.shared}
  if held.own_outer is not None:
    items["own"] = {"outer": held.own_outer}
  if arrived:
    items["arrived"] = {"means": [a.mean for a in arrived]}
  blobs, records = {}, {}
  for item, tree in items.items():
    name = files.filename(item)
    blobs[name], records[name] = files.encode(jax.tree.map(np.asarray, tree))
  meta = {**snap.meta, "format": files.FORMAT, "host": parts.host, "files": records,
          "shared_sha256": algo_state.fingerprint(snap.shared),
          "arrived": [{"round": a.round, "key": a.key, "loss_sum": a.loss_sum,
                       "bad_K": np.asarray(a.bad_K).tolist(), "replicas": a.replicas,
                       "aggregation": a.aggregation, "tolerated": a.tolerated,
                       "riders": {name: {word: np.asarray(x).tolist()
                                         for word, x in words.items()}
                                  for name, words in a.riders.items()}} for a in arrived]}
  return [files.meta_bytes(meta), *(blobs[name] for name in sorted(blobs))]


def rehearse(parts: parts_lib.Parts, state: state_lib.RunState) -> None:
  """A joiner, before it says it is ready: an inner step, the end of a round (two in the
  async modes, whose sum is applied a round late; streaming's fragments at their steps),
  the fresh replicas of a restore and, if it will be the lowest live host, an eval, on its
  placeholder state (consumed: the members' replaces it), with this host alone. Every
  program these compile on first use (the Δ, the sum's local parts in the job's wire
  format, the outer update, the loss sum, fresh replicas, the eval) is then compiled
  before the members would wait for it at its first sum: on configs/tiny.py under a
  0.36-core quota, a new host's first round held every member 5-6 s (bench/churn.py)."""
  driver, exchange, h = parts.sync.driver, parts.sync.exchange, parts.h
  alone = collective_lib.Rehearsal(parts.sync.collective, parts.world.lease.address)
  real, exchange.collective = exchange.collective, alone
  try:
    outer, replicas = state.outer, state.replicas
    # an inner step on a batch of zeros: its first run is slower than the next (on CPU,
    # 3x a steady round's steps), and the members would wait for it at its first sum
    step = parts.model.inner
    replicas, loss_R = step(replicas, np.zeros(step.batch_shape, np.int32))
    # The rounds a joiner meets, each with programs of its own (jit keys them by the
    # arguments' shardings and by which are None): its catch-up round, whose mean counts
    # only the members' replicas (an int32 K), then trained rounds, whose mean, in a whole
    # job, counts all K (the static K). The async modes apply each mean a round later.
    exchange.count_all([2])
    catch_up = step.no_losses(parts.replicas_per_host)
    for r in (1, 2, 3) if driver.asynchronous else (1, 2):
      for i in range(h - 1):
        update = driver.after_step(outer, replicas, (r - 1) * h + i + 1, r)
        outer, replicas = update.outer, update.replicas
      losses = jnp.sum(jnp.stack([catch_up if r == 1 else loss_R] * h))
      update = driver.end_round(outer, replicas, losses, r)
      outer, replicas = update.outer, update.replicas
    for pending in outer.inflight:
      pending.future.result()
    if parts.host < min(parts.world.lease.epoch.hosts, default=parts.host + 1):
      # it will print and evaluate (the lowest live host): the members would wait at the
      # sum after its first eval (on CPU, the eval's compile is half of this rehearsal)
      parts.model.eval_step.compile(driver.model(outer, replicas), parts.model.eval_batches)
    parts.model.init_replicas(driver.model(outer, None))  # the restore's fresh replicas
  except Exception as e:  # noqa: BLE001 -- a start that compiles later is no failure
    print(f"host {parts.host}: WARNING: the rehearsal of a round failed ({type(e).__name__}: "
          f"{e}); its first round compiles what it needs", flush=True)
  finally:
    parts.dispatcher.recover()  # every job it queued (Δ diagnostics) has run
    exchange.collective = real
    exchange.count_all([])
    alone.close()


def receive(parts: parts_lib.Parts, state: state_lib.RunState,
            compiled: bool = False) -> state_lib.RunState:
  """The joiner: waits to be admitted, takes the members' state, and returns the state it
  continues from (the round the members ended with `admit`). `compiled`: it has run rounds
  in this process (`again`): nothing to `rehearse`."""
  world = parts.world
  collective = parts.sync.collective
  t, phases = time.perf_counter(), parts.reporting.start_phases
  if not compiled:  # start-up's one-off programs dropped first (the trainer keeps these)
    jax.clear_caches()
    rehearse(parts, state)
    collector.settled()  # here, not once the members wait for it
    hostmem.trim()  # what compiling freed: here, not once the members wait (0.05 s)
    phases.done("rehearse")
  world.lease.join()
  collective.admitted()
  if not compiled:
    phases.done("admitted")  # registered ready, and the members' boundary
  source, got, held = parts.dispatcher.run(collective.transfer, (world.host,), None,
                                           what="receiving the run's state")
  seconds = time.perf_counter() - t
  where = f"the state host {world.host} received from host {source}"
  state, r = restore_message(parts, state, [bytes(p) for p in got], where, held)
  # It catches up in round r+1 (no inner steps, no part in its sums) and trains from r+2
  # with the members' step count then, so that its learning rate is theirs.
  parts.sync.exchange.idle(r + 1, (world.host,))
  state = state.replace(replicas=state.replicas.replace(opt_state=algo_state.with_step_count(
      state.replicas.opt_state, parts.sync.pacer.steps_done(r + 1))))
  size = sum(len(p) for p in got)
  joined = {"round": r, "source": source, "bytes": size, "seconds": round(seconds, 3)}
  state = rounds.reschedule(parts, state.replace(
      start={"round": r, "storage": "per_host", "joined": joined}))
  print(f"host {world.host} joined at round {r}: state {units.format_bytes(size)} from "
        f"host {source} in {seconds:.1f} s", flush=True)
  if state.outer.inflight:  # its figures arrive with it, as after a resume
    rounds.open_record(parts, r, resumed=True, round_time=0.0, tokens_per_sec=0.0,
                       elapsed=0.0, eta=0.0)
  return state


def again(parts: parts_lib.Parts, state: state_lib.RunState,
          dropped: BaseException) -> state_lib.RunState:
  """A member dropped from a job that goes on (`lease.Dropped`: frozen or cut off past its
  lease) joins it again in this process, as a host started late would: its ops in flight
  have failed, its open rounds are the members' to record, and it continues from the
  state they send (its compiled programs, data and connections kept)."""
  print(f"{dropped}; it joins the job again", flush=True)
  parts.dispatcher.recover()
  parts.sync.collective.rejoin()
  parts.world.lease.rejoin()
  parts.sync.membership.join_due()  # what the sums said before: not this host's to act on
  parts.reporting.log.forget()
  return receive(parts, state, compiled=True)


def restore_message(parts: parts_lib.Parts, state: state_lib.RunState, got: list[bytes], where: str,
                    held: list[str] | None = None) -> tuple[state_lib.RunState, int]:
  """The state a joiner continues from, out of a member's `message_of`, each part checked
  first; a part changed on the way is refused with one line naming it (sha256). `held`:
  every member's fingerprint of the shared state it holds; the one received must be a
  strict majority's, so that one member (the sender) cannot hand a joiner a state of its
  own."""
  if not got:
    raise store.CheckpointError(f"{where}: nothing came")
  meta = files.load_meta(got[0], f"{where} ({files.META})")
  names = sorted(meta["files"])
  if len(names) != len(got) - 1:
    raise store.CheckpointError(f"{where}: {len(got) - 1} files, meta.json lists "
                                f"{len(names)}")
  blobs = dict(zip(names, got[1:]))
  for name, data in blobs.items():
    files.check(data, meta["files"][name], f"{where} ({name})")
  store.check_compatible(meta, parts.config, num_hosts=parts.num_hosts,
                         replicas_per_host=parts.replicas_per_host, where=where)
  r = int(meta["round"])
  like = _like(parts, state, len(meta["arrived"]))

  def tree(item: str):
    name = files.filename(item)
    return files.to_tree(blobs[name], like[item], meta["files"][name], f"{where} ({name})")
  shared = tree("shared")
  digest = algo_state.fingerprint(shared)
  if digest != meta["shared_sha256"]:
    raise store.CheckpointError(f"{where}: its shared state is not the one the sender "
                                "hashed: not used")
  if held is not None and 2 * held.count(digest) <= len(held):
    raise store.CheckpointError(
        f"{where}: its shared state (sha256 {digest[:16]}...) is held by {held.count(digest)} "
        f"of the {len(held)} members, not a majority: not used")
  own = None
  if "own" in like:  # eager: every replica takes the sender's first replica's own state
    own = {"outer": own_for_joiner(tree("own")["outer"], parts.replicas_per_host)}
  means = tree("arrived")["means"] if meta["arrived"] else []

  def inflight(outer, replicas):
    return tuple(_arrived(parts, outer, replicas, saved, mean)
                 for saved, mean in zip(meta["arrived"], means))
  snap = store.Snapshot(r, shared, own, meta)
  return state_lib.restore(parts, state, snap, inflight=inflight), r


def own_for_joiner(sent_own, replicas: int):
  """Eager (docs/algorithms.md §11): each of a joiner's `replicas` takes the sender's first
  replica's own outer state (θ_m, b_m, Δ_m,prev), a tree with a leading replica axis."""
  return jax.tree.map(lambda x: np.repeat(np.asarray(x)[:1], replicas, axis=0), sent_own)


def _like(parts: parts_lib.Parts, state: state_lib.RunState, arrived: int) -> dict:
  """The shapes of the files (zeros: `state`'s values are not read, and a host dropped
  mid-round holds arrays its failed round consumed): the shared state, in eager mode one
  replica's own outer state, and each arrived mean (a Δ without its replica axis)."""
  def zeros(x, shape=None):
    return np.zeros(np.shape(x) if shape is None else shape, x.dtype)
  shared, own = parts.sync.driver.split(state.outer._replace(inflight=()))
  like = {"shared": jax.tree.map(zeros, shared)}
  if "outer" in own:
    like["own"] = {"outer": jax.tree.map(lambda x: zeros(x, (1, *np.shape(x)[1:])),
                                         own["outer"])}
  if arrived:
    sent = jax.eval_shape(parts.sync.driver.sent_at_boundary, state.replicas.params)
    mean = jax.tree.map(lambda x: zeros(x, np.shape(x)[1:]), sent)
    like["arrived"] = {"means": [mean for _ in range(arrived)]}
  return like


def _arrived(parts: parts_lib.Parts, outer, replicas, saved: dict, mean) -> exchange_lib.Pending:
  """A sum in flight at the join, as it arrived on the members: a finished `Pending` into
  which this host put nothing (a zero Δ, every replica finite)."""
  key = int(saved["key"])
  residual = outer.residuals.get(key)
  # Its Δ and the mean of the kinds a sum's are (in host memory, as the exchange holds
  # them): the programs that take them (the Δ figures, the outer update) are then those
  # it compiled in its rehearsal.
  sent = parts.sync.driver.sent_at_boundary(replicas.params)
  zeros = jax.device_put(jax.tree.map(lambda x: np.zeros(np.shape(x), np.float32), sent),
                         parts.sync.exchange.host_device)
  riders = types.MappingProxyType({name: {word: np.asarray(x, np.float32)
                                          for word, x in words.items()}
                                   for name, words in saved["riders"].items()})
  future = concurrent.futures.Future()
  future.set_result(exchange_lib.Arrived(
      int(saved["round"]), key, parts.sync.exchange.arrived_mean(mean),
      np.asarray(saved["bad_K"], bool), float(saved["loss_sum"]), residual, 0.0, 0, 0,
      riders=riders, replicas=int(saved["replicas"]), aggregation=str(saved["aggregation"]),
      tolerated=int(saved["tolerated"])))
  return exchange_lib.Pending(int(saved["round"]), key, zeros, np.float32(0),
                              np.ones(parts.replicas_per_host, bool), residual, future)
