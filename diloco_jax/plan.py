"""python -m diloco_jax.plan --config=configs/X.py --hosts=16 --bandwidth_mbit=1000: a run's
round time, waiting, compute utilization and bytes per host, predicted before renting the
machines.

The run's mode, H, compression, fragments, balance, replicas and rounds are the config's
(override them as for training: --config.mode=eager --config.inner_steps=100); the model
size is the config's, or --params. The hosts' step time is given (--step_time, seconds per
inner step of a host's replicas, one value or one per host), derived from FLOPs
(--device_tflops with --devices_per_host and --mfu), or measured here by a short run of the
config (--measure). --sweep tries H, formats, modes (and each --hosts value) and
recommends, per fleet size, the setting closest to plain DiLoCo that reaches --target
utilization. The model and its calibration: docs/plan.md (diloco_jax/planning/model.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from diloco_jax.cli import command_line
from diloco_jax.cli import exits

# A PlanError, a ConfigError, a bad flag: each message names what is wrong, printed alone.
PLAN = exits.Command(prefix="")


def define_flags() -> None:
  """The command's flags, defined when it runs as a command (not on import: `train` also
  defines --config, and a process may import both); `Options` reads them."""
  config_flags.DEFINE_config_file("config", None, "The run's config file.")
  flags.DEFINE_string("hosts", "2", "Hosts; with --sweep, a comma list (8,16,64).")
  flags.DEFINE_float("params", None, "The model's params (1e9), instead of the config's "
                     "model.")
  flags.DEFINE_string("step_time", None, "Seconds per inner step of a host's replicas: one "
                      "value, or one per host (unequal speeds).")
  flags.DEFINE_bool("measure", False, "Measure the step time with a short run of the config "
                    "on this machine (one host).")
  flags.DEFINE_float("device_tflops", None, "Step time from FLOPs: each device's peak "
                     "TFLOP/s (H100 bf16 dense: 989).")
  flags.DEFINE_integer("devices_per_host", 8, "With --device_tflops.")
  flags.DEFINE_float("mfu", 0.4, "With --device_tflops: the share of peak reached.")
  flags.DEFINE_float("tokens_per_step", None, "With --device_tflops: tokens per inner step "
                     "of a host (default: the config's replicas x batch x seq_len).")
  flags.DEFINE_float("bandwidth_mbit", None, "Each host's link, both ways, Mbit/s.")
  flags.DEFINE_float("up_mbit", None, "Upload, Mbit/s (default: --bandwidth_mbit).")
  flags.DEFINE_float("down_mbit", None, "Download, Mbit/s (default: --bandwidth_mbit).")
  flags.DEFINE_float("rtt_ms", 0.0, "Round-trip time between hosts, ms.")
  flags.DEFINE_bool("sweep", False, "Try H, formats, modes and --hosts values.")
  flags.DEFINE_string("sweep_inner_steps", "25,50,100,250,500", "H values to try.")
  flags.DEFINE_string("sweep_formats", "none,bf16,int8,4bit,2bit,chunk_topk",
                      "Compression formats to try.")
  flags.DEFINE_string("sweep_modes", "sync,streaming,eager", "Modes to try.")
  flags.DEFINE_float("target", 0.9, "--sweep: the compute utilization to reach.")
  flags.DEFINE_string("json", None, "Also write the rows as JSON here.")
  flags.DEFINE_string("png", None, "Also plot utilization here (--sweep: against H).")
  flags.DEFINE_float(
      "round_overhead_s", None, "Seconds per round besides the steps and the sync "
      "(evaluation, checkpoints); default: the calibration's, measured on a tiny model.")
  flags.DEFINE_float(
      "outer_s_per_param", None, "The outer step's host time per param (copies and update); "
      "default: the calibration's, measured on a 2-core CPU host (a GPU host: about 5e-10).")
  flags.DEFINE_bool("smoke", False, "A quick sweep of configs/tiny.py into a temporary "
                    "directory (for the test suite).")


@dataclasses.dataclass(frozen=True)
class Options:
  """The command's flags but --config, parsed (each field is the flag of its name)."""
  hosts: str
  params: float | None
  step_time: str | None
  measure: bool
  device_tflops: float | None
  devices_per_host: int
  mfu: float
  tokens_per_step: float | None
  bandwidth_mbit: float | None
  up_mbit: float | None
  down_mbit: float | None
  rtt_ms: float
  sweep: bool
  sweep_inner_steps: str
  sweep_formats: str
  sweep_modes: str
  target: float
  json: str | None
  png: str | None
  round_overhead_s: float | None
  outer_s_per_param: float | None


