"""The compilation cache: JAX's persistent cache on every host, and the inner step and init
kept whole beside it, so that a host that starts again loads its compiled programs rather
than compiling them: that is most of its time to the first step.

JAX's cache, on every host. JAX keys an entry by the program *and its devices*, and writes
entries from process 0 only (so that a shared filesystem never sees two processes write
one entry). A host's own programs (its inner step, init, eval) run on its own device, so
the other hosts' entries are never host 0's, and without more than JAX's defaults every
host but 0 compiles them again at every start (measured: configs/peer.py's hosts wait on
host 1's 4 s of compiling at every cached start). So on host i > 0 the cache is
`DIR/host<i>`, a directory only that host writes, and JAX's write of an entry there is
allowed (`use`). Host 0 keeps `DIR` itself. Programs that span the hosts (the cross-host
sums) are then written by every host, each to its own directory: no entry is ever written
by two processes.

Programs kept whole. JAX's cache spares a start XLA's compile, but not the trace and the
lowering that find its entry: with configs/peer.py, 0.35 s of the inner step's 0.54 s to
load, and 0.1 s of init's 0.33 s. An entry in `executables/` under JAX's directory is the
executable itself (`jax.experimental.serialize_executable`), found without a trace by what
the program is built from:

  key      the caller's spec (everything the program's function and arguments come from:
           the config, the model's shape, the arguments' shapes and shardings) and the
           machine (jax's, jaxlib's and Python's versions, the backend and its version,
           the CPU's model and instruction sets, every device and process, jax's config
           values, and the JAX_/XLA_ environment);
  sources  every Python module loaded when the entry was written, by its file's path,
           size and modification time: an entry is used only while all of them are
           unchanged (the test Python makes of its own bytecode cache), so that an edit to
           the model, the trainer, JAX, or a model module of your own never runs a stale
           program;
  devices  the devices the program was compiled for: they must be the caller's;
  sha256   of the executable's bytes, checked before XLA reads them.

An entry that fails any test, or does not load, is compiled as before and written again.
A file is written whole (to a temporary name, then renamed), and by one host: each host
keeps its own directory, whose entries name its own devices. Like JAX's cache, the
directory holds machine code this process runs: it is trusted as the workdir is.

Where the directory is: JAX's own setting, `jax_compilation_cache_dir`, which the entry
point sets once per process (`use`); nothing else carries it (`directory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import os
import pickle
import platform
import sys
import tempfile
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib

FORMAT = 1  # bump when an entry's layout changes: older entries then miss
KEEP = 4  # entries kept per program name, the newest: one config's is rewritten in place
SUFFIX = ".executable"


@dataclasses.dataclass(frozen=True)
class Loaded:
  program: jax.stages.Compiled
  facts: Any  # what the writer computed from the program and asked to keep (`store`)


def use(path: str | None, workdir: str, host_id: int | None) -> str | None:
  """Turns JAX's cache on for every program, whatever its compile time, in `path` (None:
  `workdir/compilation_cache`; "none": off), in `host<i>/` under it for host i > 0, and
  returns the directory used (None when off); the programs kept whole go in its
  `executables/`. The environment's JAX_COMPILATION_CACHE_DIR wins, as JAX reads it
  itself. `host_id`: this host's index where it is known before jax.distributed starts
  (--host_id); else every host shares `path` and host 0 writes, JAX's default."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR") or path == "none":
    return None
  cache = path or os.path.join(workdir, "compilation_cache")
  if host_id:
    cache = os.path.join(cache, f"host{host_id}")
    _write_from_this_host()
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # JAX writes the path of its GPU autotuning cache (under this directory) into every
  # program's compile options, and so into every key: each host's directory would then key
  # the same program differently, and no host could use another's entries
  # (membership/programs.py). Off, a program's key is the same wherever its directory is.
  with contextlib.suppress(AttributeError, ValueError):  # (a JAX without the option)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  return cache


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


def directory() -> str | None:
  """Where programs are kept whole: `executables/` in JAX's cache directory, read from JAX's
  own per-process setting (None: off). Off where the environment names JAX's directory
  (JAX_COMPILATION_CACHE_DIR): that one may be shared by processes whose code differs in
  ways no file shows (tests that patch functions), so only a directory this process set
  (`use`) keeps programs whole."""
  cache = jax.config.jax_compilation_cache_dir
  if not cache or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  return os.path.join(cache, "executables")


def load(name: str, spec: Any, devices: Sequence[jax.Device] | None = None) -> Loaded | None:
  """The program `name` built from `spec`, loaded from its entry; None where the cache is
  off, there is no entry, or the entry is stale (see the module's docstring). `devices`:
  the devices the program must run on (None: those it was compiled for)."""
  path = _path(name, spec)
  if path is None or not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      entry = pickle.load(f)
    if entry.get("format") != FORMAT or not _unchanged(entry["sources"]):
      return None
    if hashlib.sha256(entry["executable"]).hexdigest() != entry["sha256"]:
      warnings.warn(f"{path}: its bytes are not those written (sha256 differs); "
                    "compiling the program again")
      return None
    by_id = {d.id: d for d in jax.devices()}
    if not all(i in by_id for i in entry["devices"]) or (
        devices is not None and sorted(d.id for d in devices) != entry["devices"]):
      return None
    on = [by_id[i] for i in entry["devices"]]
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel
    program = serialize_executable.deserialize_and_load(
        entry["executable"], entry["in_tree"], entry["out_tree"], backend=on[0].client,
        execution_devices=on)
  except Exception as e:  # pylint: disable=broad-except  # any failure: compile as before
    warnings.warn(f"{path} could not be loaded ({type(e).__name__}: {e}); compiling the "
                  "program again")
    return None
  return Loaded(program, entry["facts"])


