"""Who may use a workdir, and how a run may start over in one: nothing already trained lost.

A workdir holds one run at a time. Host 0 holds `workdir/lock` for the run's lifetime: an
exclusive `flock` on it (released by the kernel when the process ends, however it ends),
and in it a JSON line naming the holder's machine, pid, start time and command. A second
run on the same workdir is refused, naming the holder. A lock left by a run that is gone
is stale and taken over. Where a shared filesystem does not carry flocks between
machines, the holder also touches the file every `REFRESH_S` seconds, and a file naming
another machine that was touched within `STALE_AFTER_S` seconds is refused too.

Hosts on different machines need not share a disk. At start host 0 takes the lock and
writes a fresh nonce into it; every other host looks for that nonce in its own workdir's
lock. All find it: the workdir is one shared directory (host 0 writes the checkpoints'
shared part, checkpoints/shared_dir.py). None finds it: each host has its own workdir, takes its
own lock there and keeps its own checkpoints (checkpoints/per_host.py). Some but not all:
refused, naming which hosts share host 0's directory.

Starting over is always explicit: `--restart_from_scratch` moves the workdir's previous
run (checkpoints, metrics, events, plot, run.json) into `workdir/previous/<time>/` and
says where; without it, a workdir whose checkpoints cannot be read is refused on every
attempt (checkpoints/shared_dir.py), never trained again from round 1.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from diloco_jax import errors

LOCK = "lock"
PREVIOUS = "previous"
REFRESH_S = 10.0
STALE_AFTER_S = 120.0
# What a run writes into its workdir; moved aside together by --restart_from_scratch.
RUN_FILES = ("checkpoints", "checkpoints_unreadable", "metrics.jsonl", "tensorboard",
             "wandb", "profile", "loss.png", "run.json")
_HELD: dict[str, Lock] = {}  # path -> this process's lock on it


class WorkdirInUseError(errors.DilocoError, RuntimeError):
  """Another run holds the workdir's lock; the message names it."""


def describe(holder: dict) -> str:
  return (f"pid {holder.get('pid')} on {holder.get('host')}, started "
          f"{holder.get('started_at')}: {holder.get('command')}")


