"""One process with 4 emulated CPU devices trains under several device layouts.

  python tests/layouts_main.py OUT_DIR

Sets XLA_FLAGS before jax starts, trains `multihost.small_config` variants under each
(mode, mesh.replicas, mesh.fsdp) of LAYOUTS, resumes the default layout's checkpoint
under another layout, and writes OUT_DIR/layouts.json for tests/test_layout.py.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (mode, mesh.replicas, mesh.fsdp): every driver under a layout other than the default.
LAYOUTS = [("sync", 1, 1), ("sync", 1, 4), ("sync", 2, 2), ("eager", 1, 1), ("eager", 2, 2),
           ("streaming", 1, 1), ("streaming", 2, 2), ("ddp", 1, 1), ("ddp", 1, 4)]


def config_for(mode, replicas, fsdp):
  from tests import multihost
  # The state (4 replicas x params and 2 AdamW moments) outweighs the activations.
  return multihost.small_config(**{
      "mode": mode, "replicas_per_host": 4, "num_rounds": 2, "inner_steps": 4,
      "checkpoint.every": 0, "model.num_layers": 2 if mode == "streaming" else 1, "model.d_model": 128, "model.num_heads": 4,
      "model.mlp_dim": 512, "outer.fragments": 2 if mode == "streaming" else 1,
      "mesh.replicas": replicas, "mesh.fsdp": fsdp})


def main(out_dir):
  import jax
  import numpy as np

  from diloco_jax.loop import trainer
  from diloco_jax.wire import dispatch
  assert jax.local_device_count() == 4, jax.devices()
  out, trained = {}, {}
  for mode, replicas, fsdp in LAYOUTS:
    workdir = os.path.join(out_dir, f"{mode}_{replicas}x{fsdp}")
    result = trainer.train_and_evaluate(config_for(mode, replicas, fsdp), workdir)
    trained[mode, replicas, fsdp] = result
    with open(os.path.join(workdir, "run.json")) as f:
      run = json.load(f)
    leaf = max(jax.tree.leaves(result.replicas.params), key=lambda x: x.size)
    out[f"{mode} {replicas}x{fsdp}"] = {
        "eval_loss": [r.get("eval_loss") for r in result.records],
        "memory": run["memory_per_device_bytes"], "layout": run["layout"],
        "traces": result.traces, "leaf_shape": list(leaf.shape),
        "shard_shape": list(leaf.addressable_shards[0].data.shape)}

  # A checkpoint written under one layout resumes under another: the same numbers, and
  # those the run ended with (both resumes holding the initial state would also agree).
  with dispatch.Dispatcher() as d:
    t = trainer.Trainer(config_for("sync", 2, 2), os.path.join(out_dir, "sync_1x1"), d)
    resumed_round = t.resume()
    saved = trainer.Trainer(config_for("sync", 1, 1), os.path.join(out_dir, "sync_1x1"), d)
    saved.resume()
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves((t.state.replicas, t.state.outer.state)),
        jax.tree.leaves((saved.state.replicas, saved.state.outer.state))))
    end = trained["sync", 1, 1]
    restored = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves((t.state.replicas, t.state.outer.state)),
        jax.tree.leaves((end.replicas, end.outer_state)), strict=True))
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(t.state.replicas.params)}
    t.parts.storage.store.close()
    saved.parts.storage.store.close()
  out["resumed under 2x2"] = {"same_numbers": same, "specs": sorted(specs),
                              "restored_the_end": restored, "round": resumed_round}
  with open(os.path.join(out_dir, "layouts.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
