"""GPU readiness: one command that runs diloco_jax's parts on this machine's accelerator.

  pip install -e '.[cuda12,check]'           # the GPU install; `check` adds pytest (part a)
  python bench/gpu_check.py [--parts=abdec]  # over 8 minutes on one H200 (docs/devices.md)
  python bench/gpu_check.py --smoke          # every part on CPU, tiny shapes (the suite;
                                             # part a one test, part d sync alone)

One line per part and one JSON (bench/results/gpu_check.json), written again after every
part, so that a check cut short keeps the parts it ran. Parts run in the order given; by
default c, the slowest (a 30-block model compiling), runs last.
  a  the backend and its devices; the backend-agnostic core tests (`pytest -m device`:
     trainer = simulate, resume bit-identity, the float64 numpy references) with float32
     matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest: no TF32), at the
     tests' own tolerances. Without pytest it ends at once with the command that adds it.
     Tests that fail are named, and on a GPU run again with XLA's deterministic ops
     (--xla_gpu_deterministic_ops=true): the line says whether they pass then.
  b  configs/tiny.py to the end: the final eval loss beside the CPU's (README.md's).
  c  configs/llama_150m.py's model (bf16) for a few rounds on synthetic data: tokens/s,
     MFU, the device's peak memory (the allocator's) beside XLA's plan and the trainer's
     estimate, the outer step's d2h, mean and h2d times.
  d  2 host processes sharing the device (a memory fraction each), their sums on the CPU
     over gloo, sync and eager: the losses beside 1 host x 2 replicas, the anchors equal
     on both hosts every round, the share of eager's sum hidden behind the next phase.
  e  attention at L = 1024 and 2048 on llama_150m's shapes (2 blocks): today's 'xla'
     formulation and cuDNN's fused kernel, step time (forward and backward), XLA's plan
     for temporaries, and the largest difference of the logits.
A part that fails is recorded with its error and the others still run; the exit code is
then 1. Where the backend has no cuDNN (CPU), part e times 'xla' alone.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

if __package__:  # python -m bench.gpu_check, or imported (tests/test_docs.py)
  from bench import harness
else:  # python bench/gpu_check.py: this file's folder is on the path, maybe not the root
  import harness  # (an install of the package alone: docs/devices.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What part a needs beyond `pip install -e .`: pytest (the `check` extra). The command that
# adds it, run in the repository (docs/devices.md gives it with the install).
CHECK_INSTALL = "pip install -e '.[check]'"
SMOKE_MODEL = ["--config.model.num_layers=1", "--config.model.d_model=32",
               "--config.model.num_heads=2", "--config.model.mlp_dim=64",
               "--config.inner.warmup_steps=1"]
FINAL = re.compile(r"final eval loss ([0-9.]+)")


class NotInstalled(Exception):
  """A part cannot run: a package it needs is missing (the message says how to add it)."""


class PartFailed(Exception):
  """A part ran and found something wrong: `record` is what it measured, its line included."""

  def __init__(self, record: dict):
    super().__init__(record["line"])
    self.record = record


DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
FAILED_TEST = re.compile(r"^FAILED (\S+)", re.M)  # pytest's short summary (-ra)


def tiny_cpu_final_eval() -> float:
  """configs/tiny.py's final eval loss on a CPU: the figure README.md's quickstart shows,
  the one place it is written. tests/test_docs.py runs that job on a CPU in full and
  fails when its final eval loss is not the README's, so a CPU run keeps it true."""
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    return float(FINAL.search(f.read()).group(1))


def device_test_files() -> list[str]:
  """The test modules that mark tests `device`. pytest is given these alone, so that it
  imports no module that needs the `test` extra's other packages (jinja2, torch)."""
  found = []
  for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
    with open(path, encoding="utf-8") as f:
      if "pytest.mark.device" in f.read():
        found.append(os.path.relpath(path, REPO))
  return found


def run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> str:
  """A command's output; a CalledProcessError-like RuntimeError with its tail on failure."""
  code, out = completed(cmd, env, timeout)
  if code:
    raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {code}: {last_line(out)}\n"
                       f"{out[-3000:]}")
  return out


