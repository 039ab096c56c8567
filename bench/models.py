"""Training speed of the model families at equal parameter count, side by side.

  python -m bench.models [--d_model=256] [--num_layers=4] [--gpt_mlp_dim=1024] [--rounds=8]
  python -m bench.models --smoke  # seconds: a 2-block width-32 model, 2 rounds

The `gpt` model has the given shape; the `llama` model the same width, depth and heads,
with its SwiGLU width chosen so that its parameter count is the closest to the gpt's
(SwiGLU has three matrices to GELU's two: about 2/3 of the gpt's MLP width; the llama
family has no biases and no position table). Both run the same jitted AdamW step (loss,
gradients, update) on the same random batches; they take turns round by round (`--steps`
steps each, waited for) so that drifts in a shared machine's speed hit both alike.
tokens/s is the median over rounds, the first (compiling) round excluded; FLOP/s counts
`model.flops_per_token` (6N over matmul params plus attention). Writes
bench/results/models.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

from bench import harness
from diloco_jax.models import family as family_lib
from diloco_jax.models import model as model_lib

SMOKE = {"d_model": 32, "num_layers": 2, "num_heads": 2, "gpt_mlp_dim": 64, "seq_len": 16,
         "batch_size": 2, "vocab_size": 64, "steps": 2, "rounds": 2}


def configs(args) -> dict[str, family_lib.ModelConfig]:
  shape = dict(vocab_size=args.vocab_size, seq_len=args.seq_len, num_layers=args.num_layers,
               d_model=args.d_model, num_heads=args.num_heads, dtype=jnp.dtype(args.dtype))
  gpt = family_lib.ModelConfig(**shape, mlp_dim=args.gpt_mlp_dim, family="gpt")
  target = model_lib.num_params_of(gpt)
  # The llama's params grow by 3·D·layers per unit of SwiGLU width: solve, then round.
  width = round((target - model_lib.num_params_of(
      family_lib.ModelConfig(**shape, mlp_dim=0, family="llama")))
      / (3 * args.d_model * args.num_layers))
  return {"gpt": gpt, "llama": family_lib.ModelConfig(**shape, mlp_dim=max(width, 1),
                                                     family="llama")}


def train_loop(cfg: family_lib.ModelConfig, batches: jax.Array, steps: int):
  """One round: `steps` AdamW steps over `batches` [steps, B, L+1], waited for."""
  optimizer = optax.adamw(1e-3)
  loss_fn = model_lib.make_loss_fn(cfg)

  @jax.jit
  def step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = model_lib.init_params(cfg, jax.random.key(0))
  carry = [params, optimizer.init(params)]

  def one_round():
    for i in range(steps):
      carry[0], carry[1], loss = step((carry[0], carry[1]), batches[i])
    jax.block_until_ready(loss)

  return one_round


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--num_layers", type=int, default=4)
  parser.add_argument("--num_heads", type=int, default=4)
  parser.add_argument("--gpt_mlp_dim", type=int, default=1024)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=4096)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--steps", type=int, default=5, help="steps per round and family")
  parser.add_argument("--rounds", type=int, default=8, help="rounds, the first not timed")
  args = harness.parse_args(parser, "models", SMOKE, argv)

  cfgs = configs(args)
  batches = jax.random.randint(jax.random.key(1), (args.steps, args.batch_size,
                                                   args.seq_len + 1), 0, args.vocab_size)
  loops = {name: train_loop(cfg, batches, args.steps) for name, cfg in cfgs.items()}
  tokens = args.steps * args.batch_size * args.seq_len
  samples = {name: [] for name in loops}
  for r in range(1, args.rounds + 1):
    for name, one_round in loops.items():
      t = time.perf_counter()
      one_round()
      if r > 1:  # round 1 compiles
        samples[name].append(tokens / (time.perf_counter() - t))
    print(f"round {r}/{args.rounds}: " + ", ".join(
        f"{n} {s[-1]:,.0f} tok/s" for n, s in samples.items() if s), flush=True)

  rows = []
  for name, cfg in cfgs.items():
    n = model_lib.num_params_of(cfg)
    speed = statistics.median(samples[name])
    rows.append({"family": name, "params": n, "mlp_dim": cfg.mlp_dim,
                 "flops_per_token": model_lib.flops_per_token(cfg, n),
                 "tokens_per_sec": speed,
                 "flops_per_sec": speed * model_lib.flops_per_token(cfg, n)})
  by = {row["family"]: row for row in rows}
  result = {"config": {k: getattr(args, k) for k in ("d_model", "num_layers", "num_heads",
                                                       "gpt_mlp_dim", "seq_len", "batch_size",
                                                       "vocab_size", "dtype", "steps")},
            "rounds_timed": args.rounds - 1, "rows": rows, "samples": samples,
            "ratio_llama_vs_gpt": by["llama"]["tokens_per_sec"] / by["gpt"]["tokens_per_sec"],
            "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "smoke": args.smoke, **harness.provenance("models", argv)}
  harness.write(args.out, result, indent=1)
  print("\n| family | params | MLP width | MFLOPs/token | tokens/s | GFLOP/s |\n"
        "|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['family']} | {row['params'] / 1e6:.2f}M | {row['mlp_dim']} | "
          f"{row['flops_per_token'] / 1e6:.1f} | {row['tokens_per_sec']:,.0f} | "
          f"{row['flops_per_sec'] / 1e9:.1f} |")
  print(f"\nllama / gpt tokens/s: {result['ratio_llama_vs_gpt']:.3f} "
        f"({result['device']}); written to {args.out}")


if __name__ == "__main__":
  main()
