"""bench/netns.py for real (the WAN benches and the planner's calibration run their hosts
in its namespaces): two hosts on a bridge, each link shaped by `tc tbf`; bytes sent from
host 0 reach host 1 no faster than the rate; on exit nothing made is left. Needs root and
`ip netns`: skipped, with the reason, where namespaces cannot be made."""

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from bench import netns

RATE_MBIT = 8
PAYLOAD = 400_000  # bytes: about 0.4 s at 8 Mbit/s, well past tbf's 32 KB bursts
BURST = 32 * 1024  # netns.Network's tbf burst, on host 0's link and on host 1's

# Host 1 listens, reads until EOF and prints the bytes and the seconds from accept to EOF.
SERVER = textwrap.dedent("""
    import socket, sys, time
    with socket.create_server((sys.argv[1], int(sys.argv[2]))) as s:
      print("listening", flush=True)
      conn, _ = s.accept()
      t, n = time.monotonic(), 0
      while chunk := conn.recv(65536):
        n += len(chunk)
      print(n, time.monotonic() - t, flush=True)
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as c:
      c.sendall(bytes(int(sys.argv[3])))
""")


def cannot_make_namespaces() -> str | None:
  """Why this machine cannot run the test, or None."""
  if os.geteuid() != 0:
    return "network namespaces need root"
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    return f"{' and '.join(missing)} not installed"
  probe = f"t48probe{os.getpid()}"
  made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                        check=False)
  if made.returncode:
    return f"`ip netns add` failed: {' '.join(made.stderr.split())}"
  subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
  return None


def leftovers(network: netns.Network) -> list[str]:
  """What is left of `network`'s namespaces, links and /etc/netns entries."""
  names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout.split()
  links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=False).stdout
  made = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
  return sorted({n for n in names + made if n.startswith(network.tag)}
                | set(glob.glob(f"/etc/netns/{network.tag}*")))


def remove(network: netns.Network) -> None:
  """Whatever of `network` a failing test or a broken `__exit__` left behind."""
  network.kill_all()
  for name in leftovers(network):
    if name.startswith("/etc/netns/"):
      shutil.rmtree(name, ignore_errors=True)
    else:
      subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
      subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


def test_two_hosts_in_namespaces_exchange_bytes_at_the_shaped_rate():
  reason = cannot_make_namespaces()
  if reason:
    pytest.skip(reason)
  network = netns.Network(2, prefix="10.48.0", rate_mbit=RATE_MBIT, tag="t48")
  port, server = network.port(), None
  try:
    with network:
      assert [network.address(h) for h in range(2)] == ["10.48.0.1", "10.48.0.2"]
      # Shaped both ways: host 0's own interface (up) and host 1's port on the bridge (down).
      inside = subprocess.run(network.command(0, ["tc", "qdisc", "show"]),
                              capture_output=True, text=True, check=True).stdout
      outside = subprocess.run(["tc", "qdisc", "show", "dev", f"{network.tag}v1"],
                               capture_output=True, text=True, check=True).stdout
      for qdisc, dev in ((inside, f"{network.tag}p0"), (outside, f"{network.tag}v1")):
        assert re.search(rf"qdisc tbf \w+: (dev {dev} )?root .*rate 8Mbit burst 32Kb",
                         qdisc), qdisc
      sent_before = network.tx_bytes(0)
      server = subprocess.Popen(
          network.command(1, [sys.executable, "-c", SERVER, network.address(1), str(port)]),
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      assert server.stdout.readline() == "listening\n"
      client = subprocess.run(
          network.command(0, [sys.executable, "-c", CLIENT, network.address(1), str(port),
                              str(PAYLOAD)]), capture_output=True, text=True, timeout=60,
          check=False)
      assert client.returncode == 0, client.stderr[-2000:]
      out = server.communicate(timeout=60)[0]
      received, seconds = out.split()
      assert int(received) == PAYLOAD, out
      # tbf never sends faster than the rate once a burst is spent (TCP's headers only
      # add to the time): without shaping this takes milliseconds.
      floor = (PAYLOAD - 2 * BURST) * 8 / (RATE_MBIT * 1e6)
      assert float(seconds) >= 0.9 * floor, (seconds, floor)
      assert network.tx_bytes(0) - sent_before >= PAYLOAD  # its veth counted them
    assert leftovers(network) == [], "netns.Network left these behind"
  finally:
    if server is not None and server.poll() is None:
      server.kill()
      server.communicate()
    remove(network)
