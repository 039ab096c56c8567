"""A job of hosts with a workdir each, and the events bench/chaos.py and bench/churn.py put
it through (not a bench).

The job is `launch/local.py --workdir_per_host` training configs/tiny.py (`flags`: one
replica per host, the outer state compared across hosts every round). `Output` keeps the
lines of every launch of it, each with its arrival time; `strike` delivers an event to a
host or to the whole job; `restart` waits for a job that an event stopped and starts the
next launch. The two benches differ in what they draw and what they measure: chaos.py, a
job restarted through host-count changes, with its heals; churn.py, the same events on a
live job and on one that restarts, for goodput.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from bench import harness

ROUND = re.compile(r"^\[host (\d+)\] round +(\d+)/")  # printed by the lowest live host
FINAL = re.compile(r"final eval loss ([0-9.]+)")
SMOKE_FLAGS = ["--config.model.num_layers=1", "--config.model.d_model=32",
               "--config.model.mlp_dim=64", "--config.model.num_heads=2"]
KILLS = ("kill", "kill_wipe", "kill_writer")  # a host SIGKILLed: its job cannot exit 0


def flags(args, *extra: str) -> list[str]:
  """The trainer's flags: configs/tiny.py, one replica per host, `args.rounds` rounds of
  `args.inner_steps` steps, the anchors compared every round; a tiny model with --smoke."""
  return ["--config=configs/tiny.py", "--config.replicas_per_host=1",
          f"--config.num_rounds={args.rounds}", f"--config.inner_steps={args.inner_steps}",
          "--config.inner.warmup_steps=2", "--config.debug_checks=True", *extra,
          "--heartbeat_timeout=20", *(SMOKE_FLAGS if args.smoke else [])]


def draw(kinds: tuple[str, ...], count: int, rng, once: tuple[str, ...] = ()) -> list[str]:
  """`count` events: every kind once in random order (as many as `count` allows), then
  random kinds but those of `once`."""
  again = [k for k in kinds if k not in once]
  return (rng.sample(kinds, min(count, len(kinds)))
          + [rng.choice(again) for _ in range(count - len(kinds))])


def log_path(args, name: str) -> str:
  """Where the hosts' output goes (long: XLA's and gloo's lines too): beside a smoke run's
  JSON, else in a temporary directory, since bench/results/ holds figures only."""
  folder = (os.path.dirname(args.out) if args.smoke
            else tempfile.mkdtemp(prefix=f"bench_{name}_log_"))
  return os.path.join(folder, f"{name}.log")


def launch(workdir: str, hosts: int, flags: list[str], extra: list[str],
           repo: str = harness.REPO, env: dict | None = None) -> subprocess.Popen:
  """`launch/local.py --workdir_per_host` of checkout `repo` with launcher flags `extra`."""
  cmd = [sys.executable, os.path.join(repo, "launch", "local.py"), f"--hosts={hosts}",
         "--workdir_per_host", *extra, "--", f"--workdir={workdir}", *flags]
  return subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


class Output:
  """Lines of several processes, each with its arrival time, into one list and the log."""

  def __init__(self, log):
    self.lines: list[tuple[float, str]] = []
    self._log, self._lock = log, threading.Lock()
    self._readers: dict[int, threading.Thread] = {}

  def follow(self, proc: subprocess.Popen, prefix: str = "") -> None:
    def read():
      for line in proc.stdout:
        with self._lock:
          self.lines.append((time.monotonic(), prefix + line))
          self._log.write(prefix + line)
    self._readers[proc.pid] = threading.Thread(target=read, daemon=True)
    self._readers[proc.pid].start()

  def finish(self, proc: subprocess.Popen, timeout: float | None = None) -> int:
    """`proc`'s exit code, once it has exited and its last lines are in."""
    code = proc.wait()
    self._readers[proc.pid].join(timeout)
    return code

  def since(self, t: float) -> list[tuple[float, str]]:
    with self._lock:
      return [(when, line) for when, line in self.lines if when >= t]

  def rounds(self) -> list[tuple[float, int]]:
    """(arrival time, round) of every round line."""
    return [(when, int(m.group(2))) for when, line in self.since(0.0)
            if (m := ROUND.match(line))]

  def last_round(self) -> tuple[int, int]:
    """(round, printing host) of the newest round line; (0, 0) before the first."""
    with self._lock:
      for _, line in reversed(self.lines):
        if m := ROUND.match(line):
          return int(m.group(2)), int(m.group(1))
    return 0, 0

  def text(self) -> str:
    with self._lock:
      return "".join(line for _, line in self.lines)

  def final_eval_loss(self) -> float | None:
    """The last launch's final eval loss, if it printed one."""
    final = FINAL.findall(self.text())
    return float(final[-1]) if final else None


def wait_round(out: Output, job: subprocess.Popen, target: int) -> bool:
  """Until a round line of `target` or later (True) or the job's exit (False)."""
  while out.last_round()[0] < target:
    if job.poll() is not None:
      return False
    time.sleep(0.05)
  return True


def next_round(out: Output, job: subprocess.Popen, since: float,
               timeout: float = 300) -> tuple[float, int] | None:
  """(time, round) of the first round line after `since`; None if the job ends first."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for when, line in out.since(since):
      if m := ROUND.match(line):
        return when, int(m.group(2))
    if job.poll() is not None:
      time.sleep(0.5)  # its last lines
      return next(((when, int(m.group(2))) for when, line in out.since(since)
                   if (m := ROUND.match(line))), None)
    time.sleep(0.05)
  return None


def strike(kind: str, job: subprocess.Popen, pid: int | None, workdir: str, host: int,
           live: bool, freeze_s: float = 0.0) -> None:
  """Event `kind` on host `host` (process `pid`) of `job`, a launcher. A killed host is
  gone on return (kill_wipe: its workdir too). On a live job a leave is a SIGTERM to the
  host and a join_new a SIGUSR1 to the launcher, which starts its spare id; on a job that
  restarts, those and every kind that stops the job (chaos.py's sigterm, fewer, more) are
  a SIGTERM to the launcher: every host checkpoints and exits."""
  if kind in KILLS:
    os.kill(pid, signal.SIGKILL)
    harness.wait_dead(pid)
    if kind == "kill_wipe":
      shutil.rmtree(os.path.join(workdir, f"host{host}"), ignore_errors=True)
  elif kind == "freeze":
    os.kill(pid, signal.SIGSTOP)
    time.sleep(freeze_s)
    os.kill(pid, signal.SIGCONT)
  elif kind == "leave" and live:
    os.kill(pid, signal.SIGTERM)
  elif kind == "join_new" and live:
    job.send_signal(signal.SIGUSR1)
  else:
    job.send_signal(signal.SIGTERM)


def restart(out: Output, job: subprocess.Popen, kind: str,
            start: Callable[[], subprocess.Popen]
            ) -> tuple[subprocess.Popen, tuple[float, int] | None, int]:
  """After event `kind` stopped every host of `job`: waits for its exit (an error after a
  kill, 0 after a preemption), then starts the next launch with `start`. Returns that job,
  its first round line's (time, round) or None if it ended first, and the round the
  stopped job reached (a preemption stops some rounds after the notice)."""
  code = out.finish(job, timeout=30)  # (a host that outlived its launcher holds the pipe)
  reached = out.last_round()[0]
  if kind != "freeze" and (kind in KILLS) == (code == 0):
    raise RuntimeError(f"{kind}: the launcher exited {code}:\n{out.text()[-3000:]}")
  since = time.monotonic()
  job = start()
  out.follow(job)
  return job, next_round(out, job, since), reached
