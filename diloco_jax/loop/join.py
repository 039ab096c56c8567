"""A host joins a live job at a round boundary; no member stops.

A host started while the job runs (a restarted id, its disk wiped or not, or a new id) finds
itself pending at the coordinator (`membership/lease.py`): it builds everything it needs, then
registers again, ready, and waits. Each member's sums carry whether it has seen a host
waiting (`membership.LiveReplicas`), so every member learns it from the same sum and, at the
end of the same round r, all of them run `admit`:

  1. the boundary op (`EpochCollective.boundary`), which the dispatch thread runs after
     whatever is in flight: a sum of the async modes arrives first, so the round after a
     join does not overlap its sum (what a join costs the members, with the transfer);
     its commit admits the waiting hosts into a new epoch;
  2. the transfer op (`EpochCollective.transfer`): the lowest member that was there sends
     each joiner, point to point, a header (JSON: the round, the run's id, the data
     position, the steps done, the config, each sum in flight as it arrived, the sha256 of
     the body and the fingerprint of the shared state) and a body (safetensors: the shared
     outer state, each arrived mean, and in eager mode the sender's first replica's own
     state). If the sender dies mid-way the members left send it again from the lowest of
     them; if a joiner dies, the op is redone without it.

The joiner (`receive`) checks the body against the header's sha256, its config against the
header's and the shared state against its fingerprint, and starts where the members are
after round r (docs/algorithms.md, "A host that joins"):
  - the outer state is the shared one; its replicas start from the anchor with fresh AdamW
    moments at the run's step count (eager: every replica takes the sender's θ_m, b_m and
    Δ_m,prev, so that its delayed correction cancels the sender's fresh term as the
    sender's own does);
  - a sum that was in flight arrives on the joiner too, as it arrived on the members (the
    second sync of the async protocol): the joiner had no part in it, applies its mean like
    every member, and its own Δ of that round is zero;
  - its data iterators take the sender's position (every replica has read as many batches
    of its own shard): what its shard holds between the position where the host stopped
    and this one is not read in this pass.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import types

import jax
import numpy as np

from diloco_jax import units
from diloco_jax.algo import state as algo_state
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import store
from diloco_jax.loop import rounds
from diloco_jax.loop import state as state_lib
from diloco_jax.wire import exchange as exchange_lib

FORMAT = "diloco_jax.join/1"


def admit(parts, state: state_lib.RunState, r: int) -> state_lib.RunState:
  """A member, at the end of round r when a host waits to join (module docstring)."""
  collective = parts.collective
  t = time.perf_counter()
  admitted = parts.dispatcher.run(collective.boundary, round_=r, what="a round boundary")
  if not admitted:
    return state  # the waiting host left, or was admitted by an earlier boundary
  sent = {}

  def message() -> tuple[bytes, bytes]:
    sent["parts"] = _message(parts, state, r)
    return sent["parts"]
  source, _ = parts.dispatcher.run(collective.transfer, admitted, message, round_=r,
                                   what=f"sending the run's state to host(s) {list(admitted)}")
  if parts.prints:
    size = f"state {units.format_bytes(len(sent['parts'][1]))} " if sent else "state "
    print(f"host(s) {list(admitted)} joined at round {r}: {size}from host {source} in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
  return state


def _message(parts, state: state_lib.RunState, r: int) -> tuple[bytes, bytes]:
  """The sender's header and body (module docstring)."""
  outer = state.outer
  arrived = [p.future.result() for p in outer.inflight]  # the boundary op came after them
  shared, own = parts.driver.split(outer._replace(inflight=()))
  body = {"shared": shared, "means": [a.mean for a in arrived]}
  if "outer" in own:  # eager: per-replica outer state; the sender's first replica's
    body["own"] = jax.tree.map(lambda x: np.asarray(x)[:1], own["outer"])
  data, record = files.encode(jax.tree.map(np.asarray, body))
  header = {
      "format": FORMAT, "round": r, "run_id": state.run_id, "mode": parts.config.mode,
      "num_hosts": parts.num_hosts, "replicas_per_host": parts.replicas_per_host,
      "config": parts.config.to_dict(), "data_state": parts.data.get_state(),
      "steps_done": parts.pacer.steps_done(r), "balance": parts.pacer.state(),
      "shared_sha256": algo_state.fingerprint(shared), "body": record,
      "inflight": [{"round": a.round, "key": a.key, "loss_sum": a.loss_sum,
                    "bad_K": np.asarray(a.bad_K).tolist(), "replicas": a.replicas,
                    "riders": {name: {word: np.asarray(x).tolist() for word, x in words.items()}
                               for name, words in a.riders.items()}} for a in arrived]}
  return json.dumps(header, default=str).encode(), data


