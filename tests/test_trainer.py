"""The trainer end to end: same anchor as `simulate`, traced once, outputs, ddp, CLI."""

import gc
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algo import optim
from diloco_jax.device import mesh as mesh_lib
from diloco_jax.reporting import progress
from diloco_jax.reporting import roundlog
from diloco_jax.readback import trained
from diloco_jax.loop import trainer
from diloco_jax.checkpoints import store
from diloco_jax.wire import integrity
from diloco_jax.reporting import writers
from diloco_jax.models import family
from diloco_jax.models import model as model_lib
from diloco_jax.runtime import hostmem
from tests import test_trained
from tests.multihost import simulate_trainer
from tests.multihost import small_config
from tests.multihost import trainer_batches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ORDER = []  # ("record", r) as sync_run writes each, ("save", r) as each save's write starts
# (its first step: the check for space)
FROZEN = []  # gc.get_freeze_count() as sync_run writes each record


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
  config = small_config()
  workdir = str(tmp_path_factory.mktemp("sync"))
  write, check_space = writers.MetricsWriter.write, store.check_space

  def record(self, rec):
    ORDER.append(("record", rec["round"]))
    FROZEN.append(gc.get_freeze_count())
    return write(self, rec)

  def save(directory, r, needed):
    ORDER.append(("save", r))
    return check_space(directory, r, needed)

  writers.MetricsWriter.write, store.check_space = record, save
  try:
    return config, workdir, trainer.train_and_evaluate(config, workdir)
  finally:
    writers.MetricsWriter.write, store.check_space = write, check_space


def test_a_checkpoint_is_written_only_after_its_rounds_record(sync_run):
  """A host killed between the two would leave a checkpoint that a resume continues from
  without ever logging its round (seen: records [1, 2, 4, ...] after a SIGKILL)."""
  config = sync_run[0]
  saves = [r for what, r in ORDER if what == "save"]
  assert saves[:config.num_rounds - 1] == list(range(1, config.num_rounds)), ORDER
  for r in range(1, config.num_rounds):  # (the last round's record follows the run's end)
    assert ORDER.index(("record", r)) < ORDER.index(("save", r)), ORDER


@pytest.mark.device
def test_trainer_equals_simulate(sync_run):
  config, _, result = sync_run
  expected = simulate_trainer(config)
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                       result.outer_state.anchor, expected.params))
  # One jitted step per inner step vs. one scan over the whole run: XLA fuses the two
  # programs differently, so float32 rounding differs in the last bits, and AdamW's
  # normalised update amplifies an ulp of a near-zero gradient to a visible step. Seen:
  # max |diff| 4.4e-6 on params of size ~0.02-1 after 12 steps; the bound is 4x that.
  assert max(diffs) <= 2e-5, max(diffs)
  train_losses = [r["train_loss"] for r in result.records]
  np.testing.assert_allclose(train_losses, expected.losses.mean(axis=(1, 2)), rtol=1e-5)


def test_replicas_hold_anchor_and_inner_state_kept(sync_run):
  config, _, result = sync_run
  anchor = result.outer_state.anchor
  for m in range(config.replicas_per_host):
    jax.tree.map(lambda a, p: np.testing.assert_array_equal(a, p[m]), anchor,
                 result.replicas.params)
  counts = [x for x in jax.tree.leaves(result.replicas.opt_state) if x.dtype == jnp.int32]
  assert all(int(c.max()) == config.num_rounds * config.inner_steps for c in counts)
  assert int(result.outer_state.step) == config.num_rounds


def test_start_ups_objects_are_frozen_for_the_rounds_and_released_after(sync_run):
  # runtime/collector.py: no full collection walks what the start built; a process that
  # goes on (this one) gets its objects back into the collector's walks
  assert FROZEN and min(FROZEN) > 10_000
  assert gc.get_freeze_count() == 0


def test_traced_once(sync_run):
  _, _, result = sync_run
  assert result.traces == {"inner_step": 1, "eval_step": 1}


