"""diloco_jax's inner step against PyTorch's on one CPU core: time, share of matmul peak, parts.

  python -m bench.inner_step [--steps=50] [--venv=~/.cache/diloco_jax/peer_venv]
  python -m bench.inner_step --smoke  # seconds: a one-block width-64 model, 2 timed steps

The step: configs/peer.py's 3.3M-param byte-level GPT (vocab 256, width 256, 4 blocks of 4
heads, MLP 1024 with tanh GELU, 128 tokens, batch 8, learned positions, pre-norm LayerNorm,
untied head, no biases) on one batch: forward, mean next-token cross-entropy, backward,
global-norm clip 1.0, AdamW (lr 1e-3, betas .9/.95, weight decay .1 on matrices and
embeddings). Both systems run on the same core (the lowest this script may use: the whole
process is pinned to it with os.sched_setaffinity before jax is imported, and the torch
process it starts inherits it), one after the other, each on one thread:
  diloco_jax  this process: XLA:CPU with XLA_FLAGS=--xla_cpu_multi_thread_eigen=false. The
              step timed is the trainer's own, `device.inner.ReplicaStep` over one replica
              with `algo.optim.inner_optimizer` (as mode sync runs it on one host, with its
              XLA:CPU options), on [1, B, L+1] batches. Taking turns with it, the one-replica
              program it maps, `jax.jit(algo.step.make_train_step(...))` with the same
              options, is timed too (ReplicaStep runs it for one replica with reshapes
              around it): that program is the one XLA's cost_analysis and the profile read.
  torch       bench/_inner_torch.py in the virtualenv --venv (bench/peer.py's, created with
              torch and torchft on first use; never by --smoke, which skips torch where that
              venv has none): bench/_peer_torch.py's model given diloco_jax's initial params
              (its first loss must equal diloco_jax's, to 1e-4), the step of that file's
              training loop, torch.set_num_threads(1), OMP_NUM_THREADS=1.

1. The core's peak: float32 [n, n] x [n, n] matmuls (2n³ FLOPs) at --sizes in each system,
   each size's figure the best of --matmul_reps products; the peak is the best figure of
   either system at any size (the machine's: each system's own is in the JSON too).
2. The step: the median of --steps timed steps after --warmup; FLOP/s = analytic FLOPs per
   step / that time, as a share of the peak. The FLOPs count matmuls only (2·m·n·k each in
   the forward pass, the backward pass twice the forward's), B sequences of L tokens, width
   D, MLP F, vocabulary V:
     3 · 2·B·L · (layers · (4·D² + 2·D·F + 2·L·D) + D·V)
   per block qkv 3·D², attn_out D², mlp_in and mlp_out D·F each, QKᵀ and AV L·D each (the
   causal L x L square whole, as XLA computes it before masking; torch's CPU flash kernel
   skips key blocks past the diagonal, so it does somewhat fewer), and the head D·V;
   embeddings are lookups, and norms, softmax, GELU, the loss and AdamW are left out.
   Printed beside XLA's own count for the compiled one-replica step
   (`.lower(...).compile().cost_analysis()["flops"]`), which counts those elementwise ops
   too: 1.2% more than the matmuls at configs/peer.py's sizes, 7% at --smoke's.
3. Where the time goes, in both systems:
   - components, each timed alone (median of --component_reps) with the step's shapes,
     forward + backward from a fixed random cotangent (gradients of the params and of the
     input): the embeddings (token + position), one block's attention half (LayerNorm, qkv,
     causal attention, attn_out, residual) and its MLP half (LayerNorm, mlp_in, GELU,
     mlp_out, residual), each x layers, the final LayerNorm + head + cross-entropy, and the
     update (global-norm clip + AdamW over all params, from fixed gradients). jax: flax
     modules of the model's own parts (gpt.Block's two halves, line for line), jitted;
     torch: the same parts of bench/_peer_torch.py's modules. The same rows in both columns.
   - jax, inside the step: jax.profiler's trace of --profile_steps steps of the compiled
     one-replica program, where XLA:CPU records every HLO op (thunk) it runs. Each op is put
     under a component by its HLO metadata (op_name, the flax module path): a fusion by its
     matmul's op_name where it has a matmul, else by its root's; a block's ops outside its
     submodules (attention's softmax, GELU, the residual adds) by their output: the MLP's
     where its last dimension is the MLP's width (GELU's), else attention's (both residual
     adds too). Approximate where XLA fuses across parts (e.g. a residual add with the next
     LayerNorm); the step's time outside every op is the runtime's. Also its --top longest
     ops.
   - torch, inside the step: torch.profiler over --profile_steps steps, self CPU time per op
     (key_averages), its --top longest (the profiler's own cost per op included).
Writes bench/results/inner_step.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One core, one thread, before jax is imported: XLA reads its flags once, and its threads
# are created on the core of the thread that creates them.
os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                                 "--xla_cpu_multi_thread_eigen=false")))
CPU = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {CPU})

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from bench import harness  # noqa: E402
from bench import peer  # noqa: E402
from configs import peer as peer_config  # noqa: E402
from diloco_jax.algo import optim  # noqa: E402
from diloco_jax.algo import state as state_lib  # noqa: E402
from diloco_jax.algo import step as step_lib  # noqa: E402
from diloco_jax.device import inner  # noqa: E402
from diloco_jax.models import family  # noqa: E402
from diloco_jax.models import gpt  # noqa: E402
from diloco_jax.models import layers  # noqa: E402
from diloco_jax.models import model as model_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Width 64 rather than 32: at 32 the elementwise ops XLA's FLOP count adds to the matmuls'
# are 22% of them, at 64 7% (tests/test_bench_speed.py holds the two counts within 10%).
SMOKE = {"d_model": 64, "num_layers": 1, "num_heads": 2, "mlp_dim": 256, "seq_len": 32,
         "batch_size": 4, "steps": 2, "warmup": 1, "profile_steps": 1, "component_reps": 2,
         "matmul_reps": 2, "sizes": "64,128"}
COMPONENTS = (  # (key, label, per block)
    ("embeddings", "embeddings (token + position)", False),
    ("attention", "attention half: LayerNorm, qkv, attention, attn_out", True),
    ("mlp", "MLP half: LayerNorm, mlp_in, GELU, mlp_out", True),
    ("head_loss", "final LayerNorm + head + cross-entropy", False),
    ("update", "global-norm clip + AdamW", False))
BATCHES = 4  # distinct batches the steps take in turn
TORCH_TIMEOUT_S = 1800


def timed(fn, reps: int, warmup: int) -> list[float]:
  """Seconds of each of `reps` calls of `fn` (waited for), after `warmup` untimed ones."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return times