def completed(cmd: list[str], env: dict | None = None,
              timeout: float = 600) -> tuple[int, str]:
  """A command's exit code and output (stdout and stderr together), run in the repository."""
  proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  return proc.returncode, proc.stdout


def last_line(text: str) -> str:
  """The last line of a command's output that is not empty: a failure's one-line reason
  (pytest's summary, a Python error), for the part's line."""
  return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def records(workdir: str) -> list[dict]:
  with open(os.path.join(harness.host_dir(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train(workdir: str, flags: list[str], env: dict | None = None) -> tuple[str, list[dict]]:
  out = run([sys.executable, "-m", "diloco_jax.train", f"--workdir={workdir}", *flags], env)
  return out, records(workdir)


def part_a(args, tmp: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("pytest") is None:
    raise NotInstalled(f"not run: pytest is missing; add it with `{CHECK_INSTALL}` in {REPO}, "
                       "then run this again")
  devices = jax.devices()
  selection = [*device_test_files(), "-m", "device",
               *(["-k", "test_sync_matches_numpy_float64"] if args.smoke else [])]
  env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "JAX_PLATFORMS": ""}
  t = time.perf_counter()
  code, out = pytest(selection, env)
  summary = last_line(out)
  result = {"backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
            "tests": summary, "test_seconds": time.perf_counter() - t,
            "matmul_precision": "highest",
            "line": f"{jax.default_backend()}, {len(devices)} x {devices[0].device_kind}; "
                    f"pytest -m device: {summary}"}
  if code == 0:
    return result
  # Which tests failed, by name, and whether XLA's nondeterministic GPU kernels (scatter-add
  # with atomics, autotuned choices) are why: the bit-identity tests need equal bits.
  failed = FAILED_TEST.findall(out)
  result.update(failed=failed, output_tail=out[-6000:])
  result["line"] += "; failed: " + ", ".join(name.split("::")[-1] for name in failed)
  if failed and jax.default_backend() == "gpu":
    flags = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC}".strip()
    _, again = pytest(failed, {**env, "XLA_FLAGS": flags})
    result["deterministic_rerun"] = last_line(again)
    result["line"] += f"; again with {DETERMINISTIC}: {result['deterministic_rerun']}"
  raise PartFailed(result)


def pytest(selection: list[str], env: dict) -> tuple[int, str]:
  """pytest's exit code and output for `selection`, run in the repository."""
  return completed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    *selection], env, timeout=900)


def part_b(args, tmp: str) -> dict:
  flags = ["--config=configs/tiny.py", *(SMOKE_MODEL + ["--config.num_rounds=2"]
                                         if args.smoke else [])]
  out, recs = train(os.path.join(tmp, "tiny"), flags, {"JAX_PLATFORMS": ""})
  final, cpu = float(FINAL.search(out).group(1)), tiny_cpu_final_eval()
  return {"final_eval_loss": final, "cpu_final_eval_loss": cpu,
          "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in recs[1:] or recs),
          "line": f"configs/tiny.py: final eval loss {final:.4f} (CPU {cpu}, README.md)"}


