"""Starts N trainer hosts on this machine, one CPU device each, and watches them.

  python launch/local.py --hosts=4 -- --config=configs/tiny.py --workdir=/tmp/run

Everything after `--` goes to `python -m diloco_jax.train` on every host, followed by
--membership (a membership coordinator this launcher starts beside the hosts, on a free
port of 127.0.0.1), --coordinator_address (another free port: ddp's jax.distributed),
--num_hosts and --host_id. Each output line is prefixed with its host id, or with
[coordinator].

The hosts have live membership: a host that dies (host 0 included) is dropped and the
others train on. The launcher waits for every host, reports each one that died, and exits
0 when every host that was not killed finished; it stops the coordinator at the end, and
starts it again on its port if it dies before (the hosts wait for it and go on). Each
host keeps its checkpoints and records: with a shared --workdir, in WORKDIR/host<i>/ (as
--workdir_per_host gives each its own directory, as hosts on machines with disks of their
own would have; a host whose directory was wiped heals from the others). What to do when a
host dies:
- nothing (the default): the others go on without it;
- --rejoin_after=S: it is started again S seconds later (up to --max_restarts times in all)
  and joins the running job;
- --shared_fate (or --max_restarts=N alone): the hosts share fate, as a job on one
  scheduler does: the others are killed at once, and every host is started again (up to
  --max_restarts times; 0: the launcher exits with the failed host's code); they resume
  from their newest checkpoints, bit for bit as if never stopped.
A ddp job's hosts (on jax.distributed: none registers with the coordinator) share fate
whatever the flags: when one dies the others are killed at once.
With --max_hosts=M, host ids --hosts .. M-1 start --join_later seconds after the others (or
one by one, each on a SIGUSR1 to the launcher) and join the running job. SIGTERM (or a
first Ctrl-C) to the launcher goes to the coordinator, which stops the whole job: every host
after the same round, with a checkpoint, so that the same command resumes them together (a
ddp job's hosts, which do not register, get the SIGTERM themselves); a second Ctrl-C kills
them. Hosts die with the launcher even if it is SIGKILLed. --live, live membership before
it was the only kind, is accepted and changes nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from diloco_jax.runtime import hostmem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEASE_S = 5.0  # a host silent this long is dropped (--lease_s)
STRAGGLER_S = 10.0  # a stopped job's hosts still running this long after it: SIGTERM
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the child, before exec: SIGKILL when the launcher dies (Linux), so no orphans."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass


class Hosts:
  """The running host processes and the threads copying their output."""

  def __init__(self, num_hosts: int, train_args: list[str], port: int,
               workdir_per_host: bool = False, lease_s: float = LEASE_S,
               max_hosts: int | None = None, join_later: float = 0.0):
    # Huge pages asked for here: each host would otherwise start itself again for them.
    self._env = hostmem.with_huge_pages(
        {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
         "PYTHONUNBUFFERED": "1"})
    self._env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, self._env.get("PYTHONPATH")) if p)
    self.num_hosts, self.train_args, self.port = num_hosts, train_args, port
    self.jax_port = free_port()  # ddp: jax.distributed's coordination service
    self.workdir_per_host = workdir_per_host
    # The job's host ids go up to max_hosts - 1; those from num_hosts on start
    # `join_later` seconds after the others and join the running job.
    self.max_hosts = max_hosts or num_hosts
    self.registered = False  # a host registered with the coordinator (else: ddp's hosts)
    self.lease_s = lease_s
    self._ended = False  # the launcher ended the coordinator (else its loss is restarted)
    self.coordinator = self._start_coordinator()
    self.procs: list[subprocess.Popen] = []
    self.exited_at: dict[int, float] = {}  # pid -> when it exited (monotonic)
    self._lock = threading.Lock()
    self._threads = []
    for host in range(num_hosts):
      self.procs.append(self._start(host))
    # when hosts num_hosts.. start (join_later < 0: only one by one, each on a SIGUSR1)
    self.later_at = time.monotonic() + join_later if join_later >= 0 else float("inf")
    self.start_next = 0  # hosts to start now, ahead of `later_at` (SIGUSR1s)
    self._told = False  # the hosts got the launcher's SIGTERM
    self._ended_at = 0.0  # when the coordinator of a job asked to stop was seen ended

  def _start_coordinator(self) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={self.port}",
         f"--max_hosts={self.max_hosts}", f"--lease_s={self.lease_s}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env,
        start_new_session=True, preexec_fn=_die_with_parent)
    threading.Thread(target=self._copy, args=("coordinator", proc), daemon=True).start()
    return proc

  def keep_coordinator(self, stopping=lambda: False) -> None:
    """A coordinator that died under a running job (a crash, a SIGKILL) is started again on
    its port: the hosts keep their state, wait for it and register again. One that exited
    0 ended as asked (the job stopped, or every host left) and is not."""
    code = self.coordinator.poll()
    if (code in (None, 0) or self._ended or stopping() or not self.registered
        or not any(p.poll() is None for p in self.procs)):
      return
    print(f"[launcher] the coordinator {_reason(code)}; starting it again on port "
          f"{self.port}: the hosts wait for it and register again", flush=True)
    self.coordinator = self._start_coordinator()

  def _start(self, host: int) -> subprocess.Popen:
    args = self.train_args
    if self.workdir_per_host:
      args = [f"{a}/host{host}" if a.startswith("--workdir=") else a for a in args]
    more = ([f"--min_hosts={self.num_hosts}"] if self.max_hosts > self.num_hosts else [])
    cmd = [sys.executable, "-m", "diloco_jax.train", *args,
           f"--membership=127.0.0.1:{self.port}",
           f"--coordinator_address=127.0.0.1:{self.jax_port}",
           f"--num_hosts={self.max_hosts}", *more, f"--host_id={host}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=self._env, start_new_session=True,
                            preexec_fn=_die_with_parent)
    t = threading.Thread(target=self._copy, args=(host, proc), daemon=True)
    t.start()
    self._threads.append(t)
    threading.Thread(target=self._note_exit, args=(proc,), daemon=True).start()
    return proc

  def _note_exit(self, proc: subprocess.Popen) -> None:
    """When a host dies, the others usually fail a moment later (their collectives or
    heartbeats break): the time of each exit tells which one failed first."""
    proc.wait()
    self.exited_at.setdefault(proc.pid, time.monotonic())

  def _copy(self, host: int | str, proc: subprocess.Popen) -> None:
    name = host if isinstance(host, str) else f"host {host}"
    for line in iter(proc.stdout.readline, b""):
      text = line.decode(errors="replace")
      if host == "coordinator" and re.search(r": epoch \d+: hosts \d", text):
        self.registered = True  # the hosts have live membership (not ddp's jax.distributed)
      with self._lock:
        sys.stdout.write(f"[{name}] {text}")
        sys.stdout.flush()

  def signal_all(self, sig: int) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)  # the host and anything it started
        except ProcessLookupError:
          pass

  def stop_job(self) -> None:
    """Asks the coordinator to stop the job (every host after the same round, with a
    checkpoint; hosts not yet admitted exit 0); it ends once they have left. A SIGTERM
    to each host instead would make each leave alone, at rounds of its own."""
    if self.coordinator.poll() is None:
      self.coordinator.send_signal(signal.SIGTERM)

  def _tell_stragglers(self, stopping) -> bool:
    """The job was asked to stop and its coordinator ended once its hosts had left: the
    hosts still running get a SIGTERM (a host still starting, to join, would find no
    coordinator; a ddp job's hosts never registered). Nothing of theirs is lost. Hosts that
    registered get STRAGGLER_S first: one that has left ends a moment after, and a SIGTERM
    in its exit would kill it."""
    if not stopping() or self.coordinator.poll() is None or self._told:
      return False
    now = time.monotonic()
    self._ended_at = self._ended_at or now
    if self.registered and now - self._ended_at < STRAGGLER_S:
      return False
    self._told = True
    self.signal_all(signal.SIGTERM)
    return True

  def stop_coordinator(self) -> None:
    self._ended = True
    if self.coordinator.poll() is None:
      self.coordinator.terminate()
      try:
        self.coordinator.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.coordinator.kill()

  def wait_live(self, rejoin_after: float | None = None, max_restarts: int = 0,
                stopping=lambda: False) -> int:
    """Every host runs to its own end. 0 when every host exited 0 or was
    killed by a signal (the others trained on without it) and at least one finished; else
    the code of the first host that failed, once all have ended. `rejoin_after`: a host
    that dies while another still runs, or leaves it (SIGTERM to it alone: it exits 0 with
    the run unfinished), is started again this many seconds later (up to `max_restarts`
    starts in all), and joins the running job; not once `stopping()` (the job is asked to
    stop)."""
    reported: set[int] = set()
    restarts, due = 0, {}  # host -> when it starts again
    while True:
      self.keep_coordinator(stopping)
      if self._tell_stragglers(stopping):
        due.clear()
      if len(self.procs) < self.max_hosts and (self.start_next or
                                               time.monotonic() >= self.later_at):
        until = (self.max_hosts if time.monotonic() >= self.later_at
                 else min(self.max_hosts, len(self.procs) + self.start_next))
        for host in range(len(self.procs), until):
          print(f"[launcher] starting host {host}: it joins the running job", flush=True)
          self.procs.append(self._start(host))
        self.start_next = 0
      codes = [p.poll() for p in self.procs]
      for host, code in enumerate(codes):
        left = code == 0 and not stopping() and self._left_unfinished(host)
        if code not in (None, 0) and not self.registered:
          # No host registered: a ddp job, on jax.distributed, whose hosts share fate
          print(f"[launcher] host {host} {_reason(code)}; the job runs on jax.distributed "
                "(ddp): stopping the other hosts", flush=True)
          self.kill_all()
          self.stop_coordinator()
          self._drain()
          return code if code > 0 else 128 - code
        if (code not in (None, 0) or left) and host not in reported:
          reported.add(host)
          again = (rejoin_after is not None and restarts < max_restarts
                   and any(c is None for c in codes) and not stopping())
          what = "left the job (its checkpoint saved)" if left else _reason(code)
          print(f"[launcher] host {host} {what}; the other hosts go on"
                + (f"; it starts again in {rejoin_after:g} s and joins them" if again else ""),
                flush=True)
          if again:
            restarts += 1
            due[host] = time.monotonic() + rejoin_after
      for host, when in list(due.items()):
        if time.monotonic() >= when:
          del due[host]
          if any(p.poll() is None for p in self.procs):
            print(f"[launcher] starting host {host} again (restart {restarts}/"
                  f"{max_restarts}): it joins the running job", flush=True)
            self.procs[host] = self._start(host)
            reported.discard(host)
            codes[host] = None
      if all(c is not None for c in codes) and not due:
        self.stop_coordinator()
        self._drain()
        failed = sorted(((h, c) for h, c in enumerate(codes) if c is not None and c > 0),
                        key=lambda hc: self.exited_at.get(self.procs[hc[0]].pid, 0.0))
        if failed:
          return failed[0][1]
        return 0 if 0 in codes else 1
      time.sleep(0.1)

  def _left_unfinished(self, host: int) -> bool:
    """Whether `host`'s newest checkpoint is not its run's finished one (it left on a
    SIGTERM of its own); False where the workdir cannot tell."""
    workdir = next((a.split("=", 1)[1] for a in self.train_args if a.startswith("--workdir=")),
                   None)
    if workdir is None:
      return False
    directory = os.path.join(workdir, f"host{host}", "checkpoints")
    try:
      newest = max(int(n) for n in os.listdir(directory) if n.isdigit())
      with open(os.path.join(directory, str(newest), "meta.json")) as f:
        return not json.load(f)["finished"]
    except (OSError, ValueError, KeyError):
      return False

  def kill_all(self) -> None:
    self.signal_all(signal.SIGKILL)
    for proc in self.procs:
      proc.wait()
    for proc in self.procs:  # Leftovers of a host's process group (e.g. data workers).
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass

  def wait(self, stopping=lambda: False) -> int:
    """The hosts share fate (--max_restarts alone): 0 when every host exits 0; else the
    code of the host that failed first (by exit time), the rest killed."""
    while True:
      self.keep_coordinator(stopping)
      self._tell_stragglers(stopping)
      codes = [p.poll() for p in self.procs]
      now = time.monotonic()
      failed = sorted(((h, c) for h, c in enumerate(codes) if c not in (None, 0)),
                      key=lambda hc: self.exited_at.get(self.procs[hc[0]].pid, now))
      if failed:
        host, code = failed[0]
        print(f"[launcher] host {host} {_reason(code)}; stopping the other hosts", flush=True)
        self.kill_all()
        self.stop_coordinator()
        self._drain()
        return code if code > 0 else 128 - code
      if all(c == 0 for c in codes):
        self.stop_coordinator()
        self._drain()
        return 0
      time.sleep(0.1)

  def _drain(self) -> None:
    """Lets the output threads copy what is left."""
    for t in self._threads:
      t.join(timeout=5)


def _reason(code: int) -> str:
  return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def main(argv: list[str]) -> int:
  if "--" in argv:
    split = argv.index("--")
    own, train_args = argv[:split], argv[split + 1:]
  else:
    own, train_args = argv, []
  parser = argparse.ArgumentParser(
      usage="python launch/local.py --hosts=N [options] -- TRAINER_FLAGS...",
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", type=int, required=True, help="host processes to start")
  parser.add_argument("--port", type=int, default=0,
                      help="the membership coordinator's port (0: a free one)")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="alone: after a host fails, kill the others and start every host "
                           "again, up to this many times (the hosts share fate); with "
                           "--rejoin_after: restarts of dead hosts, in all")
  parser.add_argument("--rejoin_after", type=float, default=None,
                      help="start a host that died, or left on a SIGTERM of its own, again "
                           "after this many seconds, without stopping the others: it joins "
                           "the running job")
  parser.add_argument("--shared_fate", action="store_true",
                      help="when a host fails, kill the others (and with --max_restarts=N "
                           "start every host again, up to N times); --max_restarts alone "
                           "implies it")
  parser.add_argument("--live", action="store_true",
                      help="(the default now: kept so that older commands run)")
  parser.add_argument("--lease_s", type=float, default=LEASE_S,
                      help="seconds without a heartbeat after which the coordinator drops a "
                           "host")
  parser.add_argument("--max_hosts", type=int, default=None,
                      help="the job's host ids go up to this many; the ids from --hosts on "
                           "start --join_later seconds after the others (which train once "
                           "--hosts have registered) and join the running job")
  parser.add_argument("--join_later", type=float, default=30.0,
                      help="--max_hosts: seconds after the start at which the later hosts "
                           "start (< 0: never by themselves); SIGUSR1 to the launcher starts "
                           "the next of them now")
  parser.add_argument("--workdir_per_host", action="store_true",
                      help="host i gets --workdir=WORKDIR/host<i>: a disk of its own, as on "
                           "machines that share no filesystem")
  args, unknown = parser.parse_known_args(own)
  example = "e.g. python launch/local.py --hosts=2 -- --config=configs/tiny.py --workdir=/tmp/run"
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}; the trainer's flags go after "
                 f"`--`, {example}")
  if not train_args:
    parser.error(f"no trainer flags: give them after `--`, {example}")
  if args.hosts < 1:
    parser.error(f"--hosts={args.hosts}: must be >= 1")
  if args.lease_s <= 0:
    parser.error(f"--lease_s={args.lease_s}: must be > 0")
  if args.shared_fate and args.rejoin_after is not None:
    parser.error("--shared_fate and --rejoin_after: a dead host either stops the others or "
                 "rejoins them, not both")
  if args.max_hosts is not None and args.max_hosts < args.hosts:
    parser.error(f"--max_hosts={args.max_hosts}: must be >= --hosts")
  if args.workdir_per_host and not any(a.startswith("--workdir=") for a in train_args):
    parser.error("--workdir_per_host needs the trainer's --workdir=DIR (with `=`) after `--`")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts={args.max_restarts}: must be >= 0")
  current: list[Hosts] = []
  terminated = threading.Event()
  shared_fate = args.shared_fate or (bool(args.max_restarts) and args.rejoin_after is None)

  def on_sigterm(*_):
    terminated.set()
    if current:  # the coordinator stops them, every host after one round
      current[-1].stop_job()

  def on_sigint(*_):
    if terminated.is_set():  # the second Ctrl-C: stop everything now
      raise KeyboardInterrupt
    print("[launcher] Ctrl-C: the hosts finish the round, save a checkpoint and stop "
          "(Ctrl-C again kills them)", flush=True)
    on_sigterm()

  def on_sigusr1(*_):  # one more host joins now (up to --max_hosts)
    if current:
      current[-1].start_next += 1

  signal.signal(signal.SIGTERM, on_sigterm)
  signal.signal(signal.SIGINT, on_sigint)
  signal.signal(signal.SIGUSR1, on_sigusr1)
  attempt = 0
  while True:
    # A fresh port each time: the old coordinator's may still be held by the kernel.
    current.append(Hosts(args.hosts, train_args, args.port or free_port(),
                         args.workdir_per_host, args.lease_s, args.max_hosts,
                         args.join_later))
    try:
      code = (current[-1].wait(stopping=terminated.is_set) if shared_fate
              else current[-1].wait_live(args.rejoin_after, args.max_restarts,
                                         stopping=terminated.is_set))
    except KeyboardInterrupt:
      current[-1].kill_all()
      current[-1].stop_coordinator()
      return 130
    if code == 0 or terminated.is_set() or not shared_fate:  # else dead hosts rejoin, if asked
      return code
    if attempt == args.max_restarts:
      return code
    attempt += 1
    print(f"[launcher] restart {attempt}/{args.max_restarts}: starting all {args.hosts} "
          f"hosts again; they resume from the newest checkpoint", flush=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