def matmul_peak(sizes: list[int], reps: int) -> list[dict]:
  """float32 [n, n] x [n, n] FLOP/s per size: 2n³ over the best and the median product."""
  mm = jax.jit(jnp.matmul)
  rows = []
  for n in sizes:
    a, b = jax.random.normal(jax.random.key(1), (2, n, n), jnp.float32)
    times = timed(lambda a=a, b=b: mm(a, b), reps, warmup=1)
    rows.append({"n": n, "best_s": min(times), "median_s": statistics.median(times),
                 "best_flops_per_sec": 2 * n ** 3 / min(times),
                 "median_flops_per_sec": 2 * n ** 3 / statistics.median(times)})
  return rows


def analytic_flops(b: int, l: int, d: int, f: int, v: int, num_layers: int) -> int:
  """The docstring's count: matmuls only, the backward pass twice the forward."""
  per_block = 4 * d * d + 2 * d * f + 2 * l * d  # qkv + attn_out, MLP, QKᵀ + AV
  return 3 * 2 * b * l * (num_layers * per_block + d * v)


def xla_flops(compiled) -> float:
  costs = compiled.cost_analysis()
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs  # older jax: one per device
  return float(costs["flops"])


# The model's parts for the components, from the same building blocks as gpt.GPT and
# gpt.Block (their params are the model's own subtrees, under the same names).
class Embeddings(nn.Module):
  cfg: Any

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    pos = self.param("pos_embed", nn.initializers.normal(0.02),
                     (self.cfg.positions, self.cfg.d_model))
    return layers.token_embedding(self.cfg)(tokens_BxL) + pos[: tokens_BxL.shape[1]]


