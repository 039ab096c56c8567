"""Device layouts on one host (config.mesh): FSDP within a replica, replicas on device
groups. One process with 4 emulated CPU devices trains every driver under the default
layout and another (tests/layouts_main.py); the checks below read what it wrote."""

import json
import subprocess
import sys

import pytest

from diloco_jax import config as config_lib
from diloco_jax.device import mesh as mesh_lib
from tests import multihost

# Float32 sums taken in another order (gradients over fsdp shards, vmapped replica groups)
# differ in the last bits: eval losses agree to 1e-6 relative (measured: 1e-7).
RTOL = 1e-6


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
  out = tmp_path_factory.mktemp("layouts")
  proc = subprocess.run([sys.executable, "tests/layouts_main.py", str(out)], cwd=multihost.REPO,
                        env=multihost.ENV, text=True, capture_output=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  return json.loads((out / "layouts.json").read_text())


@pytest.mark.parametrize("run", ["sync 1x4", "sync 2x2", "eager 2x2", "streaming 2x2",
                                 "ddp 1x4"])
def test_every_layout_trains_to_the_default_layouts_losses(layouts, run):
  mode = run.split()[0]
  got, want = layouts[run]["eval_loss"], layouts[f"{mode} 1x1"]["eval_loss"]
  assert got == pytest.approx(want, rel=RTOL) and len(got) == 2


@pytest.mark.parametrize("run", ["sync 1x1", "sync 1x4", "sync 2x2", "eager 2x2",
                                 "streaming 2x2", "ddp 1x4"])
def test_the_inner_step_is_traced_once_per_layout(layouts, run):
  programs = 2 if run.startswith("ddp") else 1  # ddp: the gradient sum, then the update
  assert layouts[run]["traces"] == {"inner_step": programs, "eval_step": 1}


def test_fsdp_shards_the_state_and_cuts_memory_per_device(layouts):
  default, fsdp = layouts["sync 1x1"], layouts["sync 1x4"]
  assert fsdp["memory"] < default["memory"] / 2, (fsdp["memory"], default["memory"])
  assert layouts["ddp 1x4"]["memory"] < layouts["ddp 1x1"]["memory"] / 2
  # The largest leaf [R, 128, 512]: 512 split 4 ways; with 2 groups, R too.
  assert default["shard_shape"] == [4, 128, 512]
  assert fsdp["shard_shape"] == [4, 128, 128]
  assert layouts["sync 2x2"]["shard_shape"] == [2, 128, 256]
  assert fsdp["layout"]["mesh"] == {"replica": 1, "data": 1, "fsdp": 4}


def test_a_checkpoint_resumes_under_another_layout(layouts):
  resumed = layouts["resumed under 2x2"]
  assert resumed["same_numbers"]
  # What was restored is the state the run ended with, not the initial one twice.
  assert resumed["round"] == 2 and resumed["restored_the_end"]
  assert "P('replica', None, 'fsdp')" in resumed["specs"]


def test_the_sharding_rule():
  assert mesh_lib.sharded_dim((128, 512), 4) == 1  # the largest dimension
  assert mesh_lib.sharded_dim((512, 512), 4) == 0  # the first of equals
  assert mesh_lib.sharded_dim((6, 4), 4) == 1  # the largest that 4 divides
  assert mesh_lib.sharded_dim((3,), 4) is None  # none divides: replicated
  assert mesh_lib.sharded_dim((), 4) is None
  assert mesh_lib.sharded_dim((128, 512), 1) is None


@pytest.mark.parametrize("overrides, field", [
    ({"mesh.fsdp": 3}, "config.mesh.fsdp"),  # 3 does not divide 4 devices
    ({"mesh.replicas": 3, "replicas_per_host": 4}, "config.mesh.replicas"),
    ({"mesh.replicas": 2, "mode": "ddp"}, "config.mesh.replicas"),
    ({"mesh.fsdp": 0}, "config.mesh.fsdp"),
    ({"mesh.fsdp": 4, "batch_size": 2}, "config.batch_size"),
])
def test_bad_layouts_are_refused_naming_the_field(overrides, field):
  with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
    config_lib.validate(multihost.small_config(**overrides), num_local_devices=4)
