"""A profile of a few rounds: `config.profile.start_round` and `num_rounds`.

Each host writes a `jax.profiler` trace of those rounds into workdir/profile/host<i>/:
an XPlane (`plugins/profile/<time>/*.xplane.pb`, for TensorBoard's profile plugin or
XProf) and a Perfetto trace (`perfetto_trace.json.gz`, for ui.perfetto.dev). The trainer
names what it does with annotations, so the trace shows, besides XLA's own ops, each
`round r`, its `inner_step`s, the `outer_step`, and on the dispatch thread each job by
name and round (`cross-host sum of pseudo-gradients (round r)`, ...).
"""

from __future__ import annotations

import glob
import os

import jax

# The annotations in a trace: `annotate(...)` outside a trace costs a few microseconds.
annotate = jax.profiler.TraceAnnotation
step_annotation = jax.profiler.StepTraceAnnotation


def trace_dir(workdir: str, host: int) -> str:
  return os.path.join(workdir, "profile", f"host{host}")


def xplane_files(workdir: str, host: int = 0) -> list[str]:
  """The XPlane files of host `host`'s traces in `workdir`, oldest first."""
  return sorted(glob.glob(os.path.join(trace_dir(workdir, host), "plugins", "profile", "*",
                                       "*.xplane.pb")))


class ProfileWindow:
  """Starts a trace before round `start` and stops it after round `start + rounds - 1`
  (or the last round), once the devices have finished that work. A run resumed inside
  the window traces from its first round; one resumed after it traces nothing."""

  def __init__(self, workdir: str, host: int, *, start: int, rounds: int, last_round: int,
               announce: bool):
    self.directory = trace_dir(workdir, host)
    self.start, self.stop = start, min(start + rounds - 1, last_round)
    self.announce = announce
    self.tracing = False

  def covers(self, r: int) -> bool:
    return bool(self.start) and self.start <= r <= self.stop

  def before_round(self, r: int) -> None:
    if self.covers(r) and not self.tracing:
      os.makedirs(self.directory, exist_ok=True)
      options = jax.profiler.ProfileOptions()
      options.python_tracer_level = 0  # every Python call: slows a round 10x, bloats the file
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True,
                               profiler_options=options)
      self.tracing = True

  def after_round(self, r: int, work) -> None:
    """After round r was dispatched; `work`: arrays its last computations write."""
    if self.tracing and r >= self.stop:
      jax.block_until_ready(work)  # the devices' part of the window, not just its dispatch
      self.close()
      if self.announce:
        print(f"profile of rounds {self.start}-{self.stop} written to {self.directory} "
              f"(docs/monitoring.md)", flush=True)

  def close(self) -> None:
    if self.tracing:
      self.tracing = False
      jax.profiler.stop_trace()
