"""What DiLoCo costs on top of plain training, measured side by side in one process.

  python bench/overhead.py [--rounds=6] [--repeats=3]

Three loops over the same model (configs/tiny.py's), the same data pipeline and the same
tokens per step (K=4 replicas x 16 sequences, H=50):
  diloco : the trainer's own loop (`train_and_evaluate`, mode sync): K replicas, an outer
           step every H steps;
  plain  : an independent, plain jitted AdamW loop on one set of params with the K
           replicas' batches concatenated (the same tokens per step);
  local  : the trainer's inner step alone (K replicas, no outer step), to separate the cost
           of the outer step from that of holding K replicas.
Loops alternate, `--repeats` times each; tokens/s is the median over repeats of tokens
divided by wall time with the first (compiling) round excluded. Writes
bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import tiny  # noqa: E402
from diloco_jax import data as data_lib  # noqa: E402
from diloco_jax import inner  # noqa: E402
from diloco_jax import model as model_lib  # noqa: E402
from diloco_jax import optim  # noqa: E402
from diloco_jax import state as state_lib  # noqa: E402
from diloco_jax import trainer  # noqa: E402


def bench_config(rounds: int):
  config = tiny.get_config()
  config.inner_steps = 50
  config.num_rounds = rounds
  config.eval_every = 10 ** 6  # Evaluate only after the last round (excluded below).
  config.eval_batches = 1
  return config


def make_data(config):
  return data_lib.make_host_data(config.data, seq_len=config.model.seq_len,
                                 batch_size=config.batch_size,
                                 replicas_per_host=config.replicas_per_host,
                                 num_eval_batches=config.eval_batches)


def run_diloco(config) -> float:
  with tempfile.TemporaryDirectory() as workdir:
    result = trainer.train_and_evaluate(config, workdir)
  # Round 1 compiles and the last round evaluates: time the rounds in between.
  rounds = result.records[1:-1]
  tokens = sum(r["tokens_per_sec"] * r["round_time"] for r in rounds)
  return tokens / sum(r["round_time"] for r in rounds)


def run_plain(config) -> float:
  """A plain AdamW loop written here, independent of the trainer: one params, big batch."""
  data = make_data(config)
  cfg = model_lib.GPTConfig.from_config(config.model, data.spec.vocab_size)
  loss_fn = model_lib.make_loss_fn(cfg)
  opt = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)

  @jax.jit
  def init(key):
    params = model_lib.GPT(cfg).init(key, np.zeros((1, cfg.seq_len), np.int32))["params"]
    return params, opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
  params, opt_state = init(jax.random.key(0))
  next_batch = lambda: data.next_batch().reshape(-1, cfg.seq_len + 1)  # [K*B, L+1]
  return _time_rounds(config, lambda p: step(*p, next_batch())[:2], (params, opt_state))


def run_local(config) -> float:
  """The trainer's inner step over K replicas with no outer step."""
  data = make_data(config)
  cfg = model_lib.GPTConfig.from_config(config.model, data.spec.vocab_size)
  opt = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  step = inner.ReplicaStep(model_lib.make_loss_fn(cfg), opt, mesh=inner.local_mesh())
  anchor = model_lib.init_params(cfg, jax.random.key(0))
  state = step.place(state_lib.init_replica_state(opt, anchor, config.replicas_per_host))
  return _time_rounds(config, lambda s: step(s, data.next_batch())[0], state)


def _time_rounds(config, step, state) -> float:
  tokens_per_step = config.replicas_per_host * config.batch_size * config.model.seq_len
  times = []
  for _ in range(config.num_rounds - 1):  # The same rounds as run_diloco times, plus one.
    t = time.perf_counter()
    for _ in range(config.inner_steps):
      state = step(state)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
  return config.inner_steps * tokens_per_step * len(times[1:]) / sum(times[1:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "overhead.json"))
  args = parser.parse_args()
  config = bench_config(args.rounds)
  runs = {"diloco": run_diloco, "plain": run_plain, "local": run_local}
  samples = {name: [] for name in runs}
  for i in range(args.repeats):
    for name, fn in runs.items():
      samples[name].append(fn(config))
      print(f"repeat {i + 1}/{args.repeats} {name:>6}: {samples[name][-1]:,.0f} tokens/s",
            flush=True)
  median = {name: statistics.median(s) for name, s in samples.items()}
  result = {
      "config": {"replicas": config.replicas_per_host, "inner_steps": config.inner_steps,
                 "batch_size": config.batch_size, "seq_len": config.model.seq_len,
                 "d_model": config.model.d_model, "num_layers": config.model.num_layers,
                 "rounds_timed": args.rounds - 2, "repeats": args.repeats},
      "tokens_per_sec": median, "samples": samples,
      "ratio_diloco_vs_plain": median["diloco"] / median["plain"],
      "ratio_diloco_vs_local": median["diloco"] / median["local"],
      "device": str(jax.devices()[0]), "jax": jax.__version__,
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{'loop':>8} | tokens/s (median of {args.repeats})")
  for name in runs:
    print(f"{name:>8} | {median[name]:,.0f}")
  print(f"DiLoCo / plain AdamW loop: {result['ratio_diloco_vs_plain']:.3f}")
  print(f"DiLoCo / same replicas without outer steps: {result['ratio_diloco_vs_local']:.3f}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