class AttentionHalf(nn.Module):
  """gpt.Block's first half: x + attn_out(causal attention(qkv(ln_attn(x))))."""
  cfg: Any

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, l, d = x_BxLxD.shape
    h = gpt.layer_norm(cfg, "ln_attn")(x_BxLxD)
    qkv = gpt.dense(cfg, 3 * d, name="qkv")(h).reshape(b, l, 3, cfg.num_heads,
                                                       d // cfg.num_heads)
    attn = layers.causal_attention(self, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                   jnp.arange(l), decode=False, cache_len=cfg.seq_len,
                                   implementation=cfg.attention)
    return x_BxLxD + gpt.dense(cfg, d, name="attn_out")(attn.reshape(b, l, d))


class MlpHalf(nn.Module):
  """gpt.Block's second half: x + mlp_out(gelu(mlp_in(ln_mlp(x))))."""
  cfg: Any

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    h = gpt.layer_norm(self.cfg, "ln_mlp")(x_BxLxD)
    h = nn.gelu(gpt.dense(self.cfg, self.cfg.mlp_dim, name="mlp_in")(h), approximate=True)
    return x_BxLxD + gpt.dense(self.cfg, x_BxLxD.shape[-1], name="mlp_out")(h)


class HeadLoss(nn.Module):
  """ln_final, the head and model_lib.make_loss_fn's mean cross-entropy."""
  cfg: Any

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    x_BxLxD = gpt.layer_norm(self.cfg, "ln_final")(x_BxLxD)
    logits = layers.head(self.cfg, None, x_BxLxD, use_bias=self.cfg.head_bias)  # untied
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1).mean()


def jax_components(cfg, params, opt, batch_BxL1: np.ndarray, reps: int, options) -> dict:
  """Each component's forward + backward (the update: its step) alone, median seconds."""
  b, l = batch_BxL1.shape[0], batch_BxL1.shape[1] - 1
  tokens, targets = jnp.asarray(batch_BxL1[:, :-1]), jnp.asarray(batch_BxL1[:, 1:])
  x, ct = jax.random.normal(jax.random.key(2), (2, b, l, cfg.d_model), jnp.float32)
  block = params["block_0"]

  def jit(f):  # with the step's XLA options
    return jax.jit(f, compiler_options=options)

  def pullback(module):  # (params, x, ct) -> the params' and x's gradients
    def run(p, x, ct):
      return jax.vjp(lambda p, x: module.apply({"params": p}, x), p, x)[1](ct)
    return jit(run)

  embed = jit(lambda p, tokens, ct: jax.vjp(
      lambda p: Embeddings(cfg).apply({"params": p}, tokens), p)[1](ct))
  head = jit(jax.grad(lambda p, x, t: HeadLoss(cfg).apply({"params": p}, x, t), (0, 1)))

  def update(params, opt_state, grads):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  grads = jax.tree.unflatten(tree, [1e-3 * jax.random.normal(k, p.shape, p.dtype)
                                    for k, p in zip(keys, leaves)])
  calls = {
      "embeddings": (embed, ({"embed": params["embed"], "pos_embed": params["pos_embed"]},
                             tokens, ct)),
      "attention": (pullback(AttentionHalf(cfg)),
                    ({k: block[k] for k in ("ln_attn", "qkv", "attn_out")}, x, ct)),
      "mlp": (pullback(MlpHalf(cfg)), ({k: block[k] for k in ("ln_mlp", "mlp_in", "mlp_out")},
                                       x, ct)),
      "head_loss": (head, ({"ln_final": params["ln_final"], "head": params["head"]}, x,
                           targets)),
      "update": (jit(update), (params, opt.init(params), grads))}
  return {name: statistics.median(timed(lambda f=f, a=a: f(*a), reps, warmup=1))
          for name, (f, a) in calls.items()}