def part_c(args, tmp: str) -> dict:
  workdir = os.path.join(tmp, "llama")
  flags = ["--config=configs/llama_150m.py", "--config.data.source=synthetic",
           "--config.data.vocab_size=1024", "--config.data.num_sequences=2048",
           "--config.data.num_eval_sequences=64", "--config.num_rounds=3",
           "--config.inner_steps=10", "--config.batch_size=16", "--config.grad_accum_steps=1",
           "--config.eval_batches=2",
           "--config.eval_every=3", "--config.checkpoint.every=0",
           "--config.inner.warmup_steps=5"]
  if args.smoke:
    flags += [*SMOKE_MODEL, "--config.model.num_kv_heads=1", "--config.model.seq_len=32",
              "--config.data.vocab_size=64", "--config.batch_size=4",
              "--config.inner_steps=2", "--config.data.num_sequences=64"]
  _, recs = train(workdir, flags, {"JAX_PLATFORMS": ""})
  with open(os.path.join(harness.host_dir(workdir), "run.json")) as f:
    run_json = json.load(f)
  steady = recs[1:] or recs
  median = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
  peak = max((r.get("device_peak_bytes") or 0 for r in recs), default=0) or None
  result = {"tokens_per_sec": median("tokens_per_sec"),
            "mfu": median("mfu") if "mfu" in steady[-1] else None,
            "device_peak_bytes": peak, "xla_plan_bytes": run_json["memory_per_device_bytes"],
            "estimate_bytes": estimate(run_json["config"]),
            "outer_d2h_s": median("outer_d2h"), "outer_mean_s": median("outer_mean"),
            "outer_h2d_s": median("outer_h2d"), "attention": run_json.get("attention")}
  gib = lambda b: f"{b / 2 ** 30:.2f} GiB" if b else "n/a"  # noqa: E731
  mfu = "n/a" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
  result["line"] = (f"llama_150m bf16 ({result['attention']} attention): "
                    f"{result['tokens_per_sec']:,.0f} tok/s, MFU {mfu}, peak {gib(peak)} vs "
                    f"XLA's plan {gib(result['xla_plan_bytes'])} vs estimate "
                    f"{gib(result['estimate_bytes'])}, outer d2h/mean/h2d "
                    f"{1e3 * result['outer_d2h_s']:.0f}/{1e3 * result['outer_mean_s']:.0f}/"
                    f"{1e3 * result['outer_h2d_s']:.0f} ms")
  return result


def estimate(saved_config: dict) -> int:
  """The trainer's memory estimate per device (`mesh.memory_needs`, what `check_memory`
  judges) for a run's config as run.json holds it, on this host's devices."""
  import jax  # pylint: disable=import-outside-toplevel

  from diloco_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from diloco_jax.device import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from diloco_jax.modes import registry  # pylint: disable=import-outside-toplevel
  config = config_lib.from_saved(saved_config)
  device, _ = mesh_lib.memory_needs(config, config.data.vocab_size, jax.local_device_count(),
                                    registry.driver(config.mode).memory_profile(config))
  return sum(device.values())