def receive(parts, state: state_lib.RunState) -> state_lib.RunState:
  """The joiner: waits to be admitted, takes the members' state, and returns the state it
  continues from (the round the members ended with `admit`)."""
  world = parts.world
  collective = parts.collective
  t = time.perf_counter()
  world.lease.join(timeout_s=max(600.0, parts.config.wire_timeout))
  collective.admitted()
  source, got = parts.dispatcher.run(collective.transfer, (world.host,), None,
                                     what="receiving the run's state")
  seconds = time.perf_counter() - t
  raw_header, body = bytes(got[0]), bytes(got[1])
  where = f"the state host {world.host} received from host {source}"
  header = _header(raw_header, where)
  files.check(body, header["body"], where)
  store.check_compatible(header, parts.config, num_hosts=parts.num_hosts,
                         replicas_per_host=parts.replicas_per_host, where=where)
  r = int(header["round"])
  like = _like(parts, state, header)
  tree = files.to_tree(body, like, header["body"], where)
  if algo_state.fingerprint(tree["shared"]) != header["shared_sha256"]:
    raise store.CheckpointError(f"{where}: its shared state is not the one the sender "
                                "hashed: not used")
  own = None
  if "own" in tree:  # eager: every replica takes the sender's first replica's own state
    own = {"outer": own_for_joiner(tree["own"], parts.replicas_per_host)}
  outer = parts.driver.join(tree["shared"], own)
  replicas = parts.init_replicas(parts.driver.model(outer, None))
  replicas = replicas.replace(opt_state=algo_state.with_step_count(
      replicas.opt_state, int(header["steps_done"])))
  parts.data.set_state(header["data_state"])
  outer = outer._replace(inflight=tuple(
      _arrived(parts, outer, replicas, saved, mean)
      for saved, mean in zip(header["inflight"], tree["means"])))
  parts.pacer.restore(header.get("balance"), same_world=True)
  joined = {"round": r, "source": source, "bytes": len(body) + len(raw_header),
            "seconds": round(seconds, 3)}
  state = rounds.reschedule(parts, state.replace(
      outer=outer, replicas=replicas, round=r, run_id=header["run_id"],
      start={"round": r, "storage": "per_host", "joined": joined}))
  print(f"host {world.host} joined at round {r}: state "
        f"{units.format_bytes(joined['bytes'])} from host {source} in {seconds:.1f} s",
        flush=True)
  if outer.inflight:  # its figures arrive with it, as after a resume
    rounds.open_record(parts, r, resumed=True, round_time=0.0, tokens_per_sec=0.0,
                       elapsed=0.0, eta=0.0)
  return state


def own_for_joiner(sent_own, replicas: int):
  """Eager (docs/algorithms.md §11): each of a joiner's `replicas` takes the sender's first
  replica's own outer state (θ_m, b_m, Δ_m,prev), a tree with a leading replica axis."""
  return jax.tree.map(lambda x: np.repeat(np.asarray(x)[:1], replicas, axis=0), sent_own)


def _header(raw: bytes, where: str) -> dict:
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise store.CheckpointError(f"{where}: its header is not JSON ({e})") from None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise store.CheckpointError(f"{where}: a header of another format than {FORMAT!r} (a "
                                "host of another diloco_jax version?)")
  return header


def _like(parts, state: state_lib.RunState, header: dict) -> dict:
  """The shapes of the body: the shared state, each arrived mean (a Δ without its replica
  axis) and, in eager mode, one replica's own state."""
  shared, own = parts.driver.split(state.outer._replace(inflight=()))
  sent = parts.driver.sent_at_boundary(state.replicas.params)
  mean = jax.tree.map(lambda x: np.zeros(np.shape(x)[1:], np.float32), sent)
  like = {"shared": shared, "means": [mean for _ in header["inflight"]]}
  if "outer" in own:
    like["own"] = jax.tree.map(lambda x: np.asarray(x)[:1], own["outer"])
  return jax.tree.map(np.asarray, like)


def _arrived(parts, outer, replicas, saved: dict, mean) -> exchange_lib.Pending:
  """A sum in flight at the join, as it arrived on the members: a finished `Pending` into
  which this host put nothing (a zero Δ, every replica finite)."""
  key = int(saved["key"])
  residual = outer.residuals.get(key)
  sent = parts.driver.sent_at_boundary(replicas.params)
  zeros = jax.tree.map(lambda x: np.zeros(np.shape(x), np.float32), sent)
  riders = types.MappingProxyType({name: {word: np.asarray(x, np.float32)
                                          for word, x in words.items()}
                                   for name, words in saved["riders"].items()})
  future = concurrent.futures.Future()
  future.set_result(exchange_lib.Arrived(
      int(saved["round"]), key, jax.device_put(mean, parts.exchange.host_device),
      np.asarray(saved["bad_K"], bool), float(saved["loss_sum"]), residual, 0.0, 0, 0,
      riders=riders, replicas=int(saved["replicas"])))
  return exchange_lib.Pending(int(saved["round"]), key, zeros, np.float32(0),
                              np.ones(parts.replicas_per_host, bool), residual, future)