def store(name: str, spec: Any, program: jax.stages.Compiled, facts: Any = None) -> None:
  """Writes `program` (built from `spec`) and `facts` (picklable) as the entry that
  `load(name, spec)` finds, and keeps the newest KEEP entries of `name`. Does nothing where
  the cache is off; a program that cannot be serialized (one with host callbacks) is left
  to JAX's cache, with a warning."""
  path = _path(name, spec)
  if path is None:
    return
  temporary = None
  try:
    from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel
    executable, in_tree, out_tree = serialize_executable.serialize(program)
    entry = {"format": FORMAT, "sources": _sources(), "facts": facts,
             "devices": sorted(d.id for d in program.runtime_executable().local_devices()),
             "in_tree": in_tree, "out_tree": out_tree, "executable": executable,
             "sha256": hashlib.sha256(executable).hexdigest()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), prefix=".tmp-",
                                     delete=False) as f:
      temporary = f.name
      pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.chmod(temporary, 0o644)  # as JAX's own entries (a temporary file is its owner's alone)
    os.replace(temporary, path)
  except Exception as e:  # pylint: disable=broad-except  # the run goes on without it
    if temporary is not None and os.path.exists(temporary):
      os.remove(temporary)
    warnings.warn(f"program {name!r} not kept in {os.path.dirname(path)} "
                  f"({type(e).__name__}: {e})")
    return
  older = sorted(glob.glob(os.path.join(os.path.dirname(path), f"{name}-*{SUFFIX}")),
                 key=os.path.getmtime)
  for stale in older[:-KEEP]:
    with contextlib.suppress(FileNotFoundError):  # another process's pruning took it
      os.remove(stale)


def compiled(name: str, spec: Any, lower: Callable[[], jax.stages.Lowered], *,
             devices: Sequence[jax.Device] | None = None,
             facts: Callable[[jax.stages.Compiled], Any] | None = None) -> Loaded:
  """`load(name, spec, devices)`, or else `lower().compile()` kept by `store` with
  `facts(program)`."""
  found = load(name, spec, devices)
  if found is not None:
    return found
  program = lower().compile()
  found = Loaded(program, facts(program) if facts else None)
  store(name, spec, program, found.facts)
  return found


def _path(name: str, spec: Any) -> str | None:
  kept = directory()
  if kept is None:
    return None
  key = json.dumps([FORMAT, name, spec, machine()], sort_keys=True, default=repr)
  return os.path.join(kept, f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:40]}"
                      f"{SUFFIX}")


def machine() -> dict[str, Any]:
  """What besides the program's own spec and code decides what XLA builds from it."""
  client = jax.devices()[0].client
  return {"versions": [jax.__version__, jaxlib.__version__, sys.version],
          "backend": [client.platform, client.platform_version],
          "cpu": _cpu(),  # XLA:CPU's code uses the instructions this CPU has
          "devices": [(d.id, d.process_index, d.device_kind) for d in jax.devices()],
          "process": [jax.process_index(), jax.process_count()],
          # every value but the default device, which a `with` changes (callers whose
          # program takes it give it themselves), and where the cache is, which no
          # program depends on (`use`): the same program keys alike in every directory
          "config": sorted((k, repr(v)) for k, v in jax.config.values.items()
                           if k not in ("jax_default_device", "jax_compilation_cache_dir")),
          "environment": sorted((k, v) for k, v in os.environ.items()
                                if k.startswith(("JAX_", "XLA_", "TPU_", "LIBTPU")))}


@functools.cache
def _cpu() -> list[str]:
  """This CPU's model and instruction-set flags (Linux; elsewhere its platform's name): an
  entry compiled where the CPU has instructions this one lacks must not load here (a
  workdir on a network disk, its host replaced by another machine type)."""
  try:
    with open("/proc/cpuinfo") as f:
      info = {key.strip(): value for key, value in (
          line.split(":", 1) for line in f.read().split("\n\n", 1)[0].splitlines()
          if ":" in line)}
    return [" ".join(info.get(k, "").split()) for k in ("model name", "flags", "Features")]
  except OSError:
    return [platform.machine(), platform.processor()]


def _sources() -> list[tuple[str, int, int]]:
  """(path, mtime_ns, size) of every loaded module's file."""
  files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
  out = []
  for path in sorted(f for f in files if isinstance(f, str)):
    try:
      st = os.stat(path)
    except OSError:
      continue
    out.append((path, st.st_mtime_ns, st.st_size))
  return out


def _unchanged(sources: list[tuple[str, int, int]]) -> bool:
  for path, mtime_ns, size in sources:
    try:
      st = os.stat(path)
    except OSError:
      return False
    if st.st_mtime_ns != mtime_ns or st.st_size != size:
      return False
  return True
