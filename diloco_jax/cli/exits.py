"""How a command ends on a failure: the one mapping from an exception to the line it prints
on stderr and its exit status (`stop_for`), and the one wrapper every entry point runs its
work in (`run`).

A failure the package raised on purpose (`errors.DilocoError`, a cross-host op's
`CollectiveError`, Ctrl-C) ends the command in its line and nothing else: no traceback
before it, none after it (orbax's threads would print shutdown noise: one process exits at
once). Any other exception is a bug, and its traceback is what to read: it is raised again.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from diloco_jax import errors

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Command:
  """How one entry point words its failures.

  Attributes:
    prefix: put before each line of a DilocoError's message: None, the error's own
      (`Invalid config`, `Stopped`, ...); a command's name ('sample'), every failure being
      its input's; '', the message alone (it names the flag or file at fault).
    interrupted: the line for Ctrl-C, which ends the command with exit status 130.
    also: further exceptions that end the command in their message, with the same prefix
      (prepare: an OSError, the disk's).
    exits: the process ends after the line; False: `run` returns the exit status (for a
      `main` that returns one, as tests call it).
  """
  prefix: str | None = None
  interrupted: str = "Interrupted (Ctrl-C)"
  also: tuple[type[BaseException], ...] = ()
  exits: bool = True


@dataclasses.dataclass(frozen=True)
class Stop:
  """The end of a command: `message` on stderr, then exit status `code`.

  Attributes:
    message: the line (or a line per bad field) that says why.
    code: the exit status.
    now: exit at once even where several jax processes would meet at JAX's shutdown
      barrier (a peer is gone and will never arrive there).
  """
  message: str
  code: int = 1
  now: bool = False


def stop_for(e: BaseException, command: Command, world: Any = None,
             processes: int = 1) -> Stop | None:
  """The line and exit status `e` ends `command` with; None for an exception no command
  expects. `world`: the job's (membership.world.World) once it has started; `processes`:
  the jax processes of the job."""
  if isinstance(e, KeyboardInterrupt):
    return Stop(command.interrupted, 130)
  # Only a job that imported the dispatch thread can have had a cross-host op fail; a
  # command that did not is spared importing it (and jax) for an isinstance.
  dispatch = sys.modules.get("diloco_jax.wire.dispatch")
  if dispatch is not None and isinstance(e, dispatch.CollectiveError):
    return _collective(e, world, processes)
  if isinstance(e, errors.DilocoError):
    return Stop(errors.describe(e, command.prefix), e.exit_code)
  if command.also and isinstance(e, command.also):
    lines = str(e).splitlines() or [""]
    return Stop("\n".join(f"{command.prefix}: {line}" if command.prefix else line
                          for line in lines))
  return None


def _collective(e: errors.DilocoError, world: Any, processes: int) -> Stop:
  """A cross-host op failed on the dispatch thread; its cause says what failed."""
  from diloco_jax.checkpoints import store  # pylint: disable=import-outside-toplevel
  cause = e.__cause__
  if isinstance(cause, store.CheckpointError):  # a save on the dispatch thread
    return Stop(errors.describe(cause))
  if world is not None and world.live:  # the cause alone: it names the host or coordinator
    return Stop(f"Stopped: {cause or e}")
  if processes == 1:
    return Stop(f"Stopped: {e}")
  # ddp: a peer is gone. Exit now rather than wait at JAX's shutdown barrier for a host
  # that will never arrive (which would end in an abort at the heartbeat timeout).
  return Stop(f"Stopped: {e}\nAnother host failed or was killed: see its log.", now=True)


def run(work: Callable[[], T], command: Command, world: Any = None) -> T | int:
  """`work()`'s result; a failure `stop_for` knows prints its line on stderr and ends the
  process (or, where `command.exits` is False, returns its exit status). `world`: the
  job's, once started (a cross-host failure is worded by it)."""
  try:
    return work()
  except BaseException as e:  # noqa: BLE001 -- a known failure, or raised again below
    stop = stop_for(e, command, world, _processes())
    if stop is None:
      raise
  # Outside the `except`: nothing can chain this exception to another one from here on.
  sys.stderr.write(stop.message + "\n")
  if not command.exits:
    return stop.code
  if stop.now or _processes() == 1:
    exit_now(stop.code)
  # Several hosts, which all stop on the same error, meet at JAX's shutdown barrier.
  sys.exit(stop.code)


def exit_now(code: int) -> NoReturn:
  """Ends the process at once, its output flushed: orbax's threads, left from a checkpoint
  read or written, would print noise at the interpreter's shutdown."""
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(code)


def _processes() -> int:
  """The jax processes of this job: 1 but under `jax.distributed` (ddp). Asked without
  starting a backend, which a failure before one started must not do (it takes seconds,
  and fails where the platform asked for is missing)."""
  jax = sys.modules.get("jax")
  if jax is None or not jax.distributed.is_initialized():
    return 1
  return jax.process_count()
