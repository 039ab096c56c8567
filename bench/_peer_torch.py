"""One torchft DiLoCo replica for bench/peer.py (not a bench itself; runs in the peer venv).

  VENV/bin/python bench/_peer_torch.py --spec=SPEC.json --replica=0 --lighthouse=http://... \
      --out=RESULT.json
  VENV/bin/python bench/_peer_torch.py --spec=SPEC.json --check=PARAMS.npz --out=RESULT.json

Used by bench/peer.py (loopback) and bench/peer_wan.py (each replica in a network namespace
of its own: --address is this replica's address there; --fragments, --sync_delay and
--quantize select torchft's streaming DiLoCo and its quantized all-reduce).

The PyTorch twin of diloco_jax's `gpt` family with `use_bias=False` (the same shapes,
tanh GELU, LayerNorm eps from the spec's `norm_eps`, N(0, 0.02) init, residual projections
scaled by depth), trained by torchft's `DiLoCo` (one fragment: plain DiLoCo) under a
`Manager` with a `ProcessGroupGloo`; this process is a replica group of one. The inner loop is AdamW
(decay on matrices and embeddings only, global-norm clipping, as optim.py), fed random
windows of seq_len + 1 bytes from the first 1 − eval_fraction of the data (the part
diloco_jax trains on). Writes, as JSON: per-round times and losses, the time spent in
DiLoCo's step hook on sync steps (quorum, allreduce of the pseudo-gradients, outer step,
commit), the time of the first inner step, the params and the peak RSS. Imports nothing
from diloco_jax: it runs where jax is not installed. With --check it only compares its
logits with diloco_jax's for the same params (bench/peer.py does, before timing anything),
and needs torch only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
  """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x)); no biases."""

  def __init__(self, d: int, heads: int, mlp: int, layers: int, eps: float):
    super().__init__()
    self.heads = heads
    self.ln_attn = nn.LayerNorm(d, eps=eps, bias=False)
    self.qkv = nn.Linear(d, 3 * d, bias=False)
    self.attn_out = nn.Linear(d, d, bias=False)
    self.ln_mlp = nn.LayerNorm(d, eps=eps, bias=False)
    self.mlp_in = nn.Linear(d, mlp, bias=False)
    self.mlp_out = nn.Linear(mlp, d, bias=False)
    for lin, std in ((self.qkv, 0.02), (self.mlp_in, 0.02),
                     (self.attn_out, 0.02 / (2 * layers) ** 0.5),
                     (self.mlp_out, 0.02 / (2 * layers) ** 0.5)):
      nn.init.normal_(lin.weight, std=std)

  def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
    b, l, d = x_BxLxD.shape
    qkv = self.qkv(self.ln_attn(x_BxLxD)).view(b, l, 3, self.heads, d // self.heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, N, L, H]
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x_BxLxD = x_BxLxD + self.attn_out(attn.transpose(1, 2).reshape(b, l, d))
    h = F.gelu(self.mlp_in(self.ln_mlp(x_BxLxD)), approximate="tanh")
    return x_BxLxD + self.mlp_out(h)


class GPT(nn.Module):
  """Token + learned position embeddings, blocks, final LayerNorm, untied head."""

  def __init__(self, vocab: int, seq_len: int, d: int, heads: int, mlp: int, layers: int,
               eps: float):
    super().__init__()
    self.embed = nn.Embedding(vocab, d)
    self.pos_embed = nn.Parameter(torch.randn(seq_len, d) * 0.02)
    self.blocks = nn.ModuleList(Block(d, heads, mlp, layers, eps) for _ in range(layers))
    self.ln_final = nn.LayerNorm(d, eps=eps, bias=False)
    self.head = nn.Linear(d, vocab, bias=False)
    nn.init.normal_(self.embed.weight, std=0.02)
    nn.init.normal_(self.head.weight, std=0.02)

  def forward(self, tokens_BxL: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens_BxL) + self.pos_embed[: tokens_BxL.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_final(x))


def from_flax(model: GPT, arrays: dict[str, np.ndarray]) -> None:
  """Loads diloco_jax's params, flattened as {"block_0.qkv.kernel": array, ...}, into
  `model` (Dense kernels [in, out] become Linear weights [out, in]; the fused qkv output
  is [3, N, H] on both sides)."""
  state = {"embed.weight": arrays["embed.embedding"], "pos_embed": arrays["pos_embed"],
           "ln_final.weight": arrays["ln_final.scale"], "head.weight": arrays["head.kernel"].T}
  for i in range(len(model.blocks)):
    for name in ("qkv", "attn_out", "mlp_in", "mlp_out"):
      state[f"blocks.{i}.{name}.weight"] = arrays[f"block_{i}.{name}.kernel"].T
    for name in ("ln_attn", "ln_mlp"):
      state[f"blocks.{i}.{name}.weight"] = arrays[f"block_{i}.{name}.scale"]
  model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                         for k, v in state.items()}, strict=True)


def check_logits(s: dict, path: str) -> dict:
  """The largest difference between diloco_jax's logits (in the .npz at `path`, with its
  params and tokens) and this model's with the same params."""
  arrays = dict(np.load(path))
  tokens, logits = arrays.pop("tokens"), arrays.pop("logits")
  model = GPT(256, s["seq_len"], s["d_model"], s["num_heads"], s["mlp_dim"], s["num_layers"],
              s["norm_eps"])
  from_flax(model, arrays)
  with torch.no_grad():
    ours = model(torch.from_numpy(tokens.astype(np.int64))).numpy()
  return {"max_abs_logit_diff": float(np.abs(ours - logits).max()),
          "max_abs_logit": float(np.abs(logits).max())}


