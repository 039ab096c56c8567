"""The run's state as it moves (loop/state.py): one encoding, checked on arrival, restored
whole. In one process, through the real `snapshot`, encoding and `restore`:

- a member's state after round 2 sent to a joiner (`join.message_of` ->
  `join.restore_message`): the joiner's step count, data positions, pacer state and, in
  eager mode, every replica's own outer state equal the sender's (its first replica's);
- one byte changed on the way, in any part of a join's message or of a heal's, is refused
  with one line that names the part and sha256;
- a store writes a checkpoint only once the round's record is written (`save(after=)`),
  whatever the store: decided by an event, not by timing.
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest

from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import per_host
from diloco_jax.checkpoints import shared_dir
from diloco_jax.checkpoints import store
from diloco_jax.loop import join
from diloco_jax.loop import state as state_lib
from diloco_jax.loop import trainer
from diloco_jax.membership import world as world_lib
from diloco_jax.models import model as model_lib
from diloco_jax.wire import collective as collective_lib
from diloco_jax.wire import dispatch
from tests.multihost import small_config
from tests.test_storage import FakeJob
from tests.test_storage import host_stores
from tests.test_storage import snapshot

# The pacer's state a sender had decided (balance 'speed'): from round 2 on, 6 steps.
PACE = {"decisions": [[1, [4]], [2, [6]]], "seconds": {}, "present": [0]}


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
  """An eager member after round 2 (2 replicas, balance 'speed' with the decisions of
  PACE), and what it sends a joiner: (its state, the message)."""
  root = tmp_path_factory.mktemp("sender")
  config = small_config(mode="eager", num_rounds=4, balance="speed")
  with dispatch.Dispatcher() as d:
    t = trainer.Trainer(config, str(root / "sender"), d)
    t.resume()
    t.run_round(1)
    t.run_round(2)
    t.state = t.state.replace(pace=PACE)
    message = join.message_of(t.parts, t.state, 2)
    state = t.state
    jax.block_until_ready(state.outer.state)
  return config, state, message


def changed(part: bytes, meta: bool) -> bytes:
  """`part` with one byte changed: meta.json's a digit of its round (it stays JSON, so
  only its sha256 can tell), a file's the byte in its middle."""
  out = bytearray(part)
  at = part.index(b'"round": ') + len(b'"round": ') if meta else len(part) // 2
  out[at] ^= 1
  return bytes(out)


def joiner(config, workdir):
  return trainer.Trainer(config, str(workdir), dispatch.Dispatcher())


def test_a_joiner_takes_the_senders_step_count_data_pacer_and_own_rows(sent, tmp_path):
  config, sender, message = sent
  t = joiner(config, tmp_path)
  try:
    state, r = join.restore_message(t.parts, t.state, message, "the state sent")
    assert r == 2 and state.round == 2 and state.run_id == sender.run_id
    # the pacer's decisions, and the step count of the run they give: 4 + 6 steps
    assert t.parts.sync.pacer.state()["decisions"] == PACE["decisions"] == state.pace["decisions"]
    counts = [np.asarray(x) for path, x in
              jax.tree_util.tree_leaves_with_path(state.replicas.opt_state)
              if getattr(path[-1], "name", None) == "count"]
    assert counts and all((c == 10).all() for c in counts), counts
    assert t.parts.data.get_state() == sender.data == state.data
    # eager: each replica's own outer state (θ_m, b_m, Δ_m,prev) is the sender's first one's
    shared, own = t.parts.sync.driver.split(state.outer._replace(inflight=()))
    _, sender_own = t.parts.sync.driver.split(sender.outer._replace(inflight=()))
    for got, want in zip(jax.tree.leaves(own["outer"]), jax.tree.leaves(sender_own["outer"])):
      for row in np.asarray(got):
        np.testing.assert_array_equal(row, np.asarray(want)[0])
    # the sum in flight arrives on the joiner as it arrived on the sender
    assert len(state.outer.inflight) == 1
    mean = state.outer.inflight[0].future.result().mean
    want = sender.outer.inflight[0].future.result().mean
    for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    t.parts.dispatcher.close()


def test_a_joiner_draws_no_init_and_restores_over_a_placeholder_it_consumed(
    sent, tmp_path, monkeypatch):
  """A joiner builds its state from zeros, without the model's init (the members' state
  replaces it), and restores the members' state whatever became of that placeholder: its
  rehearsal of a round's end (`join.rehearse`), or a round cut short (a host dropped and
  joining again), consumed its arrays (donated to the outer step)."""
  config, sender, message = sent

  def drawn(*args):
    raise AssertionError("a joiner drew the model's init")
  monkeypatch.setattr(model_lib, "init_params", drawn)
  monkeypatch.setattr(world_lib.World, "joining", property(lambda self: True))
  t = joiner(config, tmp_path)
  try:
    anchor = t.parts.sync.driver.model(t.state.outer, None)
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(anchor))
    for x in jax.tree.leaves((t.state.outer._replace(inflight=()), t.state.replicas)):
      if isinstance(x, jax.Array):
        x.delete()
    state, r = join.restore_message(t.parts, t.state, message, "the state sent")
    shared, _ = t.parts.sync.driver.split(state.outer._replace(inflight=()))
    sent_shared, _ = t.parts.sync.driver.split(sender.outer._replace(inflight=()))
    assert r == 2
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(sent_shared), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    t.parts.dispatcher.close()