def test_workdir_outputs(sync_run):
  config, workdir, _ = sync_run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["round"] for r in records] == list(range(1, config.num_rounds + 1))
  for key in ("train_loss", "eval_loss", "floor", "tokens_per_sec", "outer_time", "time"):
    assert all(np.isfinite(r[key]) for r in records), key
  # the first round compiles: the ETA starts from the second
  assert "eta" not in records[0] and all(np.isfinite(r["eta"]) for r in records[1:])
  with open(os.path.join(workdir, "run.json")) as f:
    flops_per_token = json.load(f)["flops_per_token"]
  for r in records:  # CPU: FLOP/s of the whole round, and no MFU (no peak to compare with)
    assert r["flops_per_sec"] == pytest.approx(r["tokens_per_sec"] * flops_per_token)
    assert "mfu" not in r
  events = os.listdir(os.path.join(workdir, "tensorboard"))
  assert any(name.startswith("events.out.tfevents") for name in events)
  with open(os.path.join(workdir, "loss.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_run_json_says_what_the_run_is(sync_run):
  config, workdir, result = sync_run
  with open(os.path.join(workdir, "run.json")) as f:
    run = json.load(f)
  assert run["config"] == config.to_dict()
  assert (run["hosts"], run["replicas_per_host"], run["replicas"]) == (1, 2, 2)
  assert run["local_devices"] == [str(d) for d in jax.local_devices()]
  params = sum(x.size for x in jax.tree.leaves(result.params))
  assert run["num_params"] == params
  cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
  assert run["flops_per_token"] == model_lib.flops_per_token(cfg, params)
  assert run["peak_flops"] is None  # CPU devices have no entry in the peak table
  # XLA's plan for the compiled inner step: the state (params + 2 AdamW moments, float32,
  # both replicas) is among its arguments and its outputs; on CPU it is not donated
  # (`ReplicaStep.donates_state`), so no output is written into an argument's buffer.
  memory = run["memory_per_device"]
  assert run["memory_per_device_bytes"] == memory["total"] == (
      memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"])
  state_bytes = 2 * 3 * 4 * params
  assert memory["arguments"] >= state_bytes and memory["outputs"] >= state_bytes
  assert memory["aliased"] == 0
  assert run["layout"]["mesh"] == {"replica": 1, "data": jax.local_device_count(), "fsdp": 1}
  assert run["versions"]["jax"] == jax.__version__ and run["versions"]["diloco_jax"]


@pytest.mark.slow
def test_ddp_equals_mean_gradient_adamw(tmp_path):
  config = small_config(mode="ddp", num_rounds=2)
  result = trainer.train_and_evaluate(config, str(tmp_path))
  batches, spec = trainer_batches(config)  # [T, K, H, B, L+1]
  cfg = family.ModelConfig.from_config(config.model, spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(cfg)
  opt = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  params = model_lib.init_params(cfg, jax.random.key(config.seed))
  opt_state = opt.init(params)
  for t in range(config.num_rounds):
    for h in range(config.inner_steps):
      grads = [jax.grad(loss_fn)(params, batches[t, k, h])
               for k in range(config.replicas_per_host)]
      grads = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
      updates, opt_state = opt.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
  # Same float32 bound as the sync test: reduction order differs (vmap + mean vs. a
  # Python sum), and AdamW turns an ulp on a near-zero gradient into a ~lr-sized step.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a[0], b, atol=2e-5),
               result.replicas.params, params)
  test_trained.same_params(trained.load(str(tmp_path)), result)  # read back: its one set


def run_cli(*args, timeout=300, env=None):
  return subprocess.run([sys.executable, "-m", "diloco_jax.train", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout,
                        env=env or {**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_cli_runs_and_prints_round_lines(tmp_path):
  """...and keeps its compiled programs in workdir/compilation_cache (without the test
  session's cache in the environment), where running the command again finds them all.
  Its big host buffers get huge pages where the kernel gives them on request (the
  trainer starts itself again with glibc's tunable; `hugetlb=0` opts out), as run.json
  says."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  args = ("--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.num_rounds=2",
          "--config.inner_steps=3", "--config.model.d_model=32", "--config.model.mlp_dim=64",
          "--config.inner.warmup_steps=2")
  proc = run_cli(*args, env={**env, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "round 1/2" in proc.stdout and "round 2/2" in proc.stdout
  assert "loss floor" in proc.stdout and "best unigram loss" in proc.stdout
  cached = set(os.listdir(tmp_path / "compilation_cache"))
  assert cached
  mode = hostmem._thp_mode()  # pylint: disable=protected-access
  glibc = hostmem._malloc_trim() is not None  # pylint: disable=protected-access
  with open(tmp_path / "run.json") as f:
    assert json.load(f)["huge_pages"] == (mode == "always" or (mode == "madvise" and glibc))
  again = run_cli(*args, env={**env, "JAX_PLATFORMS": "cpu"})  # the finished run: no training
  assert again.returncode == 0 and "final eval loss" in again.stdout, again.stderr[-3000:]
  assert set(os.listdir(tmp_path / "compilation_cache")) == cached  # nothing compiled anew
  # A new run of the same config with that cache (a host restarted with its old workdir's
  # cache): the inner step and init kept whole are loaded, not written again, and train
  # to the same bits.
  kept = tmp_path / "compilation_cache" / "executables"
  entries = {name: os.stat(kept / name).st_mtime_ns for name in os.listdir(kept)}
  assert sorted(name.split("-")[0] for name in entries) == ["init", "inner_step"]
  loaded = run_cli(*args[:1], f"--workdir={tmp_path / 'loaded'}", *args[2:],
                   f"--compilation_cache={tmp_path / 'compilation_cache'}",
                   env={**env, "JAX_PLATFORMS": "cpu"})
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  assert {name: os.stat(kept / name).st_mtime_ns for name in os.listdir(kept)} == entries
  with open(tmp_path / "metrics.jsonl") as f, open(tmp_path / "loaded" / "metrics.jsonl") as g:
    losses = [[r.get(k) for k in ("train_loss", "eval_loss")] for r in map(json.loads, f)]
    assert losses == [[r.get(k) for k in ("train_loss", "eval_loss")] for r in map(json.loads, g)]
  off = run_cli(*args[:1], f"--workdir={tmp_path / 'off'}", *args[2:], "--compilation_cache=none",
                env={**env, "JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
  assert off.returncode == 0 and not os.path.exists(tmp_path / "off" / "compilation_cache")
  with open(tmp_path / "off" / "run.json") as f:
    assert json.load(f)["huge_pages"] == (mode == "always")


@pytest.mark.parametrize("override, field", [
    ("--config.outer.lr=-1", "config.outer.lr"),
    ("--config.model.num_heads=3", "config.model.num_heads"),
    ("--config.model.attention=cudnn", "config.model.attention"),  # no cuDNN on a CPU
])
def test_cli_rejects_bad_value(tmp_path, override, field):
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path}", override)
  assert proc.returncode != 0
  assert field in proc.stderr + proc.stdout
  assert "Traceback" not in proc.stderr + proc.stdout and not os.listdir(tmp_path)


def test_cli_rejects_misspelled_field(tmp_path):
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.outer.lrr=0.5")
  assert proc.returncode != 0
  assert "lrr" in proc.stderr + proc.stdout


def test_anchor_check_names_the_host_that_diverged(tmp_path):
  """Three hosts, of which host 1 hashes its outer state differently: every 2 rounds the
  hash is published, and read a round later; the run stops in round 3, naming round 2
  and host 1."""
  from diloco_jax.wire import dispatch
  config = small_config(anchor_check_every=2, num_rounds=4)

  class ThreeHosts:  # what the key-value store would hand back on 3 hosts
    deferred = True

    def __init__(self):
      self.published, self.collected = {}, []

    def publish(self, digest, r):
      self.published[r] = digest

    def collect(self, r):
      self.collected.append(r)
      digest = self.published[r]
      return {0: digest, 1: digest[::-1], 2: digest}

  with dispatch.Dispatcher() as d:
    t = trainer.Trainer(config, str(tmp_path), d)
    t.parts.sync.anchor_check.exchange = exchange = ThreeHosts()
    t.run_round(1)
    t.run_round(2)
    assert list(exchange.published) == [2] and exchange.collected == []
    with pytest.raises(integrity.AnchorMismatchError,
                       match=r"round 2: .* host 1 diverged from the others"):
      t.run_round(3)
    assert exchange.collected == [2]


def _rounds_with_slow_collective(tmp_path, mode, slow_sum_of, num_rounds=5, inner_steps=40):
  from diloco_jax.wire import dispatch
  config = small_config(mode=mode, num_rounds=num_rounds, inner_steps=inner_steps,
                        eval_every=100)
  with dispatch.Dispatcher() as d:
    t = trainer.Trainer(config, str(tmp_path / mode), d)
    t.parts.sync.collective.sum = slow_sum_of(t, t.parts.sync.collective.sum)
    return t.run().records


@pytest.mark.slow
def test_async_modes_overlap_the_collective(tmp_path):
  """Delayed and eager keep the devices busy while the cross-host sum is in flight: a
  collective that cannot finish until the next inner phase has run half its steps still
  lets the run go on, where sync waits with idle devices. Decided by step counts, not by
  clocks, so a loaded machine cannot fail it."""
  inner_steps, num_rounds = 40, 5

  def sleeping(t, fast_sum):  # a WAN: the bytes take a while to cross
    def slow_sum(tree):
      time.sleep(0.2)
      return fast_sum(tree)
    return slow_sum

  sync = _rounds_with_slow_collective(tmp_path, "sync", sleeping, num_rounds, inner_steps)
  assert [r["overlap_steps"] for r in sync] == [0] * num_rounds

  def waits_for_inner_steps(t, fast_sum):
    calls = []

    def gated_sum(tree):  # returns once the devices finished half an inner phase
      calls.append(None)
      if len(calls) < num_rounds:  # the last round has no inner phase after it
        start, deadline = t.parts.model.inner.steps_finished(), time.monotonic() + 120
        while t.parts.model.inner.steps_finished() - start < inner_steps // 2:
          assert time.monotonic() < deadline, "the inner phase waited for the collective"
          time.sleep(0.005)
      return fast_sum(tree)
    return gated_sum

  for mode in ("delayed", "eager"):
    records = _rounds_with_slow_collective(tmp_path, mode, waits_for_inner_steps,
                                           num_rounds, inner_steps)
    overlap = [r["overlap_steps"] for r in records[:-1]]
    assert all(n >= inner_steps // 2 for n in overlap), (mode, overlap)


def test_round_line_reports_mfu_against_the_peak_table():
  class Device:  # what jax.Device says of itself, for the table's lookup
    def __init__(self, kind):
      self.device_kind = kind
  assert mesh_lib.peak_flops(Device("NVIDIA H100 80GB HBM3")) == 989e12
  assert mesh_lib.peak_flops(Device("NVIDIA H100 PCIe")) == 756e12
  assert mesh_lib.peak_flops(Device("NVIDIA H200")) == 989e12
  assert mesh_lib.peak_flops(Device("NVIDIA A100-SXM4-80GB")) == 312e12
  assert mesh_lib.peak_flops(Device("cpu")) is None
  log = roundlog.RoundLog(writers.MetricsWriter("", enabled=False),
                          progress.ProgressBar(10, enabled=False), num_rounds=1, inner_steps=10,
                          num_replicas=1, printing=False, tokens_per_round=1000,
                          flops_per_token=1e9, peak_flops=4e12)
  log.open(1, inner_step=10, tokens=1000, train_loss=1.0, outer_time=0.01)
  log.timed(1, 0.5)  # 2,000 tokens/s x 1 GFLOP = 2 TFLOP/s of a 4 TFLOP/s peak
  record = log.figures(1)  # the record as it will be written
  assert record["mfu"] == pytest.approx(0.5)
  assert "2.0k tok/s (MFU 50.0%)" in roundlog.round_line(record, 1, 10)
  del record["mfu"]
  assert "2.0k tok/s (2.0TFLOP/s)" in roundlog.round_line(record, 1, 10)
