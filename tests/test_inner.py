"""The inner step alone: gradient accumulation and data parallelism over local devices."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs R=2 replicas for 3 steps and prints the params' checksum; used in-process and in a
# subprocess with 2 CPU devices.
SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from diloco_jax import config as config_lib
    from diloco_jax.device import inner
    from diloco_jax.models import family
    from diloco_jax.models import model as model_lib
    from diloco_jax.algo import optim
    from diloco_jax.algo import state as state_lib

    def run(grad_accum_steps):
      cfg = family.ModelConfig(vocab_size=11, seq_len=8, num_layers=1, d_model=16,
                                num_heads=2, mlp_dim=32)
      opt = optim.inner_optimizer(config_lib.get_default_config().inner, 10)
      mesh = inner.local_mesh()
      step = inner.ReplicaStep(model_lib.make_loss_fn(cfg), opt, mesh=mesh,
                               grad_accum_steps=grad_accum_steps)
      anchor = model_lib.init_params(cfg, jax.random.key(0))
      state = step.place(state_lib.init_replica_state(opt, anchor, 2))
      rng = np.random.default_rng(0)
      for _ in range(3):
        state, loss = step(state, rng.integers(0, 11, (2, 8, 9), dtype=np.int32))
      return jax.tree.map(np.asarray, state.params), np.asarray(loss), step.traces
""")


def _run(grad_accum_steps):
  namespace = {}
  exec(SCRIPT, namespace)
  return namespace["run"](grad_accum_steps)


@pytest.mark.slow
def test_grad_accumulation_matches_full_batch():
  full, loss_full, _ = _run(1)
  accumulated, loss_acc, traces = _run(4)
  assert traces == 1
  np.testing.assert_allclose(loss_acc, loss_full, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), accumulated, full)


@pytest.mark.slow
def test_two_local_devices_match_one(tmp_path):
  """Batch sharded over 2 CPU devices ('data' axis) gives the one-device result."""
  out = tmp_path / "params.npz"
  code = SCRIPT + textwrap.dedent(f"""
      assert jax.local_device_count() == 2
      params, loss, _ = run(2)
      np.savez({str(out)!r}, loss=loss, *jax.tree.leaves(params))
  """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": REPO}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  params, loss, _ = _run(2)
  saved = np.load(out)
  np.testing.assert_allclose(saved["loss"], loss, rtol=1e-6)
  for i, leaf in enumerate(jax.tree.leaves(params)):
    np.testing.assert_allclose(saved[f"arr_{i}"], leaf, atol=1e-6)
