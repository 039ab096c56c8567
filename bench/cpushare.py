"""Each bench host's share of this machine's cores (bench/wan.py --pin_cores; not a bench).

A host of a real job computes on cores of its own: while it waits on the link, its cores
idle. On a machine with fewer cores than hosts that is what pinning cannot give: two hosts
on one core take turns, and one host's wait on the link becomes the other's compute (3
hosts on 2 cores: 4-bit sync measured 1.12x the compute-only reference's tokens/s, a run
faster than computing alone). So `Placement` gives each host

  - with hosts <= cores: core i mod the cores (taskset), its own;
  - with more hosts than cores: a CPU quota of its own, the same for every host
    (SHARE x cores / hosts of a core, a cgroup's CFS bandwidth limit, on any core): what a
    host leaves unused while it waits is lost, as on a machine of its own, and no host
    runs faster because another waits. SHARE < 1 leaves the rest to the kernel (tc's
    shaping), the bench and each host's other threads.

`command(i, argv)` runs argv so placed (the cgroup is joined by a shell that then execs
argv: everything argv starts is in it too; place `ip netns exec ...`, not what it runs:
it mounts the namespace's own /sys, without the cgroups). The cgroups are removed on
exit. A quota needs root and the cgroup `cpu` controller (v1 or v2).
"""

from __future__ import annotations

import os
import sys

SHARE = 0.9  # of the cores, split evenly among the hosts that share them
PERIOD_US = 20_000  # CFS bandwidth period: a 20 ms step runs within about one period
V1 = "/sys/fs/cgroup/cpu"
V2 = "/sys/fs/cgroup"


class Placement:
  """Host i's cores (`pin`: else anywhere, unlimited); `tag` names the cgroups made here."""

  def __init__(self, num_hosts: int, pin: bool, tag: str = "dj"):
    self.cores = sorted(os.sched_getaffinity(0))
    self.num_hosts, self.pin = num_hosts, pin
    self.quota = pin and num_hosts > len(self.cores)
    self.share = SHARE * len(self.cores) / num_hosts if self.quota else None
    self.groups = [f"{tag}{os.getpid() % 10000}cpu{i}" for i in range(num_hosts)]
    self._made: list[str] = []

  def describe(self) -> str:
    if not self.pin:
      return "unpinned"
    if not self.quota:
      return "host i on core i mod the cores"
    return f"every host {self.share:.2f} of a core (cgroup CPU quota), on any core"

  def _path(self, i: int) -> str:
    return os.path.join(V1 if os.path.isdir(V1) else V2, self.groups[i])

  def __enter__(self) -> Placement:
    if not self.quota:
      return self
    if not os.path.isdir(V1) and "cpu" not in _read(os.path.join(V2, "cgroup.controllers")):
      sys.exit(f"--pin_cores with {self.num_hosts} hosts on {len(self.cores)} cores needs "
               "the cgroup cpu controller, for a CPU quota per host (none found)")
    quota = int(self.share * PERIOD_US)
    for i in range(self.num_hosts):
      path = self._path(i)
      os.makedirs(path, exist_ok=True)
      self._made.append(path)
      if os.path.isdir(V1):
        _write(os.path.join(path, "cpu.cfs_period_us"), PERIOD_US)
        _write(os.path.join(path, "cpu.cfs_quota_us"), quota)
      else:
        _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
    return self

  def __exit__(self, *exc) -> None:
    for path in self._made:
      try:
        os.rmdir(path)  # empty once its processes are gone
      except OSError as e:
        print(f"WARNING: cgroup {path} left behind: {e}", file=sys.stderr)

  def place(self, i: int, pid: int) -> None:
    """Moves process `pid` (all its threads) into host i's cgroup, where there is one (a
    process started by another, e.g. a launcher's host)."""
    if self.quota:
      _write(os.path.join(self._path(i), "cgroup.procs"), pid)

  def command(self, i: int, argv: list[str]) -> list[str]:
    if not self.pin:
      return argv
    if not self.quota:
      return ["taskset", "-c", str(self.cores[i % len(self.cores)]), *argv]
    procs = os.path.join(self._path(i), "cgroup.procs")
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def _write(path: str, value) -> None:
  with open(path, "w") as f:
    f.write(str(value))
