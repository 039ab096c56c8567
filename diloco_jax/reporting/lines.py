"""The lines a run prints outside its rounds: the start-up lines, the compiled inner step's
memory, a resume, and the final report (with the loss plot: `plots.py`)."""

from __future__ import annotations

import os
from typing import Any
from typing import Mapping

from diloco_jax.reporting.plots import plot_losses
from diloco_jax.units import format_bytes
from diloco_jax.units import format_duration


def print_memory(memory: Mapping[str, int] | None, mesh) -> None:
  """The compiled inner step's memory on one device, as XLA planned it."""
  if memory is None:
    return
  print(f"inner step: {format_bytes(memory['total'])} per device (XLA's plan: arguments "
        f"{format_bytes(memory['arguments'])}, temporaries {format_bytes(memory['temporaries'])}"
        f", outputs {format_bytes(memory['outputs'])} of which {format_bytes(memory['aliased'])}"
        f" in donated buffers) on {mesh.devices.size} local device(s), mesh "
        + " x ".join(f"{n} {axis}" for axis, n in mesh.shape.items()), flush=True)


def print_startup(*, host: int, num_hosts: int, devices: list[str], replicas_per_host: int,
                  mode: str, model: str, num_params: int, flops_per_token: float,
                  num_rounds: int, inner_steps: int, tokens: int, floor: float | None,
                  unigram: float, storage: str | None = None, attention: str = "xla") -> None:
  print(f"host {host}/{num_hosts}: {len(devices)} local device(s) {devices}, "
        f"{replicas_per_host} replica(s), mode {mode}"
        + (f", checkpoints in {storage}" if storage and host == 0 else ""), flush=True)
  if host == 0:
    floor_text = f"{floor:.4f}" if floor is not None else "unknown (not synthetic)"
    print(f"model {model} ({attention} attention): {num_params / 1e6:.2f}M params, "
          f"{flops_per_token / 1e6:,.1f} "
          f"MFLOPs per token; {num_hosts * replicas_per_host} replicas "
          f"({num_hosts} host(s) x {replicas_per_host}); {num_rounds} rounds x "
          f"{inner_steps} inner steps; {tokens:,} tokens; loss floor {floor_text}, best "
          f"unigram loss {unigram:.4f}", flush=True)


def print_resumed(r: int, directory: str, *, replicas: int, inflight: bool, finished: bool,
                  num_rounds: int) -> None:
  print(f"resumed from checkpoint {r} ({directory}/{r}): outer state, {replicas} replicas' "
        f"inner state and data iterators"
        + (", the pseudo-gradients in flight" if inflight else "")
        + ("; the run had finished" if finished
           else f"; continuing at round {r + 1} of {num_rounds}"), flush=True)


def report(records: list[Mapping[str, Any]], workdir: str, *, final_eval: float,
           floor: float | None, unigram: float, elapsed: float, num_rounds: int,
           title: str) -> None:
  """The final line (eval loss beside the floor and the unigram loss) and loss.png."""
  floor_text = f"{floor:.4f}" if floor is not None else "unknown"
  bpb = next((f" ({r['eval_bpb']:.4f} bits/byte)" for r in reversed(records)
              if "eval_bpb" in r), "")
  print(f"final eval loss {final_eval:.4f}{bpb} | loss floor {floor_text} | best unigram loss "
        f"{unigram:.4f} | {num_rounds} rounds in {format_duration(elapsed)}", flush=True)
  plot_losses(records, os.path.join(workdir, "loss.png"), floor=floor, unigram=unigram,
              title=title)
