"""JAX's persistent compilation cache for the trainer, on every host.

A restarted host should load its compiled programs rather than compile them again: that is
most of its time to the first step. JAX keys an entry by the program *and its devices*, and
writes entries from process 0 only (so that a shared filesystem never sees two processes
write one entry). A host's own programs (its inner step, init, eval) run on its own device,
so the other hosts' entries are never host 0's, and without more than JAX's defaults every
host but 0 compiles them again at every start (measured: configs/peer.py's hosts wait on
host 1's 4 s of compiling at every cached start).

So on host i > 0 the cache is `DIR/host<i>`, a directory only that host writes, and JAX's
write of an entry there is allowed. Host 0 keeps `DIR` itself, as before. Programs that
span the hosts (the cross-host sums) are then written by every host, each to its own
directory: no entry is ever written by two processes.
"""

from __future__ import annotations

import functools
import os
import warnings


def use(path: str | None, workdir: str, host_id: int | None) -> str | None:
  """Turns the cache on for every program, whatever its compile time, in `path` (None:
  `workdir/compilation_cache`; "none": off), in `host<i>/` under it for host i > 0, and
  returns the directory used (None when off). The environment's JAX_COMPILATION_CACHE_DIR
  wins, as JAX reads it itself. `host_id`: this host's index where it is known before
  jax.distributed starts (--host_id); else every host shares `path` and host 0 writes,
  JAX's default."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR") or path == "none":
    return None
  import jax  # pylint: disable=import-outside-toplevel  # the trainer has imported it
  directory = path or os.path.join(workdir, "compilation_cache")
  if host_id:
    directory = os.path.join(directory, f"host{host_id}")
    _write_from_this_host()
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # The inner step and init, kept whole beside JAX's entries (a start then skips their
  # traces too). Not under the environment's directory: that one may be shared by
  # processes whose code differs in ways no file shows (tests that patch functions).
  from diloco_jax import executables  # pylint: disable=import-outside-toplevel
  executables.use(os.path.join(directory, "executables"))
  return directory


def _write_from_this_host() -> None:
  """Makes JAX's cache write, which returns at once on any process but 0, store this
  process's entries too (as its body does for process 0: our minimum compile time is 0,
  and a program with host callbacks is left to JAX, which never stores one). Where JAX's
  internals differ from these (another version), nothing changes: this host compiles as
  before."""
  try:
    from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
    from jax._src import compiler  # pylint: disable=import-outside-toplevel
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  write = getattr(compiler, "_cache_write", None)
  put = getattr(compilation_cache, "put_executable_and_time", None)
  if write is None or put is None or getattr(write, "every_host", False):
    return

  @functools.wraps(write)
  def every_host(cache_key, compile_time_secs, module_name, backend, executable,
                 host_callbacks):
    if distributed.global_state.process_id == 0 or host_callbacks:
      return write(cache_key, compile_time_secs, module_name, backend, executable,
                   host_callbacks)
    try:
      put(cache_key, module_name, executable, backend, int(compile_time_secs))
    except Exception as e:  # pylint: disable=broad-except  # as JAX's own write: a warning
      warnings.warn(f"Error writing persistent compilation cache entry for "
                    f"{module_name!r}: {type(e).__name__}: {e}")
    return None

  every_host.every_host = True
  compiler._cache_write = every_host  # pylint: disable=protected-access
