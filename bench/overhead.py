"""What DiLoCo costs on top of plain training, measured side by side in one process.

  python -m bench.overhead [--rounds=12] [--inner_steps=50] [--batch_size=16] [--out=...]
  python -m bench.overhead --config=peer --one_core --rounds=6 --out=bench/results/overhead_peer.json
  python -m bench.overhead --smoke  # seconds: 2 rounds of 2 steps of 4 sequences, one block

Loops over the same model (configs/tiny.py's, or with --config=peer configs/peer.py's
3.3M-param GPT on the standard library's bytes, one replica of 8 x 128 tokens), the same
data pipeline and the same tokens per step (tiny: K=4 replicas x 16 sequences of 64
tokens), H=50:
  diloco    : the trainer itself (`Trainer.run_round`, mode sync): K replicas, one outer
              step every H inner steps;
  plain     : an independent plain jitted AdamW loop on one set of params, fed the same
              tokens as K steps of 16 sequences (the same per-step shapes as a replica's);
  plain_big : the same loop fed the same tokens as one step of K x 16 sequences;
  local     : the trainer's inner step alone (K replicas, no outer step).
(plain_big is left out when K=1: it is plain.) --one_core runs the process on one CPU core
with XLA computing on one thread (--xla_cpu_multi_thread_eigen=false), as bench/peer.py
runs each host.
The loops take turns round by round (H steps each, waited for), so drifts in the shared
machine's speed hit all of them alike; tokens/s is the median over rounds, the first
(compiling) round excluded. Then it times a full garbage collection with every loop's
objects alive, as after a start and once the start's objects are frozen (what a trainer's
start does: diloco_jax/runtime/collector.py). Writes bench/results/overhead.json (--smoke:
--out, or a file in a temporary directory).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--one_core" in sys.argv:  # before jax is imported: XLA reads its flags once
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                                   "--xla_cpu_multi_thread_eigen=false")))
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import jax
import optax

from bench import harness
from bench import peer
from configs import peer as peer_config
from configs import tiny
from diloco_jax.algo import optim
from diloco_jax.algo import state as state_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.device import inner
from diloco_jax.loop import trainer
from diloco_jax.models import family
from diloco_jax.models import model as model_lib
from diloco_jax.runtime import collector
from diloco_jax.wire import dispatch


def bench_config(args):
  if args.config == "peer":
    config = peer_config.get_config()
    config.data.path = peer.stdlib_dir()
    atexit.register(shutil.rmtree, config.data.path, ignore_errors=True)
  else:
    config = tiny.get_config()
    config.batch_size = args.batch_size
  config.inner_steps = args.inner_steps
  config.model.num_layers = args.num_layers or config.model.num_layers
  config.num_rounds = args.rounds + 1  # never reached: the trainer's final eval stays out
  config.inner.warmup_steps = min(config.inner.warmup_steps,
                                  config.num_rounds * config.inner_steps - 1)
  config.eval_every = 10 ** 6
  config.eval_batches = 1
  return config


def make_data(config):
  return data_lib.make_host_data(config.data, seq_len=config.model.seq_len,
                                 batch_size=config.batch_size,
                                 replicas_per_host=config.replicas_per_host,
                                 num_eval_batches=config.eval_batches)


def diloco_loop(config, dispatcher, workdir: str):
  """The trainer's round: H inner steps of K replicas and the outer step. Nothing is read
  from what `run_round` returns; waiting for the replicas' state waits for the round."""
  t = trainer.Trainer(config, workdir, dispatcher)

  def one_round(r):
    t.run_round(r)
    jax.block_until_ready(t.state.replicas)

  return one_round


def initial_params(config):
  """The params every loop but the trainer's starts from, on the host (initialised once:
  each `init_params` call compiles again)."""
  data = make_data(config)
  cfg = family.ModelConfig.from_config(config.model, data.spec.vocab_size)
  return jax.device_get(model_lib.init_params(cfg, jax.random.key(0)))


