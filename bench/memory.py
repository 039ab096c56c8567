"""Bytes per device of the inner step under device layouts, for the 150M and 1B configs.

  python -m bench.memory [--configs=configs/llama_150m.py,configs/llama_1b.py]
                         [--devices=8] [--layouts=1x8,2x4,8x1]
  python -m bench.memory --smoke  # seconds: configs/tiny.py on 2 devices

A layout GxF is `mesh.replicas = G` device groups with `mesh.fsdp = F`, on a host of
`--devices` devices emulated on the CPU (--xla_force_host_platform_device_count), with one
replica per group (replicas_per_host = G): 1x8 shards one replica over 8 devices, 8x1
puts a whole replica on each. Each config's inner step is compiled for each layout from
shapes alone (nothing is allocated) and XLA's memory plan for one device is read from the
compiled program (`memory_analysis`): arguments (params, AdamW state, batch), temporaries
(activations, gradients, the gathered shards) and outputs, less what the donated state
reuses. Next to it, `model.memory_estimate`'s analytic count for the same layout (the one
`check_memory` refuses configs with). XLA:CPU plans buffers as it would on a GPU, but its
fusion and scheduling differ: treat the GPU's figure as the same order, not the same bytes.
Writes bench/results/memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import time

from bench import harness

SMOKE = {"configs": "configs/tiny.py", "devices": 2, "layouts": "1x2,2x1"}


def layout_memory(config, replicas: int, fsdp: int) -> dict:
  """The compiled inner step's bytes per device for `config` under replicas x fsdp."""
  import jax

  from diloco_jax.algo import optim
  from diloco_jax.algo import state as state_lib
  from diloco_jax.device import inner
  from diloco_jax.device import mesh as mesh_lib
  from diloco_jax.models import family
  from diloco_jax.models import model as model_lib
  config = config.copy_and_resolve_references()
  config.replicas_per_host, config.mesh.replicas, config.mesh.fsdp = replicas, replicas, fsdp
  cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
  optimizer = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  mesh = mesh_lib.local_mesh(replicas, fsdp)
  step = inner.ReplicaStep(model_lib.make_loss_fn(cfg), optimizer, mesh=mesh,
                           grad_accum_steps=config.grad_accum_steps)
  anchor = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  shapes = jax.eval_shape(functools.partial(state_lib.init_replica_state, optimizer,
                                            num_replicas=replicas), anchor)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       shapes, step.state_shardings(shapes))
  t = time.perf_counter()
  memory = step.compile(state, (replicas, config.batch_size, cfg.seq_len + 1))
  compile_s = time.perf_counter() - t
  devices = mesh.devices.size
  accum = config.grad_accum_steps
  estimate, _ = model_lib.memory_estimate(
      cfg, param_sets=1, fsdp=fsdp, grad_copies=1 + (accum > 1), host_copies=0,
      micro_batch=max(config.batch_size * replicas // (accum * devices), 1))
  return {"layout": f"{replicas}x{fsdp}", "replicas": replicas, "fsdp": fsdp,
          "data": devices // (replicas * fsdp), "params": model_lib.num_params_of(cfg),
          "sequences_per_device": config.batch_size * replicas // (accum * devices),
          "memory_per_device_bytes": memory and memory["total"], "xla": memory,
          "estimate_bytes": sum(estimate.values()), "estimate": estimate,
          "compile_seconds": compile_s, "dtype": config.model.dtype,
          "remat": config.model.remat}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="configs/llama_150m.py,configs/llama_1b.py",
                      help="comma-separated config files")
  parser.add_argument("--devices", type=int, default=8, help="emulated devices on the host")
  parser.add_argument("--layouts", default="1x8,2x4,8x1",
                      help="comma-separated REPLICASxFSDP (mesh.replicas x mesh.fsdp)")
  args = harness.parse_args(parser, "memory", SMOKE, argv)
  layouts = [tuple(int(n) for n in text.split("x")) for text in args.layouts.split(",")]
  for g, f in layouts:
    if args.devices % (g * f):
      parser.error(f"--layouts: {g}x{f} does not divide --devices={args.devices}")
  # Before jax starts: the emulated devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                             f"--xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from diloco_jax.units import format_bytes

  rows = []
  for path in args.configs.split(","):
    config = runpy.run_path(path)["get_config"]()
    for g, f in layouts:
      row = {"config": path, **layout_memory(config, g, f)}
      rows.append(row)
      print(f"{path} {row['layout']}: {format_bytes(row['memory_per_device_bytes'] or 0)} "
            f"per device (estimate {format_bytes(row['estimate_bytes'])}; compiled in "
            f"{row['compile_seconds']:.0f} s)", flush=True)
  result = {"devices": args.devices, "rows": rows, "device": str(jax.devices()[0]),
            "jax": jax.__version__, "smoke": args.smoke, **harness.provenance("memory", argv)}
  harness.write(args.out, result, indent=1)
  print("\n| config | params | layout (replicas x fsdp) | sequences per device | "
        "XLA: bytes per device | estimate |\n|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {os.path.basename(row['config'])} | {row['params'] / 1e6:,.0f}M | "
          f"{row['layout']} | {row['sequences_per_device']} | "
          f"{format_bytes(row['memory_per_device_bytes'] or 0)} | "
          f"{format_bytes(row['estimate_bytes'])} |")
  print(f"\n{args.devices} emulated devices ({result['device']}); written to {args.out}")


if __name__ == "__main__":
  main()
