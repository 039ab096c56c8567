"""PyTorch's side of bench/inner_step.py (not a bench itself; runs in the peer venv).

  VENV/bin/python bench/_inner_torch.py --spec=SPEC.json --arrays=ARRAYS.npz --out=RESULT.json

On one CPU core (--spec's "cpu", set with os.sched_setaffinity) and one thread
(torch.set_num_threads(1); bench/inner_step.py starts it with OMP_NUM_THREADS=1): the
float32 matmul FLOP/s at the spec's sizes, then one inner step of bench/_peer_torch.py's
model (the same class, given diloco_jax's initial params from ARRAYS.npz) timed, profiled
with torch.profiler, and cut into the components bench/inner_step.py also times in jax,
each alone. The step is the one of bench/_peer_torch.py's training loop: forward,
cross-entropy, zero_grad(set_to_none=True), backward, global-norm clipping, AdamW (decay
on matrices and embeddings only). Imports nothing from diloco_jax: it runs where jax is
not installed. Writes its figures as JSON (seconds, FLOP/s; the profile in ms per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from _peer_torch import GPT  # bench/ is this script's directory, so on sys.path
from _peer_torch import from_flax


def timed(fn, reps: int, warmup: int) -> list[float]:
  """Seconds of each of `reps` calls of `fn`, after `warmup` untimed ones."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return times


def matmul_peak(sizes: list[int], reps: int) -> list[dict]:
  """float32 [n, n] x [n, n] FLOP/s per size: 2n³ over the best and the median product."""
  rows = []
  for n in sizes:
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = timed(lambda a=a, b=b: torch.mm(a, b), reps, warmup=1)
    rows.append({"n": n, "best_s": min(times), "median_s": statistics.median(times),
                 "best_flops_per_sec": 2 * n ** 3 / min(times),
                 "median_flops_per_sec": 2 * n ** 3 / statistics.median(times)})
  return rows


def attention_half(block, x_BxLxD: torch.Tensor) -> torch.Tensor:
  """The first half of _peer_torch.Block.forward: x + attn_out(attention(ln_attn(x)))."""
  b, l, d = x_BxLxD.shape
  qkv = block.qkv(block.ln_attn(x_BxLxD)).view(b, l, 3, block.heads, d // block.heads)
  q, k, v = qkv.permute(2, 0, 3, 1, 4)
  attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
  return x_BxLxD + block.attn_out(attn.transpose(1, 2).reshape(b, l, d))


def mlp_half(block, x_BxLxD: torch.Tensor) -> torch.Tensor:
  """The second half of _peer_torch.Block.forward: x + mlp_out(gelu(mlp_in(ln_mlp(x))))."""
  h = F.gelu(block.mlp_in(block.ln_mlp(x_BxLxD)), approximate="tanh")
  return x_BxLxD + block.mlp_out(h)


def adamw(model: GPT, s: dict) -> torch.optim.AdamW:
  """bench/_peer_torch.py's inner optimizer: decay on matrices and embeddings only."""
  params = list(model.parameters())
  return torch.optim.AdamW(
      [{"params": [p for p in params if p.ndim >= 2], "weight_decay": s["weight_decay"]},
       {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
      lr=s["lr"], betas=(s["b1"], s["b2"]), eps=s["eps"])


def profile(step, steps: int, top: int) -> dict:
  """torch.profiler over `steps` steps: every op's self CPU time per step (the profiler's
  own cost included), the `top` largest."""
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      step()
  ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
  total = sum(e.self_cpu_time_total for e in ops)  # microseconds
  return {"self_ms_per_step": total / 1e3 / steps, "ops": len(ops),
          "top": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / steps,
                   "calls": e.count / steps, "share": e.self_cpu_time_total / total}
                  for e in ops[:top]]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", required=True, help="JSON: shapes, recipe, repetitions")
  parser.add_argument("--arrays", required=True,
                      help=".npz: diloco_jax's params (flattened names) and `batches`")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  with open(args.spec) as f:
    s = json.load(f)
  os.sched_setaffinity(0, {s["cpu"]})  # the parent's core already; said again, to be sure
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  torch.manual_seed(0)
  arrays = dict(np.load(args.arrays))
  batches = torch.from_numpy(arrays.pop("batches").astype(np.int64))  # [S, B, L+1]
  vocab, b, l, d = s["vocab_size"], s["batch_size"], s["seq_len"], s["d_model"]
  model = GPT(vocab, l, d, s["num_heads"], s["mlp_dim"], s["num_layers"], s["norm_eps"])
  from_flax(model, arrays)

  def loss_of(batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))

  with torch.no_grad():  # diloco_jax's params: the same loss as diloco_jax's, or not the model
    first_loss = float(loss_of(batches[0]))

  result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)), "first_loss": first_loss,
            "params": sum(p.numel() for p in model.parameters()),
            "matmul": matmul_peak(s["sizes"], s["matmul_reps"])}

  opt, calls = adamw(model, s), [0]

  def step() -> None:  # bench/_peer_torch.py's inner step, on the batches in turn
    batch = batches[calls[0] % len(batches)]
    calls[0] += 1
    loss = loss_of(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if s["clip_norm"] > 0:
      torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
    opt.step()

  result["step_times"] = timed(step, s["steps"], s["warmup"])
  result["profile"] = profile(step, s["profile_steps"], s["top"])

  # The components, each alone with the step's shapes: a fixed random input and cotangent,
  # the gradients of the params and of the input (a leaf, as the residual stream is to
  # each part), set to None before each pass as the step's zero_grad does.
  tokens, targets = batches[0][:, :-1], batches[0][:, 1:]
  x = torch.randn(b, l, d, requires_grad=True)
  ct = torch.randn(b, l, d)
  block = model.blocks[0]

  def fresh() -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None

  def embeddings() -> None:
    fresh()
    (model.embed(tokens) + model.pos_embed[:l]).backward(ct)

  def attention() -> None:
    fresh()
    attention_half(block, x).backward(ct)

  def mlp() -> None:
    fresh()
    mlp_half(block, x).backward(ct)

  def head_loss() -> None:
    fresh()
    logits = model.head(model.ln_final(x))
    F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()

  # The update from fixed gradients, with an optimizer of its own: its first call (warm-up)
  # creates the moments, as the step's first did. Last: it moves the params.
  grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
  update_opt = adamw(model, s)

  def update() -> None:
    for p, g in zip(model.parameters(), grads):
      p.grad = g
    if s["clip_norm"] > 0:
      torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
    update_opt.step()

  parts = {"embeddings": embeddings, "attention": attention, "mlp": mlp,
           "head_loss": head_loss, "update": update}
  result["components"] = {name: statistics.median(timed(fn, s["component_reps"], warmup=1))
                          for name, fn in parts.items()}
  with open(args.out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
