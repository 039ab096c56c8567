"""Helpers for tests that run several host processes on localhost."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import diloco_jax

# The helpers the benches run hosts with are the tests' too: one copy, in bench/ (a bench
# runs without the suite; bench/harness.py imports neither jax nor the trainer).
from bench.harness import alive  # noqa: F401
from bench.harness import children  # noqa: F401
from bench.harness import free_port
from bench.harness import host_dir  # noqa: F401
from bench.harness import wait_dead  # noqa: F401
from diloco_jax import config as config_lib
from diloco_jax.algo import fragments
from diloco_jax.algo import optim
from diloco_jax.data import pipeline as data_lib
from diloco_jax.models import family
from diloco_jax.models import model as model_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Importing jax here set TF_CPP_MIN_LOG_LEVEL=1 where unset: the hosts start without it,
# as from a user's shell (the trainer's own default applies); another value is kept.
ENV = {**{k: v for k, v in os.environ.items() if (k, v) != ("TF_CPP_MIN_LOG_LEVEL", "1")},
       "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO}


def small_config(**overrides):
  """A model and data small enough that a round takes tens of milliseconds on a CPU."""
  c = config_lib.get_default_config()
  c.update(dict(num_rounds=3, inner_steps=4, replicas_per_host=2, batch_size=4,
                eval_batches=2, eval_every=1))
  c.model.update(dict(num_layers=1, d_model=32, num_heads=2, mlp_dim=64, seq_len=16))
  c.data.update(dict(vocab_size=16, num_sequences=512, num_eval_sequences=64))
  c.inner.update(dict(warmup_steps=2))
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def poisoned(replica: int, value, calls=None):
  """A `pseudo_gradient_hook` (modes/base.py) that makes replica `replica`'s Δ NaN (value
  "nan") or multiplies it by `value`, at the given 1-based calls (one per round;
  streaming: one per fragment sync) or at every call (None)."""
  count = [0]

  def hook(deltas, *, round_: int, fragment: int):
    del round_, fragment
    count[0] += 1
    if calls is not None and count[0] not in calls:
      return deltas
    bad = (lambda d: jnp.full_like(d, jnp.nan)) if value == "nan" else (lambda d: d * value)
    return jax.tree.map(lambda d: d.at[replica].set(bad(d[replica])), deltas)

  return hook


def corrupted(end_round, at_round: int):
  """The sync driver's `end_round` (`modes.outer.OuterStep.end_round`) that adds 1e-3 to one
  entry of the anchor (sync mode's `OuterState`) after round `at_round`'s outer step, before
  the round's checks."""
  def wrapped(self, outer, replicas, loss_sum, r):
    update = end_round(self, outer, replicas, loss_sum, r)
    if r == at_round:
      state = update.outer.state
      leaves, treedef = jax.tree.flatten(state.anchor)
      leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(1e-3)
      update = update._replace(outer=update.outer._replace(
          state=state.replace(anchor=jax.tree.unflatten(treedef, leaves))))
    return update

  return wrapped


def paced(seconds_per_step: list[float], jitter: float = 0.0):
  """`pacing.Pacer.measured` for a host of a given speed: host h's inner phase of round r
  measures its steps x `seconds_per_step[h]`, give or take `jitter` (a fixed pattern by
  round and host), so that the decisions of balance 'speed' are the same in every run.
  A round the trainer does not time (it compiled) stays untimed."""
  def measured(self, r: int, busy: float) -> None:
    wobble = 1 + jitter * math.sin(7 * r + 3 * self.host)
    self.busy = {r: busy and self.my_steps(r) * seconds_per_step[self.host] * wobble}

  return measured


def start(cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
  return subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
  """Waits for every process (killing all at the deadline); [(returncode, output)]."""
  deadline = time.monotonic() + timeout
  out = []
  for p in procs:
    try:
      text, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      text, _ = p.communicate()
      raise AssertionError(f"host process still running after {timeout}s:\n{text[-3000:]}")
    out.append((p.returncode, text))
  return out


def start_hosts(tmp_path, num_hosts: int, env: dict | None = None,
                **overrides) -> list[subprocess.Popen]:
  """`num_hosts` processes of tests/host_main.py training `small_config(**overrides)`."""
  port = free_port()
  return [start([sys.executable, "tests/host_main.py", str(tmp_path), str(h), str(num_hosts),
                 str(port), json.dumps(overrides)], env=env) for h in range(num_hosts)]


def run_hosts(tmp_path, num_hosts: int, timeout: float = 240, env: dict | None = None,
              **overrides) -> list[dict]:
  """Trains `small_config(**overrides)` on `num_hosts` processes; per host, the final
  anchor's leaves, the records and what the process printed (tests/host_main.py)."""
  outputs = []
  for code, text in finish(start_hosts(tmp_path, num_hosts, env, **overrides), timeout):
    assert code == 0, text[-4000:]
    outputs.append(text)
  results = []
  for h in range(num_hosts):
    with np.load(tmp_path / f"host{h}.npz") as f:
      leaves = [f[f"leaf{i}"] for i in range(len(f.files) - 1)]
      results.append({"leaves": leaves, "records": json.loads(str(f["records"])),
                      "output": outputs[h]})
  return results


def trainer_batches(config):
  """The batches the trainer consumes (one host), rearranged to simulate's [T, K, H, ...]."""
  data = data_lib.make_host_data(config.data, seq_len=config.model.seq_len,
                                 batch_size=config.batch_size,
                                 replicas_per_host=config.replicas_per_host,
                                 num_eval_batches=config.eval_batches)
  steps = [data.next_batch() for _ in range(config.num_rounds * config.inner_steps)]
  b = np.stack(steps).reshape(config.num_rounds, config.inner_steps, *steps[0].shape)
  return b.swapaxes(1, 2), data.spec


def simulate_trainer(config):
  """`simulate` on the model, optimizers and batches the trainer would use for `config`."""
  batches, spec = trainer_batches(config)
  cfg = family.ModelConfig.from_config(config.model, spec.vocab_size)
  total = config.num_rounds * config.inner_steps
  params = model_lib.init_params(cfg, jax.random.key(config.seed))
  o, streaming_kw = config.outer, {}
  if config.mode == "streaming":
    streaming_kw = dict(
        fragment_ids=fragments.model_fragment_ids(params, o.fragments, o.fragment_layout),
        overlap_steps=o.overlap_steps, merge_alpha=o.merge_alpha)
  return diloco_jax.simulate(
      model_lib.make_loss_fn(cfg), params, jnp.asarray(batches),
      inner_optimizer=optim.inner_optimizer(config.inner, total),
      outer_optimizer=optim.outer_optimizer(o), mode=config.mode, **streaming_kw)