def read_bytes(path: str) -> np.ndarray:
  """The bytes of a file, or of every file under a directory in sorted order (the
  directories bench/peer.py makes hold only text files, so nothing is skipped)."""
  if not os.path.isdir(path):
    files = [path]
  else:
    files = sorted(os.path.join(root, name) for root, dirs, names in os.walk(path)
                   for name in names if not name.startswith("."))
  return np.frombuffer(b"".join(open(f, "rb").read() for f in files), np.uint8)


def fragments(model: GPT, num: int) -> list[nn.Module]:
  """The model in `num` parts of whole blocks for streaming DiLoCo, each part a module
  holding (not copying) its parameters; part 0 also holds the embeddings, the final norm
  and the head, as diloco_jax's fragment layout does."""
  if num == 1:
    return [model]
  per = len(model.blocks) // num
  parts = []
  for p in range(num):
    part = nn.ModuleDict({f"block_{i}": model.blocks[i] for i in range(p * per, (p + 1) * per)})
    if p == 0:
      part.update({"embed": model.embed, "ln_final": model.ln_final, "head": model.head})
      part.register_parameter("pos_embed", model.pos_embed)
    parts.append(part)
  return parts


def _triton() -> bool:
  """Whether torchft's quantized all-reduce runs: without triton, `should_quantize` sends
  float32 as if it were off."""
  from torchft import manager  # noqa: PLC0415
  return bool(getattr(manager, "IS_TRITON_AVAILABLE", False))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", required=True, help="JSON: shapes, recipe, rounds")
  parser.add_argument("--replica", type=int, default=0)
  parser.add_argument("--lighthouse", default="", help="http://host:port")
  parser.add_argument("--out", required=True)
  parser.add_argument("--address", default="127.0.0.1",
                      help="this replica's address, where the other replica reaches its store")
  parser.add_argument("--fragments", type=int, default=1,
                      help="streaming DiLoCo's fragments (1: DiLoCo)")
  parser.add_argument("--sync_delay", type=int, default=0,
                      help="DiLoCo's fragment_sync_delay: inner steps a fragment's all-reduce "
                           "runs behind")
  parser.add_argument("--quantize", action="store_true",
                      help="DiLoCo's should_quantize (fp8 all-reduce; needs triton)")
  parser.add_argument("--check", default="", help="an .npz of diloco_jax's params, tokens and "
                      "logits: compare this model's logits with them and exit")
  args = parser.parse_args()
  with open(args.spec) as f:
    s = json.load(f)
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  if args.check:
    with open(args.out, "w") as f:
      json.dump(check_logits(s, args.check), f)
    return

  # torchft only here: --check runs with torch alone (the test suite's, tests/test_bench_cli.py).
  from torchft import Manager  # noqa: PLC0415
  from torchft import ProcessGroupGloo  # noqa: PLC0415
  from torchft.local_sgd import DiLoCo  # noqa: PLC0415

  data = read_bytes(s["data_path"])
  num_windows = (len(data) - 1) // s["seq_len"]
  train_end = (num_windows - int(num_windows * s["eval_fraction"])) * s["seq_len"]
  rng = np.random.default_rng(1000 + args.replica)

  # diloco_jax's eval set: the first eval_batches x batch_size held-out windows (stride L).
  eval_windows = [data[(train_end // s["seq_len"] + i) * s["seq_len"]:][:s["seq_len"] + 1]
                  for i in range(s.get("eval_batches", 0) * s["batch_size"])]
  eval_set = torch.from_numpy(np.stack(eval_windows).astype(np.int64)) if eval_windows else None

  def evaluate() -> float:
    """Mean over the eval batches of each batch's mean token loss, as diloco_jax's eval."""
    with torch.no_grad():
      losses = []
      for batch in eval_set.split(s["batch_size"]):
        logits = model(batch[:, :-1])
        losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            batch[:, 1:].reshape(-1))))
    return sum(losses) / len(losses)

  def next_batch() -> torch.Tensor:
    starts = rng.integers(0, train_end - s["seq_len"], size=s["batch_size"])
    windows = np.stack([data[i:i + s["seq_len"] + 1] for i in starts])
    return torch.from_numpy(windows.astype(np.int64))

  torch.manual_seed(s["seed"])  # the same initial params on every replica
  model = GPT(256, s["seq_len"], s["d_model"], s["num_heads"], s["mlp_dim"], s["num_layers"],
              s["norm_eps"])
  num_params = sum(p.numel() for p in model.parameters())
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  inner_opt = torch.optim.AdamW(
      [{"params": decay, "weight_decay": s["weight_decay"]},
       {"params": no_decay, "weight_decay": 0.0}],
      lr=s["lr"], betas=(s["b1"], s["b2"]), eps=s["eps"])
  outer_opt = torch.optim.SGD(model.parameters(), lr=s["outer_lr"],
                              momentum=s["outer_momentum"], nesterov=s["nesterov"])

  def state_dict() -> dict:  # what a recovering replica would fetch from a healthy one
    return {"model": model.state_dict(), "inner": inner_opt.state_dict()}

  def load_state_dict(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner_opt.load_state_dict(state["inner"])

  # A replica group of one process: its own TCPStore, rank 0 of world size 1.
  store = torch.distributed.TCPStore(args.address, 0, is_master=True, wait_for_workers=False)
  manager = Manager(
      pg=ProcessGroupGloo(), min_replica_size=2,
      use_async_quorum=False,  # DiLoCo requires a synchronous quorum
      load_state_dict=load_state_dict, state_dict=state_dict,
      replica_id=f"peer_{args.replica}", store_addr=args.address, store_port=store.port,
      rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname=args.address,
      # Both replicas start from the same seed: nothing to send at the first quorum.
      init_sync=False)
  parts = fragments(model, args.fragments)
  outer_opts = [torch.optim.SGD(p.parameters(), lr=s["outer_lr"], momentum=s["outer_momentum"],
                                nesterov=s["nesterov"]) for p in parts]
  diloco = DiLoCo(manager, parts, inner_opt, outer_opts if len(parts) > 1 else outer_opt,
                  sync_every=s["inner_steps"], fragment_sync_delay=args.sync_delay,
                  should_quantize=args.quantize)

  hook_times: list[float] = []
  hook = diloco._step_post_hook  # the sync runs inside it, after every H-th step

  def timed_hook(*a, **kw):
    t = time.perf_counter()
    hook(*a, **kw)
    hook_times.append(time.perf_counter() - t)

  diloco._step_post_hook = timed_hook  # read by __enter__ when it registers the hook
  h, round_times, round_losses, t_first_step = s["inner_steps"], [], [], None
  eval_losses, wait_times = [], []
  with diloco:
    for _ in range(s["rounds"]):
      t = time.perf_counter()
      if t_first_step is None:
        t_first_step = time.time()
      loss_sum = torch.zeros(())
      for _ in range(h):
        batch = next_batch()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        if s["clip_norm"] > 0:
          torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
        inner_opt.step()  # DiLoCo's hook syncs after the H-th
        loss_sum += loss.detach()
      round_times.append(time.perf_counter() - t)
      round_losses.append(float(loss_sum) / h)
      wait_times.append(sum(hook_times[-h:]))  # every step's hook, syncs and quorums
      if eval_set is not None:  # outside the round's time, as diloco_jax's runs behind it
        eval_losses.append(evaluate())
  outer_times = hook_times[h - 1::h]
  result = {"replica": args.replica, "params": num_params, "round_times": round_times,
            "train_losses": round_losses, "outer_times": outer_times,
            "wait_times": wait_times, "eval_losses": eval_losses,
            "quantized": bool(args.quantize and _triton()),
            "manager_step": manager.current_step(), "t_first_step": t_first_step,
            "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0))}
  with open(args.out, "w") as f:
    json.dump(result, f)
  manager.shutdown(wait=False)


if __name__ == "__main__":
  main()