def _floats(text: str, name: str) -> tuple[float, ...]:
  try:
    return tuple(float(v) for v in text.split(","))
  except ValueError:
    raise command_line.FlagError(f"--{name}={text}: comma-separated numbers") from None


def _ints(text: str, name: str) -> tuple[int, ...]:
  values = _floats(text, name)
  if any(v != int(v) for v in values):
    raise command_line.FlagError(f"--{name}={text}: whole numbers")
  return tuple(int(v) for v in values)


def num_params(config) -> int:
  # pylint: disable=import-outside-toplevel
  from diloco_jax.models import family
  from diloco_jax.models import model as model_lib
  from diloco_jax.data import resolve
  config = resolve.resolved(config)
  return model_lib.num_params_of(family.ModelConfig.from_config(config.model,
                                                                  config.data.vocab_size))


def measure_step_time(config_path: str, overrides: list[str]) -> float:
  """Seconds per inner step of one host's replicas: a 4-round run of the config here
  without evaluations or checkpoints, its rounds 2 and 3 (round 1 compiles; the last
  evaluates the final model)."""
  with tempfile.TemporaryDirectory() as workdir:
    result = subprocess.run(
        [sys.executable, "-m", "diloco_jax.train", f"--config={config_path}", *overrides,
         "--config.num_rounds=4", "--config.inner.warmup_steps=0",
         "--config.eval_every=1000", "--config.checkpoint.every=0", f"--workdir={workdir}"],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
      raise command_line.FlagError(f"--measure: the run failed: {result.stderr.strip()[-300:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f][1:3]
  h = records[1]["inner_step"] - records[0]["inner_step"]  # a round's steps
  return sum(r["round_time"] for r in records) / (2 * h)


def step_time(config, n: int, opts: Options) -> tuple[float, ...]:
  if opts.step_time:
    return _floats(opts.step_time, "step_time")
  tokens = (opts.tokens_per_step
            or config.replicas_per_host * config.batch_size * config.model.seq_len)
  if opts.device_tflops:
    if not (opts.device_tflops > 0 and opts.devices_per_host >= 1 and 0 < opts.mfu <= 1):
      raise command_line.FlagError("--device_tflops > 0, --devices_per_host >= 1, 0 < --mfu <= 1")
    return (6 * n * tokens / (opts.devices_per_host * opts.device_tflops * 1e12 * opts.mfu),)
  raise command_line.FlagError("the step time: give --step_time, --device_tflops or --measure")


def _syncs_fragments(mode: str) -> bool:
  """Whether `mode`'s driver syncs fragments (streaming; an unknown mode: no, and the
  planner names the modes)."""
  from diloco_jax.modes import registry  # pylint: disable=import-outside-toplevel
  driver = registry.DRIVERS.get(mode)
  return bool(driver and driver.fragments)


def setting_of(config, n: int, hosts: int, times: tuple[float, ...], opts: Options):
  from diloco_jax.planning import model as plan_model  # pylint: disable=import-outside-toplevel
  up = opts.up_mbit or opts.bandwidth_mbit
  down = opts.down_mbit or opts.bandwidth_mbit
  if up is None or down is None:
    raise command_line.FlagError("the link: give --bandwidth_mbit (or --up_mbit and "
                                 "--down_mbit)")
  o = config.outer
  return plan_model.Setting(
      num_params=n, hosts=hosts, step_time=times, up_mbit=up, down_mbit=down,
      rtt_ms=opts.rtt_ms, mode=config.mode, inner_steps=config.inner_steps,
      compression=o.compression, fragments=o.fragments if _syncs_fragments(config.mode) else 1,
      overlap_steps=o.get("overlap_steps", 0), replicas_per_host=config.replicas_per_host,
      balance=config.balance, balance_tolerance=config.balance_tolerance,
      balance_max_factor=config.balance_max_factor,
      num_rounds=config.num_rounds, topk_fraction=o.topk_fraction, topk_chunk=o.topk_chunk,
      topk_value_bits=o.topk_value_bits)


def sweep(base, constants, opts: Options) -> list[tuple]:
  """(setting, prediction) for every valid combination of the sweep flags."""
  # pylint: disable=import-outside-toplevel
  from diloco_jax.modes import registry
  from diloco_jax.planning import model as plan_model
  # pylint: enable=import-outside-toplevel
  rows = []
  hs = sorted(set(_ints(opts.sweep_inner_steps, "sweep_inner_steps")) | {base.inner_steps})
  for name, values, known in (("sweep_modes", opts.sweep_modes, registry.names()),
                              ("sweep_formats", opts.sweep_formats, plan_model.FORMAT_RANK)):
    unknown = [v for v in values.split(",") if v not in known]
    if unknown:
      raise command_line.FlagError(f"--{name}: unknown {unknown}; one of {', '.join(known)}")
  for hosts in _ints(opts.hosts, "hosts"):
    for mode in opts.sweep_modes.split(","):
      for fmt in opts.sweep_formats.split(","):
        for h in hs:
          s = dataclasses.replace(base, hosts=hosts, mode=mode, compression=fmt,
                                  inner_steps=h, fragments=2 if _syncs_fragments(mode) else 1,
                                  overlap_steps=0, step_time=base.step_time[:1]
                                  if len(base.step_time) != hosts else base.step_time)
          try:
            rows.append((s, plan_model.predict(s, constants)))
          except plan_model.PlanError:  # a combination the trainer refuses too: left out
            continue
  return rows


def recommend(rows: list[tuple], target: float) -> dict[int, tuple]:
  """Per fleet size, planning.model.recommend's choice: (setting, prediction, reaches)."""
  from diloco_jax.planning import model as plan_model  # pylint: disable=import-outside-toplevel
  hosts = sorted({s.hosts for s, _ in rows})
  return {n: plan_model.recommend([r for r in rows if r[0].hosts == n], target) for n in hosts}


def describe(s) -> str:
  fragments = f", P={s.fragments}" if _syncs_fragments(s.mode) else ""
  return f"{s.hosts} hosts, {s.mode}{fragments}, H={s.inner_steps}, {s.compression}"


def table(rows: list[tuple]) -> str:
  lines = ["| setting | round | waiting | compute util. | MB/host/round | run |",
           "|---|---|---|---|---|---|"]
  for s, p in rows:
    lines.append(f"| {describe(s)} | {p.round_s:.3g} s | {100 * p.wait_share:.0f}% | "
                 f"{100 * p.utilization:.1f}% | {p.bytes_per_host / 1e6:,.4g} | "
                 f"{p.wall_s / 3600:.3g} h |")
  return "\n".join(lines)


def row_json(s, p) -> dict:
  return {"setting": dataclasses.asdict(s), "prediction": dataclasses.asdict(p)}


def plot(rows: list[tuple], path: str, title: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  from diloco_jax.reporting import plots  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  hosts = rows[0][0].hosts
  lines: dict[tuple, list] = {}
  for s, p in rows:
    if s.hosts == hosts:
      lines.setdefault((s.mode, s.compression), []).append((s.inner_steps, p.utilization))
  for (mode, fmt), points in lines.items():
    xs, ys = zip(*sorted(points))
    ax.plot(xs, [100 * y for y in ys], "o-", markersize=3, label=f"{mode}, {fmt}")
  ax.set_xscale("log")
  plots.save_figure(fig, ax, path, xlabel="H (inner steps per round)",
                      ylabel="compute utilization (%)", title=title)


def main(argv: list[str]) -> None:
  command_line.no_arguments(argv)
  if not flags.FLAGS["verbosity"].present:  # jax's backend search logs at INFO
    logging.set_verbosity(logging.ERROR)
  config = command_line.loaded_config(
      "Missing --config: the run's config file, e.g. --config=configs/tiny.py")
  opts = command_line.read(Options)
  n, times, base, constants, rows = exits.run(lambda: _predict(config, opts), PLAN)
  link = f"{base.up_mbit:g}/{base.down_mbit:g} Mbit/s up/down, rtt {base.rtt_ms:g} ms"
  print(f"{n / 1e6:,.2f}M params; step {', '.join(f'{t:.4g}' for t in times)} s; {link}; "
        f"{base.num_rounds} rounds")
  print(table(rows))
  result = {"params": n, "link": link, "constants": dataclasses.asdict(constants),
            "rows": [row_json(s, p) for s, p in rows]}
  if opts.sweep:
    result["recommendation"] = {}
    for hosts, (s, p, reaches) in recommend(rows, opts.target).items():
      text = (f"{describe(s)}: {100 * p.utilization:.1f}% utilization, "
              f"{p.bytes_per_host / 1e6:,.4g} MB/host/round")
      print(f"recommended for {hosts} hosts at {100 * opts.target:g}% utilization: {text}"
            + ("" if reaches else " (no setting tried reaches it: the closest)"))
      result["recommendation"][hosts] = {**row_json(s, p), "reaches": reaches}
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(result, f, indent=2)
  if opts.png:
    plot(rows, opts.png, f"{n / 1e6:,.1f}M params, {link}")


def _predict(config, opts: Options) -> tuple:
  """(params, step times, the base setting, the constants, the rows of (setting,
  prediction)) of the flags; a FlagError, PlanError or ConfigError names what is wrong."""
  # pylint: disable=import-outside-toplevel
  from diloco_jax.planning import calibration
  from diloco_jax.planning import model as plan_model
  # pylint: enable=import-outside-toplevel
  n = int(opts.params) if opts.params else num_params(config)
  if opts.measure:
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    times = (measure_step_time(path, overrides),)
    print(f"measured: {times[0]:.4g} s per inner step of {config.replicas_per_host} "
          f"replica(s) on this machine")
  else:
    times = step_time(config, n, opts)
  hosts = _ints(opts.hosts, "hosts")
  base = setting_of(config, n, hosts[0], times, opts)
  constants = dataclasses.replace(calibration.CONSTANTS, **{
      name: getattr(opts, name) for name in ("round_overhead_s", "outer_s_per_param")
      if getattr(opts, name) is not None})
  if constants.round_overhead_s < 0 or constants.outer_s_per_param < 0:
    raise command_line.FlagError("--round_overhead_s and --outer_s_per_param: must be >= 0")
  if opts.sweep:
    rows = sweep(base, constants, opts)
  else:
    if len(hosts) > 1:
      raise command_line.FlagError(f"--hosts={opts.hosts}: one number (a list needs --sweep)")
    rows = [(base, plan_model.predict(base, constants))]
  if not 0 < opts.target <= 1:
    raise command_line.FlagError(f"--target={opts.target:g}: a utilization in (0, 1]")
  return n, times, base, constants, rows


def _parse(argv: list[str]) -> list[str]:
  """command_line.parse, with --smoke's defaults in place of --smoke."""
  if "--smoke" in argv[1:]:
    out = tempfile.mkdtemp(prefix="plan_smoke_")
    argv = [argv[0], "--config=configs/tiny.py", "--step_time=0.02", "--bandwidth_mbit=8",
            "--hosts=2,4", "--sweep", "--sweep_inner_steps=25,100",
            "--sweep_formats=none,4bit", f"--json={out}/plan.json", f"--png={out}/plan.png",
            *[a for a in argv[1:] if a != "--smoke"]]
  return command_line.parse(argv)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=_parse)