# The HLO text's lines: a computation's header starts at the margin and ends with "{"; its
# instructions are indented, "%name = type opcode(operands), ..., metadata={op_name=...}".
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, int | None]]:
  """{HLO instruction: (the op_name it is attributed to, its output's last dimension)}.
  The op_name is its own metadata's, or for an instruction that calls a computation
  holding a matmul (a fusion of a dot and its neighbours), the first matmul's (the
  fusion's own is its root's: often an elementwise consumer's, e.g. the softmax after the
  head). The dimension is None for a tuple or a scalar."""
  own, last_dim, calls, matmul_of = {}, {}, {}, {}
  computation = None
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      header = _HEADER.match(line)
      computation = header.group(1) if header else computation
      continue
    name, rest = m.groups()
    op_name = re.search(r'op_name="([^"]*)"', rest)
    own[name] = op_name.group(1) if op_name else ""
    dims = re.match(r"[a-z]\w*\[([\d,]+)\]", rest)  # an array's type, e.g. f32[8,128,256]
    last_dim[name] = int(dims.group(1).split(",")[-1]) if dims else None
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    if called:
      calls[name] = called.group(1)
    if re.search(r"\s(?:dot|convolution)\(", rest) and computation not in matmul_of:
      matmul_of[computation] = own[name]
  return {name: (matmul_of.get(calls.get(name)) or op, last_dim[name])
          for name, op in own.items()}


def component(op_name: str, last_dim: int | None, mlp_dim: int) -> str:
  """The component of an HLO op from its op_name (the flax module path under jvp(GPT) in
  the forward pass, transpose(jvp(GPT)) in the backward one; the loss is outside GPT; the
  optimizer outside the jvp) and, for a block's ops outside its submodules, the last
  dimension of its output: GELU's have the MLP's width; the softmax's, the heads' and both
  residual adds' have not, and are put under attention."""
  block = re.search(r"/block_\d+/(.*)$", op_name)
  if block:
    if re.match(r"(?:ln_mlp|mlp_in|mlp_out)/", block.group(1)):
      return "mlp"
    if re.match(r"(?:ln_attn|qkv|attn_out)/", block.group(1)):
      return "attention"
    return "mlp" if last_dim == mlp_dim else "attention"
  if re.search(r"/(?:ln_final|head)/|log_softmax|take_along_axis|jvp\(\)", op_name):
    return "head_loss"
  if re.search(r"/embed/|jvp\(GPT\)\)?/[^/]+$", op_name):  # the lookup and + positions
    return "embeddings"
  if op_name.startswith("jit(") and "jvp(" not in op_name:
    return "update"
  return "other"


def jax_profile(compiled, args: tuple, steps: int, top: int, mlp_dim: int) -> dict:
  """jax.profiler's trace of `steps` calls of `compiled`: milliseconds per step in each
  HLO op (outermost events only, so nothing is counted twice), by component and the
  `top` longest."""
  names = hlo_ops(compiled.as_text())
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # XLA's ops only: no Python function events
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory(prefix="bench_inner_step_trace_") as trace_dir:
    with jax.profiler.trace(trace_dir, profiler_options=options):
      for _ in range(steps):
        jax.block_until_ready(compiled(*args))
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    ns = collections.Counter()
    for plane in data.planes:
      for line in plane.lines:
        end = -1
        for e in sorted(line.events, key=lambda e: e.start_ns):
          if e.name in names and e.start_ns >= end:
            ns[e.name] += e.duration_ns
            end = e.end_ns
  if not ns:
    raise RuntimeError("jax.profiler recorded no HLO op of the step: this jaxlib's XLA:CPU "
                       "does not trace its thunks")
  ms = {name: t / 1e6 / steps for name, t in ns.items()}
  total = sum(ms.values())
  of = {name: component(*names[name], mlp_dim) for name in ms}
  by_component = collections.Counter()
  for name, t in ms.items():
    by_component[of[name]] += t
  ranked = sorted(ms.items(), key=lambda kv: -kv[1])
  return {"ops_ms_per_step": total, "ops": len(ms), "by_component": dict(by_component),
          "top": [{"op": name, "op_name": names[name][0], "component": of[name], "ms": t,
                   "share": t / total} for name, t in ranked[:top]]}