def part_d(args, tmp: str) -> dict:
  rounds = 2 if args.smoke else 4
  base = ["--config=configs/tiny.py", f"--config.num_rounds={rounds}",
          f"--config.eval_every={rounds}", "--config.debug_checks=True",
          "--config.checkpoint.every=0",
          *(SMOKE_MODEL + ["--config.inner_steps=2"] if args.smoke else [])]
  env = {"JAX_PLATFORMS": "", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
  result = {}
  for mode in ("sync",) if args.smoke else ("sync", "eager"):
    two_dir, one_dir = os.path.join(tmp, f"two_{mode}"), os.path.join(tmp, f"one_{mode}")
    run([sys.executable, "launch/local.py", "--hosts=2", "--", f"--workdir={two_dir}",
         *base, f"--config.mode={mode}", "--config.replicas_per_host=1"], env)
    _, one = train(one_dir, [*base, f"--config.mode={mode}", "--config.replicas_per_host=2"],
                   env)
    two = records(two_dir)
    diff = max(abs(a["train_loss"] - b["train_loss"]) / abs(b["train_loss"])
               for a, b in zip(two, one))
    result[mode] = {"max_rel_loss_diff": diff, "anchor_checked_rounds": sum(
        "anchor_hash" in r for r in two), "rounds": len(two),
        "overlap": statistics.median(r.get("overlap", 0.0) for r in two[1:] or two)}
  result["line"] = ("2 processes on one device: " + "; ".join(
      f"{m} loss within {r['max_rel_loss_diff']:.1e} of 1 host x 2, anchors equal in "
      f"{r['anchor_checked_rounds']}/{r['rounds']} rounds, {100 * r['overlap']:.0f}% of the "
      f"sum hidden" for m, r in result.items()))
  return result


def part_e(args, tmp: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from diloco_jax.models import layers  # pylint: disable=import-outside-toplevel
  from diloco_jax.models import family as family_lib  # pylint: disable=import-outside-toplevel
  from diloco_jax.models import model as model_lib  # pylint: disable=import-outside-toplevel
  shapes = dict(num_layers=2, d_model=576, num_heads=9, num_kv_heads=3, mlp_dim=1536,
                vocab_size=1024, family="llama", tie_embeddings=True, dtype=jnp.bfloat16)
  lengths, batch, repeats = (1024, 2048), 8, 10
  if args.smoke:
    shapes.update(d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64, vocab_size=64)
    lengths, batch, repeats = (64,), 2, 2
  platform = jax.default_backend()
  result = {"platform": platform, "rows": []}
  for length in lengths:
    tokens = jax.random.randint(jax.random.key(0), (batch, length + 1), 0,
                                shapes["vocab_size"])
    logits = {}
    for kernel in ("xla", "cudnn"):
      cfg = family_lib.ModelConfig(seq_len=length, attention=kernel, **shapes)
      try:
        model_lib.attention_kernel(cfg, platform)
      except layers.AttentionError as e:
        result["rows"].append({"length": length, "attention": kernel, "skipped": str(e)})
        continue
      params = model_lib.init_params(cfg, jax.random.key(1))
      step = jax.jit(jax.value_and_grad(model_lib.make_loss_fn(cfg)))
      compiled = step.lower(params, tokens).compile()
      jax.block_until_ready(compiled(params, tokens))
      times = []
      for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t)
      stats = compiled.memory_analysis()
      logits[kernel] = np.asarray(jax.jit(family_lib.build(cfg).apply)(
          {"params": params}, tokens[:, :-1]), np.float32)
      result["rows"].append({"length": length, "attention": kernel,
                             "step_s": statistics.median(times),
                             "temp_bytes": stats.temp_size_in_bytes if stats else None})
    if len(logits) == 2:
      result["rows"][-1]["max_logit_diff_vs_xla"] = float(
          np.max(np.abs(logits["cudnn"] - logits["xla"])))
  timed = [r for r in result["rows"] if "step_s" in r]
  result["line"] = "attention: " + "; ".join(
      f"L={r['length']} {r['attention']} {1e3 * r['step_s']:.1f} ms"
      + (f" (logits within {r['max_logit_diff_vs_xla']:.2e})"
         if "max_logit_diff_vs_xla" in r else "") for r in timed) + (
      "; cudnn skipped: " + platform if any("skipped" in r for r in result["rows"]) else "")
  return result


def write(path: str, result: dict) -> None:
  """The results so far, replaced whole (a check cut short keeps the parts it ran)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=2, default=str)
  os.replace(path + ".tmp", path)


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--parts", default="abdec",
                      help="which parts to run (letters a-e), in this order")
  args = harness.parse_args(parser, "gpu_check", {}, argv)
  if set(args.parts) - set(PARTS):
    parser.error(f"--parts={args.parts}: letters from {''.join(PARTS)}")
  import jax  # pylint: disable=import-outside-toplevel
  device = str(jax.devices()[0].device_kind)
  result = {"smoke": args.smoke, "device": device, "jax": jax.__version__,
            **harness.provenance("gpu_check", argv, accelerator=device), "parts": {}}
  tmp = tempfile.mkdtemp(prefix="gpu_check_")
  failed = []
  try:
    for name in args.parts:
      t = time.perf_counter()
      try:
        part = PARTS[name](args, tmp)
      except NotInstalled as e:
        part = {"error": str(e), "line": str(e)}
        failed.append(name)
      except PartFailed as e:
        part = {**e.record, "error": e.record["line"]}
        failed.append(name)
      except Exception as e:  # noqa: BLE001 -- recorded; the other parts still run
        part = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                "line": f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        failed.append(name)
      part["seconds"] = time.perf_counter() - t
      result["parts"][name] = part
      print(f"{name}. {part['line']} ({part['seconds']:.0f} s)", flush=True)
      write(args.out, result)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  write(args.out, result)
  print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
