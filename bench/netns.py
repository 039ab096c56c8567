"""Hosts in network namespaces for the benches (bench/wan.py, bench/linkdrop.py; not a bench).

`Network` builds a bridge and one namespace per host, each joined to the bridge by a veth
pair, with a private address (`prefix`.1, `prefix`.2, ...) and an /etc/netns/NS/hosts that
resolves this machine's hostname to that address (gloo connects to whatever the hostname
resolves to). With `rate_mbit`, every host's link is shaped to that rate in both directions
by `tc tbf` (no delay: this kernel has no netem). `command(h, argv)` runs argv in host h's
namespace, `tx_bytes(h)` reads its veth's counter, `down(h, side)`/`up(h, side)` cut and
restore its link (`inside`: its own interface in its namespace; `outside`: its port on the
bridge), `kill_all()` kills every process in the namespaces. Everything made here is removed
on exit, also when building it fails part way. Needs root (ip netns, tc).

`Localhost` is the stand-in for --smoke with the same interface: the hosts are plain
processes on 127.0.0.1, nothing is shaped, nothing to cut, no veth to count (`tx_bytes` is
None), no root.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

from bench import harness

SIDES = ("inside", "outside")


def sh(*cmd: str, check: bool = True) -> str:
  return subprocess.run(cmd, check=check, capture_output=True, text=True).stdout


class Network:
  """A bridge and one namespace per host at `prefix`.(host + 1), with `rate_mbit` each way on
  every host's link if given. `tag` starts every name made here (this process's id follows:
  interface names stay under 15 characters)."""

  def __init__(self, num_hosts: int, prefix: str, rate_mbit: float | None = None,
               tag: str = "nn"):
    self.num_hosts, self.prefix, self.rate = num_hosts, prefix, rate_mbit
    self.tag = f"{tag}{os.getpid() % 10000}"
    self.bridge = f"{self.tag}br"
    self.namespaces = [f"{self.tag}h{i}" for i in range(num_hosts)]

  def address(self, host: int) -> str:
    return f"{self.prefix}.{host + 1}"

  def command(self, host: int, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", self.namespaces[host], *argv]

  def port(self) -> int:
    return 20000 + os.getpid() % 10000

  def _outside(self, host: int) -> str:  # host's port on the bridge
    return f"{self.tag}v{host}"

  def _inside(self, host: int) -> str:  # host's own interface, in its namespace
    return f"{self.tag}p{host}"

  def __enter__(self) -> Network:
    try:
      sh("ip", "link", "add", self.bridge, "type", "bridge")
      sh("ip", "link", "set", self.bridge, "up")
      for i, ns in enumerate(self.namespaces):
        outside, inside = self._outside(i), self._inside(i)
        sh("ip", "netns", "add", ns)
        # gloo connects to the address the hostname resolves to: inside the namespace it
        # must be this host's address there (`ip netns exec` bind-mounts /etc/netns/NS/hosts).
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
          f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        sh("ip", "link", "set", inside, "netns", ns)
        sh("ip", "link", "set", outside, "master", self.bridge, "up")
        sh(*self.command(i, ["ip", "addr", "add", f"{self.address(i)}/24", "dev", inside]))
        sh(*self.command(i, ["ip", "link", "set", inside, "up"]))
        sh(*self.command(i, ["ip", "link", "set", "lo", "up"]))
        if self.rate is not None:
          tbf = ["tbf", "rate", f"{self.rate}mbit", "burst", "32kb", "latency", "500ms"]
          sh(*self.command(i, ["tc", "qdisc", "add", "dev", inside, "root", *tbf]))  # up
          sh("tc", "qdisc", "add", "dev", outside, "root", *tbf)  # down
    except BaseException:
      self.__exit__()
      raise
    return self

  def tx_bytes(self, host: int) -> int:
    return int(sh(*self.command(host, [
        "cat", f"/sys/class/net/{self._inside(host)}/statistics/tx_bytes"])))

  def _link(self, host: int, side: str, state: str) -> None:
    if side == "inside":
      sh(*self.command(host, ["ip", "link", "set", self._inside(host), state]))
    elif side == "outside":
      sh("ip", "link", "set", self._outside(host), state)
    else:
      raise ValueError(f"side {side!r}: one of {SIDES}")

  def down(self, host: int, side: str = "inside") -> None:
    self._link(host, side, "down")

  def up(self, host: int, side: str = "inside") -> None:
    self._link(host, side, "up")

  def kill_all(self) -> None:
    for ns in self.namespaces:
      for pid in sh("ip", "netns", "pids", ns, check=False).split():
        try:
          os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
          pass

  def __exit__(self, *_) -> None:
    self.kill_all()
    for i, ns in enumerate(self.namespaces):
      sh("ip", "netns", "del", ns, check=False)
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
      sh("ip", "link", "del", self._outside(i), check=False)
    sh("ip", "link", "del", self.bridge, check=False)


class Localhost:
  """--smoke: the hosts as plain processes on 127.0.0.1; no namespaces, no shaping, nothing
  to cut, no veth to count bytes on (`tx_bytes` is None), no root."""

  def __init__(self, num_hosts: int):
    self.num_hosts = num_hosts

  def __enter__(self) -> Localhost:
    return self

  def __exit__(self, *_) -> None:
    pass

  def address(self, host: int) -> str:
    return "127.0.0.1"

  def command(self, host: int, argv: list[str]) -> list[str]:
    return argv

  def port(self) -> int:
    return harness.free_port()

  def tx_bytes(self, host: int) -> None:
    return None

  def down(self, host: int, side: str = "inside") -> None:
    pass

  def up(self, host: int, side: str = "inside") -> None:
    pass

  def kill_all(self) -> None:
    pass