def plain_loop(config, params0, per_replica_batches: bool):
  """A plain AdamW loop written here, independent of the trainer: one set of params."""
  data = make_data(config)
  cfg = family.ModelConfig.from_config(config.model, data.spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(cfg)
  opt = optim.inner_optimizer(config.inner, 10 ** 6)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  params = jax.device_put(params0)
  state = [params, opt.init(params)]

  def one_round(_):
    for _ in range(config.inner_steps):
      batch_KxBxL1 = data.next_batch()
      for batch in (batch_KxBxL1 if per_replica_batches
                    else [batch_KxBxL1.reshape(-1, cfg.seq_len + 1)]):
        state[0], state[1], loss = step(state[0], state[1], batch)
    jax.block_until_ready(state)

  return one_round


def local_loop(config, params0):
  """The trainer's inner step over K replicas with no outer step (its very program: the
  same optimizer and learning-rate schedule)."""
  data = make_data(config)
  cfg = family.ModelConfig.from_config(config.model, data.spec.vocab_size)
  opt = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  step = inner.ReplicaStep(model_lib.make_loss_fn(cfg), opt, mesh=inner.local_mesh())
  state = [step.place(state_lib.init_replica_state(opt, jax.device_put(params0),
                                                   config.replicas_per_host))]

  def one_round(_):
    for _ in range(config.inner_steps):
      state[0], _ = step(state[0], data.next_batch())
    jax.block_until_ready(state)

  return one_round


def full_collection_s(times: int = 3) -> float:
  """The median pause of a full garbage collection in this process, as it is now."""
  pauses = []
  for _ in range(times):
    t = time.perf_counter()
    gc.collect()
    pauses.append(time.perf_counter() - t)
  return statistics.median(pauses)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rounds", type=int, default=12, help="rounds, the first untimed")
  parser.add_argument("--inner_steps", type=int, default=50, help="H")
  parser.add_argument("--batch_size", type=int, default=16,
                      help="sequences per replica (--config=tiny)")
  parser.add_argument("--num_layers", type=int, default=0, help="default: the config's")
  parser.add_argument("--config", choices=("tiny", "peer"), default="tiny",
                      help="configs/tiny.py's model and K=4, or configs/peer.py's and K=1")
  parser.add_argument("--one_core", action="store_true",
                      help="one CPU core, XLA on one thread")
  args = harness.parse_args(parser, "overhead",
                           dict(rounds=2, inner_steps=2, batch_size=4, num_layers=1))
  config = bench_config(args)
  tokens_per_round = (config.inner_steps * config.replicas_per_host * config.batch_size
                      * config.model.seq_len)
  with dispatch.Dispatcher() as dispatcher, tempfile.TemporaryDirectory() as workdir:
    params0 = initial_params(config)
    loops = {"diloco": diloco_loop(config, dispatcher, workdir),
             "plain": plain_loop(config, params0, per_replica_batches=True),
             "plain_big": plain_loop(config, params0, per_replica_batches=False),
             "local": local_loop(config, params0)}
    if config.replicas_per_host == 1:
      del loops["plain_big"]
    samples = {name: [] for name in loops}
    for r in range(1, args.rounds + 1):
      for name, one_round in loops.items():
        t = time.perf_counter()
        one_round(r)
        if r > 1:  # round 1 compiles
          samples[name].append(tokens_per_round / (time.perf_counter() - t))
      print(f"round {r}/{args.rounds}: " + ", ".join(
          f"{n} {s[-1]:,.0f}" for n, s in samples.items() if s), flush=True)
    # What a full collection costs with every loop's objects alive: as after a start, and
    # once the start's objects are frozen (runtime/collector.py; a trainer's start does it)
    pauses = {"objects": len(gc.get_objects()), "start": full_collection_s()}
    collector.settled()
    pauses["settled"] = full_collection_s()
    collector.released()
  median = {name: statistics.median(s) for name, s in samples.items()}
  result = {
      "config": {"name": args.config, "one_core": args.one_core,
                 "replicas": config.replicas_per_host, "inner_steps": config.inner_steps,
                 "batch_size": config.batch_size, "seq_len": config.model.seq_len,
                 "d_model": config.model.d_model, "num_layers": config.model.num_layers,
                 "rounds_timed": args.rounds - 1},
      "tokens_per_sec": median, "samples": samples,
      "ratio_diloco_vs_plain": median["diloco"] / median["plain"],
      "ratio_diloco_vs_plain_big": (median["diloco"] / median["plain_big"]
                                    if "plain_big" in median else None),
      "ratio_local_vs_plain": median["local"] / median["plain"],
      "ratio_diloco_vs_local": median["diloco"] / median["local"],
      "full_collection_s": pauses,
      "device": str(jax.devices()[0]), "jax": jax.__version__, "smoke": args.smoke,
      **harness.provenance("overhead"),
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{'loop':>10} | tokens/s (median of {args.rounds - 1} rounds)")
  for name in loops:
    print(f"{name:>10} | {median[name]:,.0f}")
  print(f"DiLoCo / plain AdamW loop (same per-step batch): {result['ratio_diloco_vs_plain']:.3f}")
  if "plain_big" in median:
    print(f"DiLoCo / plain AdamW loop (K x batch per step):  "
          f"{result['ratio_diloco_vs_plain_big']:.3f}")
  print(f"DiLoCo / same replicas without outer steps:      {result['ratio_diloco_vs_local']:.3f}")
  print(f"trainer's inner step / plain AdamW loop:         {result['ratio_local_vs_plain']:.3f}")
  print(f"a full garbage collection ({pauses['objects']:,} objects): {pauses['start']:.4f} s, "
        f"{pauses['settled']:.4f} s once the start's objects are frozen")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