def torch_python(args) -> str | None:
  """The venv's python for the torch side, or None: --skip_torch, or --smoke where the venv
  has no torch (--smoke never creates it)."""
  if args.skip_torch:
    return None
  if not args.smoke:
    return peer.ensure_venv(args.venv)
  python = os.path.join(args.venv, "bin", "python")
  if os.path.exists(python) and subprocess.run([python, "-c", "import torch"],
                                               capture_output=True, check=False).returncode == 0:
    return python
  print(f"--smoke: no torch in {args.venv}: diloco_jax only", flush=True)
  return None


def run_torch(python: str, spec: dict, params, batches: np.ndarray) -> dict:
  """bench/_inner_torch.py on this process's core, given diloco_jax's params."""
  arrays = {".".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  with tempfile.TemporaryDirectory(prefix="bench_inner_step_torch_") as tmp:
    paths = {name: os.path.join(tmp, name) for name in ("spec.json", "arrays.npz", "out.json")}
    with open(paths["spec.json"], "w") as f:
      json.dump(spec, f)
    np.savez(paths["arrays.npz"], batches=batches, **arrays)
    proc = subprocess.run([python, os.path.join(REPO, "bench", "_inner_torch.py"),
                           f"--spec={paths['spec.json']}", f"--arrays={paths['arrays.npz']}",
                           f"--out={paths['out.json']}"], env=peer.torch_env(),
                          capture_output=True, text=True, timeout=TORCH_TIMEOUT_S, check=False)
    if proc.returncode:
      raise RuntimeError(f"bench/_inner_torch.py failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    with open(paths["out.json"]) as f:
      return json.load(f)


def summarize_peak(rows: list[dict]) -> dict:
  best = max(rows, key=lambda r: r["best_flops_per_sec"])
  return {"sizes": rows, "flops_per_sec": best["best_flops_per_sec"], "n": best["n"]}


def table(result: dict) -> str:
  """The markdown tables printed at the end."""
  sides = ["diloco_jax"] + ([] if result["torch_skipped"] else ["torch"])
  peak, step, flops = result["peak"], result["step"], result["flops"]
  dash = "–"

  def cell(value, fmt: str) -> str:
    return dash if value is None else fmt.format(value)

  torch_rows = {r["n"]: r for r in peak["torch"]["sizes"]} if peak.get("torch") else {}
  out = ["float32 matmul on one core, GFLOP/s (best of each size's products):", "",
         "| n | diloco_jax (XLA:CPU) | torch |", "|---|---|---|"]
  for r in peak["diloco_jax"]["sizes"]:
    t = torch_rows.get(r["n"])
    out.append(f"| {r['n']} | {r['best_flops_per_sec'] / 1e9:.1f} | "
               f"{cell(t and t['best_flops_per_sec'] / 1e9, '{:.1f}')} |")
  out += ["", (f"peak: {peak['flops_per_sec'] / 1e9:.1f} GFLOP/s ({peak['system']}, "
               f"n = {peak['n']})"), "",
          (f"FLOPs per step: analytic {flops['analytic'] / 1e9:.3f} G, XLA's cost_analysis "
           f"{flops['xla_cost_analysis'] / 1e9:.3f} G (x{flops['xla_over_analytic']:.3f})"), "",
          "| one inner step | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]
  rows = [("time, median (ms)", "median_s", 1e3, "{:.1f}"),
          ("GFLOP/s (analytic FLOPs)", "flops_per_sec", 1e-9, "{:.2f}"),
          ("share of the core's matmul peak", "share_of_peak", 100, "{:.1f}%"),
          ("share of its own system's matmul peak", "share_of_own_peak", 100, "{:.1f}%")]
  for label, key, scale, fmt in rows:
    out.append(f"| {label} | " + " | ".join(fmt.format(step[s][key] * scale) for s in sides)
               + " |")
  out.append(f"| the one-replica jit of the same program (ms) | "
             f"{1e3 * step['diloco_jax']['plain_median_s']:.1f} |"
             + f" {dash} |" * (len(sides) - 1))

  prof = result["profile"]["diloco_jax"]
  out += ["", (f"where the step's time goes (ms per step; components timed alone, x"
               f"{result['config']['num_layers']} for the blocks' halves; jax's in-step "
               f"column from jax.profiler):"), "",
          "| component | diloco_jax | torch | jax / torch | diloco_jax in the step |",
          "|---|---|---|---|---|"]
  for row in result["components"]:
    out.append(f"| {row['label']} | {row['jax_ms']:.2f} | {cell(row['torch_ms'], '{:.2f}')} | "
               f"{cell(row['ratio'], '{:.2f}')} | {row['jax_in_step_ms']:.2f} |")
  total = result["components_total"]
  out.append(f"| sum of the components | {total['jax_ms']:.2f} | "
             f"{cell(total['torch_ms'], '{:.2f}')} | {cell(total['ratio'], '{:.2f}')} | "
             f"{prof['ops_ms_per_step'] - prof['by_component'].get('other', 0):.2f} |")
  out.append(f"| ops of no component | | | | {prof['by_component'].get('other', 0):.2f} |")
  out.append(f"| outside every HLO op (XLA's runtime) | | | | {prof['outside_ms']:.2f} |")
  whole = {s: 1e3 * step[s]["median_s"] for s in sides}
  ratio = whole["diloco_jax"] / whole["torch"] if "torch" in whole else None
  out.append(f"| the whole step | {whole['diloco_jax']:.2f} | "
             f"{cell(whole.get('torch'), '{:.2f}')} | {cell(ratio, '{:.2f}')} | "
             f"{1e3 * step['diloco_jax']['plain_median_s']:.2f} |")

  out += ["", (f"diloco_jax: the {len(prof['top'])} longest HLO ops of the step (of "
               f"{prof['ops']}), jax.profiler:"), "",
          "| HLO op | op_name | component | ms | share |",
          "|---|---|---|---|---|"]
  for r in prof["top"]:
    op_name = r["op_name"].removeprefix("jit(train_step)/")
    op_name = op_name if len(op_name) <= 70 else op_name[:67] + "..."
    out.append(f"| {r['op']} | {op_name} | {r['component']} | {r['ms']:.2f} | "
               f"{100 * r['share']:.1f}% |")
  if "torch" in sides:
    tprof = result["profile"]["torch"]
    out += ["", (f"torch: the {len(tprof['top'])} ops of most self CPU time (of "
                 f"{tprof['ops']}; {tprof['self_ms_per_step']:.1f} ms per step under the "
                 f"profiler), torch.profiler:"),
            "", "| op | self ms | calls | share |", "|---|---|---|---|"]
    for r in tprof["top"]:
      out.append(f"| {r['op']} | {r['self_ms']:.2f} | {r['calls']:g} | "
                 f"{100 * r['share']:.1f}% |")
  return "\n".join(out)


def main(argv=None):
  config = peer_config.get_config()
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=50, help="timed steps, after --warmup")
  parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiling)")
  parser.add_argument("--profile_steps", type=int, default=10, help="steps each profile reads")
  parser.add_argument("--component_reps", type=int, default=30,
                      help="timed runs of each component alone")
  parser.add_argument("--sizes", default="256,512,1024,2048", help="matmul sizes n, for the peak")
  parser.add_argument("--matmul_reps", type=int, default=10, help="products per size")
  parser.add_argument("--top", type=int, default=12, help="ops listed per profile")
  parser.add_argument("--batch_size", type=int, default=config.batch_size)
  for key in peer.SHAPE:
    parser.add_argument(f"--{key}", type=int, default=config.model[key])
  parser.add_argument("--venv", default=peer.DEFAULT_VENV,
                      help="the virtualenv torch runs in (bench/peer.py's: created if missing, "
                           "but not by --smoke, which then skips torch)")
  parser.add_argument("--skip_torch", action="store_true", help="diloco_jax only")
  args = harness.parse_args(parser, "inner_step", SMOKE, argv)
  python = torch_python(args)
  for key in peer.SHAPE:
    config.model[key] = getattr(args, key)
  config.batch_size = args.batch_size
  sizes = [int(n) for n in args.sizes.split(",")]
  b, l = args.batch_size, args.seq_len
  cfg = family.ModelConfig.from_config(config.model, config.data.vocab_size)
  print(f"on core {CPU}: jax {jax.__version__}, {jax.devices()[0]}", flush=True)

  peak_jax = summarize_peak(matmul_peak(sizes, args.matmul_reps))
  print(f"diloco_jax: matmul peak {peak_jax['flops_per_sec'] / 1e9:.1f} GFLOP/s "
        f"(n = {peak_jax['n']})", flush=True)

  params = model_lib.init_params(cfg, jax.random.key(config.seed))
  num_params = model_lib.count_params(params)
  loss_fn = model_lib.make_loss_fn(cfg)
  opt = optim.inner_optimizer(config.inner, config.num_rounds * config.inner_steps)
  mesh = inner.local_mesh()
  options = inner.compiler_options(mesh)
  batches = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCHES, b, l + 1),
                                              dtype=np.int32)
  first_loss = float(jax.jit(loss_fn)(params, batches[0]))

  # The trainer's step, and taking turns with it the one-replica program it maps.
  trainer_step = inner.ReplicaStep(loss_fn, opt, mesh=mesh)
  plain = jax.jit(step_lib.make_train_step(loss_fn, opt), compiler_options=options)
  compiled = plain.lower(params, opt.init(params), batches[0]).compile()
  flops = {"analytic": analytic_flops(b, l, cfg.d_model, cfg.mlp_dim, cfg.vocab_size,
                                      cfg.num_layers),
           "xla_cost_analysis": xla_flops(compiled),
           "formula": "3 * 2*B*L * (layers * (4*D^2 + 2*D*F + 2*L*D) + D*V)"}
  flops["xla_over_analytic"] = flops["xla_cost_analysis"] / flops["analytic"]
  print(f"FLOPs per step: analytic {flops['analytic']:,}, XLA's cost_analysis "
        f"{flops['xla_cost_analysis']:,.0f} (x{flops['xla_over_analytic']:.3f})", flush=True)
  state = {"trainer": trainer_step.place(state_lib.init_replica_state(opt, params, 1)),
           "plain": (params, opt.init(params)), "calls": 0}

  def trainer():
    batch_RxBxL1 = batches[state["calls"] % BATCHES][None]
    state["trainer"], loss = trainer_step(state["trainer"], batch_RxBxL1)
    return loss

  def plain_step():
    batch = batches[state["calls"] % BATCHES]
    state["calls"] += 1  # after the trainer's step: both take the same batches
    new_params, opt_state, loss = compiled(*state["plain"], batch)
    state["plain"] = (new_params, opt_state)
    return loss

  for _ in range(args.warmup):
    jax.block_until_ready((trainer(), plain_step()))
  times = {"trainer": [], "plain": []}
  for _ in range(args.steps):
    for name, fn in (("trainer", trainer), ("plain", plain_step)):
      times[name] += timed(fn, 1, 0)
  step_s = statistics.median(times["trainer"])
  print(f"diloco_jax: step {1e3 * step_s:.1f} ms (median of {args.steps}), the one-replica "
        f"jit {1e3 * statistics.median(times['plain']):.1f} ms", flush=True)

  profile = {"diloco_jax": jax_profile(compiled, (params, opt.init(params), batches[0]),
                                       args.profile_steps, args.top, cfg.mlp_dim)}
  profile["diloco_jax"]["outside_ms"] = max(
      0.0, 1e3 * statistics.median(times["plain"]) - profile["diloco_jax"]["ops_ms_per_step"])
  jax_parts = jax_components(cfg, params, opt, batches[0], args.component_reps, options)
  print("diloco_jax components (ms): " + ", ".join(f"{k} {1e3 * v:.2f}"
                                                   for k, v in jax_parts.items()), flush=True)

  torch_result = None
  if python:
    c = config.inner
    spec = {"cpu": CPU, "sizes": sizes, "matmul_reps": args.matmul_reps, "steps": args.steps,
            "warmup": args.warmup, "profile_steps": args.profile_steps, "top": args.top,
            "component_reps": args.component_reps, "batch_size": b,
            "vocab_size": cfg.vocab_size, "norm_eps": cfg.norm_eps,
            **{k: getattr(args, k) for k in peer.SHAPE}, "lr": c.lr, "b1": c.b1, "b2": c.b2,
            "eps": c.eps, "weight_decay": c.weight_decay, "clip_norm": c.clip_norm}
    print(f"torch: {python}, on core {CPU}", flush=True)
    torch_result = run_torch(python, spec, params, batches)
    diff = abs(torch_result["first_loss"] - first_loss)
    if diff > 1e-4 or torch_result["params"] != num_params:
      raise RuntimeError(f"the two models differ: with diloco_jax's params, loss "
                         f"{torch_result['first_loss']} against {first_loss}, params "
                         f"{torch_result['params']:,} against {num_params:,}")

  peaks = {"diloco_jax": peak_jax}
  if torch_result:
    peaks["torch"] = summarize_peak(torch_result["matmul"])
  system = max(peaks, key=lambda s: peaks[s]["flops_per_sec"])
  peak = {**peaks, "flops_per_sec": peaks[system]["flops_per_sec"], "n": peaks[system]["n"],
          "system": system}

  def figures(median_s: float, own_peak: float, samples: list[float]) -> dict:
    per_sec = flops["analytic"] / median_s
    return {"median_s": median_s, "times": samples, "flops_per_sec": per_sec,
            "share_of_peak": per_sec / peak["flops_per_sec"],
            "share_of_own_peak": per_sec / own_peak}

  step = {"diloco_jax": {**figures(step_s, peak_jax["flops_per_sec"], times["trainer"]),
                         "plain_median_s": statistics.median(times["plain"]),
                         "plain_times": times["plain"]}}
  if torch_result:
    step["torch"] = figures(statistics.median(torch_result["step_times"]),
                            peaks["torch"]["flops_per_sec"], torch_result["step_times"])
    profile["torch"] = torch_result["profile"]
  components = []
  for key, label, per_block in COMPONENTS:
    count = cfg.num_layers if per_block else 1
    jax_ms = 1e3 * count * jax_parts[key]
    torch_ms = torch_result and 1e3 * count * torch_result["components"][key]
    components.append({
        "component": key, "label": f"{label} (x{count})" if per_block else label,
        "count": count, "jax_ms": jax_ms, "torch_ms": torch_ms,
        "ratio": torch_ms and jax_ms / torch_ms,
        "jax_in_step_ms": profile["diloco_jax"]["by_component"].get(key, 0.0)})
  jax_total = sum(r["jax_ms"] for r in components)
  torch_total = torch_result and sum(r["torch_ms"] for r in components)
  result = {
      "config": {"batch_size": b, **{k: getattr(args, k) for k in peer.SHAPE},
                 "vocab_size": cfg.vocab_size, "steps": args.steps, "warmup": args.warmup,
                 "profile_steps": args.profile_steps, "component_reps": args.component_reps,
                 "sizes": sizes, "matmul_reps": args.matmul_reps, "cpu": CPU,
                 "xla_flags": os.environ["XLA_FLAGS"]},
      "params": num_params, "flops": flops, "peak": peak, "step": step,
      "components": components,
      "components_total": {"jax_ms": jax_total, "torch_ms": torch_total,
                           "ratio": torch_total and jax_total / torch_total},
      "profile": profile, "torch_skipped": torch_result is None,
      "same_model": torch_result and {"jax_first_loss": first_loss,
                                      "torch_first_loss": torch_result["first_loss"],
                                      "abs_diff": abs(torch_result["first_loss"] - first_loss)},
      "torch": torch_result and {k: torch_result[k] for k in ("torch", "threads", "affinity")},
      "jax": jax.__version__, "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
      "python": sys.version.split()[0], "smoke": args.smoke,
      **harness.provenance("inner_step", argv)}
  harness.write(args.out, result, indent=1)
  print(f"\nparams {num_params:,}; on core {CPU}, one thread each\n")
  print(table(result))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