def test_a_joiner_takes_only_the_state_a_majority_of_the_members_holds(sent, tmp_path):
  """Every member's fingerprint of the shared state comes with the transfer: the sender's
  must be a strict majority's, or the state is refused. (7bb7343: a joiner checked the
  state only against hashes sent by the same sender, which could hand it any state.)"""
  config, _, message = sent
  t = joiner(config, tmp_path)
  try:
    digest = files.load_meta(message[0], "meta")["shared_sha256"]
    other = "0" * 64
    join.restore_message(t.parts, t.state, message, "the state sent", [digest, digest, other])
    for held in ([digest, other], [digest, other, other], [other]):
      with pytest.raises(store.CheckpointError, match=r"held by \d of the \d members, not a "
                                                      r"majority: not used"):
        join.restore_message(t.parts, t.state, message, "the state sent", held)
  finally:
    t.parts.dispatcher.close()


@pytest.mark.parametrize("part", [0, 1, 2, 3])
def test_a_byte_changed_in_a_joins_message_is_refused_naming_sha256(sent, tmp_path, part):
  """Parts: meta.json, then arrived, own and shared .safetensors (by name)."""
  config, _, message = sent
  assert len(message) == 4
  message = [changed(p, meta=i == 0) if i == part else p for i, p in enumerate(message)]
  t = joiner(config, tmp_path)
  try:
    with pytest.raises(store.CheckpointError, match="sha256 mismatch") as e:
      join.restore_message(t.parts, t.state, message, "the state sent")
    names = [files.META, *sorted(files.filename(i) for i in ("arrived", "own", "shared"))]
    assert names[part] in str(e.value) and "\n" not in str(e.value)
  finally:
    t.parts.dispatcher.close()


@pytest.mark.parametrize("part", [0, 1])
def test_a_byte_changed_in_a_heal_is_refused_naming_sha256(tmp_path, part):
  """Two hosts with disks of their own; host 1's is empty, so it heals from host 0 (the
  bytes of meta.json and shared.safetensors), and a byte of one changes on the way."""
  job = FakeJob(2)
  stores = host_stores(tmp_path, job)
  stores[0].save(snapshot(3, 0))
  stores[0].wait()

  def flip(parts, source, h):
    got = job._meet(h, parts, lambda rows: rows[source])
    return [changed(p, meta=i == 0) if i == part else p for i, p in enumerate(got)]
  for h, s in enumerate(stores):
    s.collective.broadcast = lambda parts, source, h=h: flip(parts, source, h)
  results = job.run(lambda h: _attempt(lambda: stores[h].restore(
      lambda meta: snapshot(0, h), lambda meta: None)))
  error = results[1]
  assert isinstance(error, store.CheckpointError), results
  name = files.META if part == 0 else files.filename("shared")
  assert "sha256 mismatch" in str(error) and name in str(error) and "\n" not in str(error)


def _attempt(fn):
  try:
    return fn()
  except store.CheckpointError as e:
    return e


class Gate:
  """An `after` event that says when a store's writer waits on it."""

  def __init__(self):
    self.waiting, self._open = threading.Event(), threading.Event()

  def wait(self):
    self.waiting.set()
    self._open.wait()

  def set(self):
    self._open.set()


@pytest.mark.parametrize("kind", ["per_host", "shared_dir"])
def test_a_store_writes_a_checkpoint_only_once_its_record_is_written(tmp_path, kind):
  """`save(after=)`: the store's writer waits for the round's record before a byte of the
  checkpoint is on disk. Decided by the writer's own wait, not by timing."""
  local = collective_lib.LocalCollective()
  with dispatch.Dispatcher() as d:
    s = (per_host.PerHostStore(str(tmp_path), host=0, keep=2, dispatcher=d, collective=local)
         if kind == "per_host" else
         shared_dir.SharedDirStore(str(tmp_path), keep=2, dispatcher=d, collective=local))
    gate = Gate()
    s.save(snapshot(1, 0), after=gate)
    assert gate.waiting.wait(30), "the writer did not wait for the record"
    assert "1" not in os.listdir(s.directory)
    gate.set()
    s.wait()
    assert "1" in os.listdir(s.directory)
    s.close()


def test_a_sum_in_flight_resumes_with_the_hosts_that_took_no_part_in_it(tmp_path):
  """A checkpoint written while a catch-up round's sum is in flight (delayed: applied a
  round late) names that round's idle hosts, and a resume from it sends the sum again
  with them idle: this host's zeros with no replicas counted (a live job's divisor word),
  not its replicas in the mean."""
  config = small_config(mode="delayed", num_rounds=4)
  with dispatch.Dispatcher() as d:
    t = trainer.Trainer(config, str(tmp_path / "saved"), d)
    t.resume()
    t.run_round(1)
    t.parts.sync.exchange.idle(2, (0,))  # host 0 catches up in round 2
    t.run_round(2)
    snap = t.snapshot(2)
    assert snap.meta["inflight_idle"] == {"2": [0]}
    jax.block_until_ready(t.state.outer.state)
    t.run_round(3)  # round 3's sum has no idle host: none named
    assert t.snapshot(3).meta["inflight_idle"] == {}
  with dispatch.Dispatcher() as d:
    resumed = trainer.Trainer(config, str(tmp_path / "resumed"), d)
    assert not resumed.parts.sync.exchange.idle_here(2)
    state = state_lib.restore(resumed.parts, resumed.state, snap)
    assert resumed.parts.sync.exchange.idle_here(2)
    (pending,) = state.outer.inflight
    assert pending.round == 2
    mean = pending.future.result().mean
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(mean))
