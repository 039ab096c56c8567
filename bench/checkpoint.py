"""What a checkpoint costs next to a round: ≈25M-param model, one host, sync, H=50.

  python -m bench.checkpoint [--batch_size=8] [--rounds=3] [--overlap_rounds=3] [--out=...]
  python -m bench.checkpoint --smoke  # seconds: configs/tiny.py's model, 4 rounds of 2 steps

Runs the real trainer (`Trainer.run_round`, one replica, one process, no
jax.distributed) on bench/outer_step.py's "25m" model (configs/tiny.py with 8 blocks of
width 512; `--model=tiny`: configs/tiny.py's) and measures, as `Trainer.run` would see them:
  round          `run_round(r)` up to `jax.block_until_ready` of the state; round 1
                 (compiling) excluded; median of `--rounds` rounds with no save writing;
  blocking       what `checkpointer.save(trainer.snapshot(r))` returns (the copy into
                 host memory on the main thread), and the wall time of that call;
  full save      from the save call until `checkpointer.wait()` returns (nothing else
                 running), after each of those rounds;
  round + write  `--overlap_rounds` more rounds, each started right after a save that
                 is not waited for (as in `Trainer.run`): the round with orbax writing
                 in the background on the same CPU cores;
  restore        a fresh `Trainer` on the same workdir calling `resume()` (the files are
                 likely still in the page cache), and whether the restored outer state
                 (the anchor, and every other leaf) and replicas equal the saved ones bit
                 for bit;
  size           bytes on disk of one checkpoint step directory.
Prints a table and the ratios to the round length; writes bench/results/checkpoint.json
(--smoke: --out, or a file in a temporary directory).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp

import diloco_jax
from bench import harness
from bench.outer_step import MODELS
from configs import tiny
from diloco_jax.loop import trainer as trainer_lib
from diloco_jax.wire import dispatch


def bench_config(args, total_rounds: int):
  config = tiny.get_config()
  for flag in MODELS[args.model]:  # "--config.model.d_model=512" -> config.model.d_model = 512
    key, value = flag.removeprefix("--config.").split("=")
    *path, leaf = key.split(".")
    node = functools.reduce(getattr, path, config)
    setattr(node, leaf, type(getattr(node, leaf))(value))
  config.mode, config.replicas_per_host = "sync", 1
  config.inner_steps, config.batch_size = args.inner_steps, args.batch_size
  config.num_rounds = total_rounds + 1  # never reached: no final eval, no end-of-run save
  config.inner.warmup_steps = min(config.inner.warmup_steps,
                                  config.num_rounds * config.inner_steps - 1)
  config.eval_every = 10 ** 6
  return config


def held(trainer):
  """What a checkpoint holds of the trainer's state: the outer state (the rule's state, the
  anchor in it, and the skip counters and error-feedback residuals) and the replicas."""
  o = trainer.state.outer
  return (o.state, o.skips, o.residuals), trainer.state.replicas


def timed_round(trainer, r: int) -> float:
  t = time.perf_counter()
  trainer.run_round(r)
  jax.block_until_ready(held(trainer))
  return time.perf_counter() - t


def timed_save(trainer, r: int) -> tuple[float, float]:
  """(seconds `save` returns as blocking, wall seconds of the call on this thread)."""
  t = time.perf_counter()
  blocking = trainer.parts.storage.store.save(trainer.snapshot(r))
  return blocking, time.perf_counter() - t


def host_copy(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def same(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="25m", choices=sorted(MODELS),
                      help="bench/outer_step.py's MODELS")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--inner_steps", type=int, default=50)
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each then saved")
  parser.add_argument("--overlap_rounds", type=int, default=3)
  parser.add_argument("--workdir", default=None, help="default: a temporary directory")
  args = harness.parse_args(parser, "checkpoint", dict(
      model="tiny", batch_size=2, inner_steps=2, rounds=1, overlap_rounds=2))
  start = time.perf_counter()
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_checkpoint_")
  config = bench_config(args, total_rounds=1 + args.rounds + args.overlap_rounds)
  rounds, saves = [], []  # one dict per timed round / per save

  with dispatch.Dispatcher() as dispatcher:
    trainer = trainer_lib.Trainer(config, workdir, dispatcher)
    print(f"model {trainer.parts.model.num_params:,} params; batch {config.batch_size} x "
          f"{config.model.seq_len} tokens; H={config.inner_steps}", flush=True)
    print(f"round 1 (compiles): {timed_round(trainer, 1):.1f} s", flush=True)
    r = 1
    for _ in range(args.rounds):  # a round, then a save waited for
      r += 1
      rounds.append({"round": r, "seconds": timed_round(trainer, r), "write_behind": False})
      t = time.perf_counter()
      blocking, wall = timed_save(trainer, r)
      trainer.parts.storage.store.wait()
      saves.append({"round": r, "blocking": blocking, "wall": wall,
                    "full": time.perf_counter() - t})
      print(f"round {r}: {rounds[-1]['seconds']:.1f} s; save: blocking {blocking:.3f} s, "
            f"full {saves[-1]['full']:.2f} s", flush=True)
    for i in range(args.overlap_rounds):  # as Trainer.run: the write overlaps the next round
      r += 1
      behind = i > 0  # the save before the first of these was waited for
      rounds.append({"round": r, "seconds": timed_round(trainer, r), "write_behind": behind})
      blocking, wall = timed_save(trainer, r)
      saves.append({"round": r, "blocking": blocking, "wall": wall, "full": None})
      print(f"round {r}{' (a save writing behind it)' if behind else ''}: "
            f"{rounds[-1]['seconds']:.1f} s; save: blocking {blocking:.3f} s", flush=True)
    saved = host_copy(held(trainer))  # what round r's save holds
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(saved))
    trainer.parts.storage.store.wait()
    trainer.parts.storage.store.close()
    step_dir = os.path.join(trainer.parts.storage.store.directory, str(r))
    size = dir_bytes(step_dir)

    fresh = trainer_lib.Trainer(config, workdir, dispatcher)
    t = time.perf_counter()
    restored_round = fresh.resume()
    restore = time.perf_counter() - t
    anchor_ok = restored_round == r and same(saved[0][0].anchor, fresh.state.outer.state.anchor)
    state_ok = restored_round == r and same(saved, held(fresh))
    fresh.parts.storage.store.close()
  if args.workdir is None:
    shutil.rmtree(workdir, ignore_errors=True)

  median = lambda xs: statistics.median(xs) if xs else None
  round_s = median([x["seconds"] for x in rounds if not x["write_behind"]])
  round_behind_s = median([x["seconds"] for x in rounds if x["write_behind"]])
  blocking_s, wall_s = median([s["blocking"] for s in saves]), median([s["wall"] for s in saves])
  full_s = median([s["full"] for s in saves if s["full"] is not None])
  result = {
      "config": {"model": f"bench/outer_step.py {args.model}"
                          + (" (configs/tiny.py + 8 x 512)" if args.model == "25m" else ""),
                 "num_layers": config.model.num_layers, "d_model": config.model.d_model,
                 "num_heads": config.model.num_heads, "mlp_dim": config.model.mlp_dim,
                 "seq_len": config.model.seq_len, "vocab_size": config.data.vocab_size,
                 "batch_size": config.batch_size, "inner_steps": config.inner_steps,
                 "mode": config.mode, "replicas_per_host": config.replicas_per_host,
                 "checkpoint_keep": config.checkpoint.keep, "rounds_timed": args.rounds,
                 "overlap_rounds": args.overlap_rounds, "extrapolated": False},
      "params": trainer.parts.model.num_params, "state_bytes": state_bytes,
      "round_seconds": round_s, "round_with_write_behind_seconds": round_behind_s,
      "save_blocking_seconds": blocking_s, "save_call_wall_seconds": wall_s,
      "save_full_seconds": full_s, "restore_seconds": restore,
      "checkpoint_mb": size / 1e6, "restored_round": restored_round,
      "anchor_bit_exact": anchor_ok, "state_bit_exact": state_ok,
      "blocking_over_round": blocking_s / round_s, "wall_over_round": wall_s / round_s,
      "full_over_round": full_s / round_s,
      "rounds": rounds, "saves": saves,
      "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
      "jax": jax.__version__, "orbax_checkpoint": ocp.__version__,
      "diloco_jax": diloco_jax.__version__,
      "total_seconds": time.perf_counter() - start, "smoke": args.smoke,
      **harness.provenance("checkpoint"),
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)

  n_clean = sum(not x["write_behind"] for x in rounds)
  print(f"\n{trainer.parts.model.num_params / 1e6:.2f}M params, batch {config.batch_size}, "
        f"H={config.inner_steps}, sync, 1 replica; jax {jax.__version__}, "
        f"orbax {ocp.__version__}")
  print("| what | seconds |\n|---|---|")
  print(f"| round (median of {n_clean}) | {round_s:.2f} |")
  if round_behind_s is not None:
    print(f"| round with a save writing behind it (median of {len(rounds) - n_clean}) "
          f"| {round_behind_s:.2f} |")
  print(f"| save: blocking part, returned (median of {len(saves)}) | {blocking_s:.3f} |")
  print(f"| save: wall time of the call (median of {len(saves)}) | {wall_s:.3f} |")
  print(f"| save: full, call to wait() (median of {args.rounds}) | {full_s:.2f} |")
  print(f"| restore: fresh Trainer.resume() | {restore:.2f} |")
  print(f"checkpoint size: {size / 1e6:.1f} MB on disk (state {state_bytes / 1e6:.1f} MB)")
  print(f"blocking / round: {100 * blocking_s / round_s:.2f}% (call wall time "
        f"{100 * wall_s / round_s:.2f}%; target <= 5%)")
  print(f"full save / round: {100 * full_s / round_s:.1f}%")
  print(f"restore: round {restored_round} of {r}; anchor bit-exact: "
        f"{'PASS' if anchor_ok else 'FAIL'}; whole state bit-exact: "
        f"{'PASS' if state_ok else 'FAIL'}")
  print(f"wrote {args.out} ({result['total_seconds']:.0f} s in all)")


if __name__ == "__main__":
  main()
