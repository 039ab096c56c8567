"""Host memory: pages the process holds but does not use given back to the operating
system, and huge pages for big buffers.

glibc's malloc keeps what is freed for reuse, and what compiling (LLVM) and the first
rounds free stays counted in the process's RSS: a trim after compiling and after every
round gives it back (`python -m bench.peer` reports the trainer's peak RSS). A trim costs
a few milliseconds; where the C library is not glibc, it leaves malloc alone.

Compiling also runs code: XLA's and LLVM's, in jaxlib's shared library, whose pages stay
mapped into the process once touched, most of it for compiling only. After a compile,
`trim` also drops the process's mappings of such pages (`release_file_pages`): clean pages
of read-only, private mappings of files, whose contents the kernel reads back from the
file (the page cache, usually) when they are touched again, so what still runs comes back
at a minor fault per page. This lowers the process's RSS, which counts every mapped page,
by what it stopped using; the page cache, shared by every process mapping the same
library, keeps the pages as long as the kernel does not need the memory, and a cgroup's
memory accounting still counts them there.

XLA:CPU allocates each step's temporaries as one buffer (the inner step's temporaries in
the start-up line's "XLA's plan"), too big for malloc's heap: it is mapped fresh and
returned on every step, and the kernel faults its pages in one by one, 4 KiB at a time.
With transparent huge pages they come 2 MiB at a time, and the step runs faster with the
same peak RSS (`python -m bench.overhead` reports the step's time). Linux gives huge pages
to the memory a process asks for them (`madvise`), which glibc's malloc does when started
with the tunable `glibc.malloc.hugetlb=1`; tunables are read once at process start, so
`restart_with_huge_pages` starts the trainer's process again with it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def host_memory_available() -> int:
  """Bytes of host memory this process can still take: /proc/meminfo's MemAvailable (or
  all physical memory where there is none), less if a cgroup limit leaves less."""
  available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    pass
  for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                  "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    try:
      with open(limit_file) as f, open(usage_file) as g:
        available = min(available, int(f.read()) - int(g.read()))  # "max": no limit
    except (OSError, ValueError):
      pass
  return available


@functools.cache
def _libc():
  name = ctypes.util.find_library("c")
  try:
    return ctypes.CDLL(name, use_errno=True) if name else None
  except OSError:
    return None


@functools.cache
def _malloc_trim():
  return getattr(_libc(), "malloc_trim", None)  # not glibc (musl, macOS): nothing to trim


def trim() -> None:
  """Returns the free pages of every malloc arena to the OS (glibc's malloc_trim(0)), and
  drops the mappings of clean file pages (`release_file_pages`) if jax compiled anything
  since the last trim: a round that only runs its programs touches no more code than the
  next one needs again."""
  fn = _malloc_trim()
  if fn is not None:
    fn(0)
  global _compiled
  _listen_for_compiles()
  if _compiled:
    _compiled = False
    release_file_pages()


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's, per XLA compile
# Per process: jax's monitoring listener, registered once per process, has nowhere else to
# say that XLA compiled.
_compiled = True  # since the last release (the process's first trim releases)


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  if event == _COMPILE_EVENT:
    global _compiled
    _compiled = True


@functools.cache
def _listen_for_compiles() -> None:
  # Imported on first use: this module runs before jax is (`restart_with_huge_pages`).
  import jax  # pylint: disable=import-outside-toplevel
  jax.monitoring.register_event_duration_secs_listener(_on_duration)


_MADV_DONTNEED = 4
_SMAPS = "/proc/self/smaps"


@functools.cache
def _madvise():
  fn = getattr(_libc(), "madvise", None)
  if fn is not None:
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  return fn


def _releasable(mapping: dict) -> bool:
  """A private, read-only mapping of a regular file none of whose pages was ever written
  (copied on write): every resident page equals the file's, so it can be read back."""
  perms, path = mapping["perms"], mapping["path"]
  return (perms[0] == "r" and perms[1] == "-" and perms[3] == "p"
          and path.startswith("/") and not path.startswith("/dev/")
          and not path.endswith(" (deleted)") and mapping["inode"] != 0
          and mapping.get("Rss", 0) > 0
          and all(mapping.get(k, 1) == 0 for k in ("Private_Dirty", "Anonymous", "Swap")))


def _mappings(smaps: str = _SMAPS):
  mapping = None
  with open(smaps) as f:
    for line in f:
      head, _, rest = line.partition(" ")
      if "-" in head and ":" not in head:  # "start-end perms offset dev inode [path]"
        if mapping is not None:
          yield mapping
        fields = rest.split(None, 4)
        start, end = (int(x, 16) for x in head.split("-"))
        mapping = {"start": start, "end": end, "perms": fields[0],
                   "inode": int(fields[3]), "path": fields[4].strip() if len(fields) > 4 else ""}
      elif mapping is not None and head.endswith(":") and rest.strip().endswith("kB"):
        mapping[head[:-1]] = int(rest.split()[0])
  if mapping is not None:
    yield mapping


def release_file_pages() -> int:
  """Drops this process's mappings of clean pages of read-only files (madvise
  MADV_DONTNEED on `_releasable` mappings: the shared libraries' code and constants);
  returns the KiB that were resident in them. Linux only; elsewhere it does nothing."""
  madvise = _madvise()
  if madvise is None or not os.path.exists(_SMAPS):
    return 0
  released = 0
  for m in list(_mappings()):
    if _releasable(m) and madvise(m["start"], m["end"] - m["start"], _MADV_DONTNEED) == 0:
      released += m["Rss"]
  return released


def _thp_mode() -> str | None:
  """The kernel's transparent-huge-page mode: "always", "madvise", "never" (None: unknown)."""
  try:
    with open(_THP_MODE) as f:
      return f.read().split("[", 1)[1].split("]", 1)[0]
  except (OSError, IndexError):
    return None


def huge_pages() -> bool:
  """Whether this process's big buffers get transparent huge pages."""
  mode = _thp_mode()
  return mode == "always" or (
      mode == "madvise" and f"{HUGE_PAGES_TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", ""))


def with_huge_pages(env: dict[str, str]) -> dict[str, str]:
  """`env` with GLIBC_TUNABLES asking malloc for huge pages, where a process started with
  it gets them and would not otherwise: on Linux with glibc, where the kernel gives them
  on request only ("madvise"), unless GLIBC_TUNABLES already sets `glibc.malloc.hugetlb`
  (also the way to opt out: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0`). Else `env`."""
  tunables = env.get("GLIBC_TUNABLES", "")
  if (not sys.platform.startswith("linux") or _malloc_trim() is None
      or _thp_mode() != "madvise" or HUGE_PAGES_TUNABLE in tunables):
    return env
  return {**env, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{HUGE_PAGES_TUNABLE}=1")))}


def restart_with_huge_pages(only_module: str | None = None) -> None:
  """Replaces this process (exec: the same PID, arguments and environment) by one whose
  malloc asks for huge pages, where `with_huge_pages` would change its environment. Call
  it first thing: what ran before is run again. `only_module`: only when this process is
  `python -m` it. A launcher that starts the process with `with_huge_pages(env)` spares
  it the second start."""
  argv = sys.orig_argv
  if only_module is not None and not any(
      a == "-m" and argv[i + 1:i + 2] == [only_module] for i, a in enumerate(argv)):
    return
  env = with_huge_pages(dict(os.environ))
  if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
    return
  os.environ["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