class Lock:
  """The workdir's lock, held by this process until `release()`. `stale`: the holder
  named in a lock that was taken over (its run had ended without releasing it)."""

  def __new__(cls, workdir: str):
    path = os.path.realpath(os.path.join(workdir, LOCK))
    if path in _HELD:  # another Trainer of this process on the same workdir
      return _HELD[path]
    lock = super().__new__(cls)
    lock._acquire(path)
    _HELD[path] = lock
    return lock

  def _acquire(self, path: str) -> None:
    self.path, self._stop = path, threading.Event()
    while True:
      self._fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
      holder = self._read()
      try:
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(self._fd)
        raise self._in_use(holder) from None
      try:  # the file we locked is still the lock (a releasing holder unlinks it first)
        if os.stat(path).st_ino == os.fstat(self._fd).st_ino:
          break
      except FileNotFoundError:
        pass
      os.close(self._fd)
    if (holder and holder.get("host") != socket.gethostname()
        and time.time() - os.path.getmtime(path) < STALE_AFTER_S):
      fcntl.flock(self._fd, fcntl.LOCK_UN)  # a live holder this filesystem's flock misses
      os.close(self._fd)
      raise self._in_use(holder)
    self.stale = holder
    self.nonce = uuid.uuid4().hex  # read by the other hosts: is this workdir theirs too?
    me = {"host": socket.gethostname(), "pid": os.getpid(), "nonce": self.nonce,
          "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (json.dumps(me) + "\n").encode(), 0)
    threading.Thread(target=self._refresh, daemon=True, name="workdir-lock").start()

  def _in_use(self, holder: dict | None) -> WorkdirInUseError:
    who = describe(holder) if holder else "holder unknown"
    return WorkdirInUseError(
        f"--workdir={os.path.dirname(self.path)} is in use by another run ({who}); wait "
        f"for it to end, or use another --workdir")

  def _read(self) -> dict | None:
    try:
      return json.loads(os.pread(self._fd, 65536, 0).decode() or "null")
    except (OSError, ValueError):
      return None

  def _refresh(self) -> None:
    """Keeps the lock fresh for hosts on other machines that judge it by its age."""
    while not self._stop.wait(REFRESH_S):
      try:
        os.utime(self.path)
      except OSError:
        pass

  def release(self) -> None:
    """Removes the lock file, then lets go of it (the next run creates it anew)."""
    if _HELD.pop(self.path, None) is None:
      return
    self._stop.set()
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass
    os.close(self._fd)


def move_previous_run(workdir: str) -> str | None:
  """Moves what an earlier run wrote into workdir/previous/<time>/; returns that
  directory, or None when there was nothing to move."""
  present = [name for name in RUN_FILES if os.path.exists(os.path.join(workdir, name))]
  if not present:
    return None
  target = os.path.join(workdir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S"))
  os.makedirs(target)
  for name in present:
    os.rename(os.path.join(workdir, name), os.path.join(target, name))
  return target


class Claim:
  """What start-up learned about the workdir. Attributes: lock, this host's lock (host 0's
  on a shared workdir, every host's own on per-host workdirs; None: another host holds
  it); shared, whether every host's --workdir is the same directory."""

  def __init__(self, lock: Lock | None, shared: bool):
    self.lock, self.shared = lock, shared

  def release(self) -> None:
    if self.lock is not None:
      self.lock.release()


def _take(workdir: str, restart_from_scratch: bool) -> Lock:
  lock = Lock(workdir)
  if lock.stale:
    print(f"workdir lock of an earlier run that ended without releasing it taken over "
          f"({describe(lock.stale)})", flush=True)
  if restart_from_scratch:
    moved = move_previous_run(workdir)
    print("--restart_from_scratch: " + (f"the previous run in {workdir} moved to {moved}"
                                        if moved else f"nothing to move in {workdir}"),
          flush=True)
  return lock


def _take_and_agree(workdir: str, take: bool, restart_from_scratch: bool, agree,
                    other: str, held: Lock | None = None) -> Lock | None:
  """This host's lock (taken now if `take`, else `held`), once every host could take the
  one it had to; else every host raises (the error of a host that could not, or `other`)
  and lets go of its lock."""
  lock, error = held, None
  if take:
    try:
      lock = _take(workdir, restart_from_scratch)
    except WorkdirInUseError as e:
      error = e
  if not agree(error is None):
    if lock is not None:
      lock.release()
    raise error or WorkdirInUseError(other)
  return lock


def _holds_nonce(workdir: str, nonce: str) -> bool:
  try:
    with open(os.path.join(workdir, LOCK)) as f:
      return json.loads(f.read() or "null").get("nonce") == nonce
  except (OSError, ValueError, AttributeError):
    return False


def claim(workdir: str, *, host: int, num_hosts: int,
          allgather: Callable[[np.ndarray], np.ndarray],
          restart_from_scratch: bool) -> Claim:
  """Host 0 locks the workdir (with `restart_from_scratch`, moving the previous run
  aside); then the hosts learn whether they share it (module docstring) and, if not, each
  other host does the same in its own. `allgather(words)` is the job's all-gather: every
  host's array, in host order. Every host returns or raises alike."""
  def agree(ok: bool) -> bool:
    return bool(allgather(np.array([ok])).all())

  lock = _take_and_agree(workdir, host == 0, restart_from_scratch, agree,
                         "host 0 found its --workdir in use by another run (its log names "
                         "the holder)")
  if num_hosts == 1:
    return Claim(lock, shared=True)
  mine = bytes.fromhex(lock.nonce) if host == 0 else bytes(16)
  nonce = bytes(allgather(np.frombuffer(mine, np.uint8))[0]).hex()
  sees = allgather(np.array([host == 0 or _holds_nonce(workdir, nonce)]))[:, 0]
  if sees.all():
    return Claim(lock, shared=True)
  if sees[1:].any():
    same = [h for h in range(num_hosts) if sees[h]]
    other = [h for h in range(num_hosts) if not sees[h]]
    if lock is not None:
      lock.release()
    raise WorkdirInUseError(
        f"hosts {same} share one --workdir and hosts {other} each have their own: give "
        f"every host the same shared directory, or every host a directory of its own")
  lock = _take_and_agree(workdir, host != 0, restart_from_scratch, agree,
                         "another host found its --workdir in use by another run (its log "
                         "names the holder)", held=lock)
  return Claim(lock, shared=False)


def claim_joining(workdir: str, *, host: int, num_hosts: int,
                  restart_from_scratch: bool) -> tuple[Claim, str]:
  """A host joining a live job (no one to agree with until it is admitted): its lock and
  the directory it writes. A workdir that holds another host's `host<j>/` directory is the
  job's shared one, where live membership keeps each host's in `host<i>/`; else it is this
  host's own."""
  others = [j for j in range(num_hosts)
            if j != host and os.path.isdir(os.path.join(workdir, f"host{j}"))]
  if others:
    workdir = os.path.join(workdir, f"host{host}")
    os.makedirs(workdir, exist_ok=True)
  return Claim(_take(workdir, restart_from_scratch), shared=False), workdir
