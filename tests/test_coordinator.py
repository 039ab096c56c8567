"""The membership coordinator (runtime/coordinator.py): leases, epochs that only grow, frames
authenticated with a key from the join token, and a host that outlives the coordinator."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from diloco_jax.runtime import coordinator as co
from diloco_jax.runtime import security
from diloco_jax.runtime.coordinator_client import Client, CoordinatorLost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = security.JoinToken("a-join-token-for-the-tests", "the test")
OTHER = security.JoinToken("another-token-of-another-job", "the test")
LEASE_S = 0.4


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def coordinator(port: int, max_hosts: int = 3, token=TOKEN):
  """A coordinator in a thread; yields its log (a list of lines)."""
  log, stop = [], threading.Event()
  thread = threading.Thread(target=co.serve, args=(port, max_hosts, LEASE_S, co.key_for(token)),
                            kwargs={"stop": stop, "log": log.append}, daemon=True)
  thread.start()
  try:
    yield log
  finally:
    stop.set()
    thread.join(5)


@contextlib.contextmanager
def clients(port: int, n: int, token=TOKEN, timeout_s: float = 1.0):
  made = [Client(f"127.0.0.1:{port}", token, timeout_s) for _ in range(n)]
  try:
    yield made
  finally:
    for c in made:
      c.close()


def dropped(log: list[str]) -> list[str]:
  return [line for line in log if "dropped a frame" in line]


def test_epochs_follow_registrations_leases_and_leaves():
  port = free_port()
  with coordinator(port) as log, clients(port, 3) as (a, b, c):
    assert a.register("tcp://a:1").epoch.number == 1
    rb = b.register("tcp://b:1")
    assert (rb.host, rb.epoch.number, rb.epoch.hosts) == (1, 2, (0, 1))
    assert [m.address for m in rb.epoch.members] == ["tcp://a:1", "tcp://b:1"]
    assert c.register("tcp://c:1", host=2).epoch.hosts == (0, 1, 2)
    assert a.heartbeat() == b.heartbeat() == c.heartbeat()  # no change: no new epoch
    assert a.last_epoch == 3
    c.leave()
    assert (a.heartbeat().number, a.heartbeat().hosts) == (4, (0, 1))
    # b stops heartbeating: its lease runs out and a new epoch drops it
    deadline = time.monotonic() + 10 * LEASE_S
    while (epoch := a.heartbeat()).hosts != (0,):
      assert time.monotonic() < deadline, "host 1's lease never ran out"
      time.sleep(LEASE_S / 4)
    assert epoch.number == 5
    assert b.heartbeat() is None  # told to register again, as a new incarnation
    again = b.register("tcp://b:2")
    assert (again.host, again.epoch.number) == (1, 6)
    assert again.incarnation != rb.incarnation
    assert a.heartbeat().members[1].address == "tcp://b:2"
  assert [line.split(": ", 1)[1] for line in log if ": epoch " in line] == [
      "epoch 1: hosts 0 (host 0 joined)", "epoch 2: hosts 0,1 (host 1 joined)",
      "epoch 3: hosts 0,1,2 (host 2 joined)", "epoch 4: hosts 0,1 (host 2 left)",
      "epoch 5: hosts 0 (lease of host 1 ran out)", "epoch 6: hosts 0,1 (host 1 joined)"]


def test_a_host_that_registers_again_is_a_new_incarnation_and_the_old_one_is_gone():
  port = free_port()
  with coordinator(port), clients(port, 2) as (old, new):
    first = old.register("tcp://x:1", host=0)
    second = new.register("tcp://x:2", host=0)
    assert second.epoch.number == first.epoch.number + 1
    assert second.epoch.members == (co.Member(0, second.incarnation, "tcp://x:2"),)
    assert old.heartbeat() is None


def test_max_hosts_refuses_one_more_host_and_an_id_outside_it():
  port = free_port()
  with coordinator(port, max_hosts=2) as log, clients(port, 4) as (a, b, c, d):
    a.register("tcp://a")
    b.register("tcp://b")
    with pytest.raises(co.CoordinatorError, match=r"refused us: all 2 host ids are taken"):
      c.register("tcp://c")
    with pytest.raises(co.CoordinatorError, match=r"host id 5 is outside 0\.\.1"):
      d.register("tcp://d", host=5)
    assert a.heartbeat().hosts == (0, 1)
  assert sum("refused" in line for line in log) == 2


def test_another_token_a_forged_frame_and_replays_are_dropped_with_one_line_each():
  port = free_port()
  with coordinator(port) as log, clients(port, 1) as (host,), \
       clients(port, 1, token=OTHER) as (stranger,), clients(port, 1, token=None) as (bare,):
    epoch = host.register("tcp://h").epoch
    for intruder in (stranger, bare):
      with pytest.raises(co.CoordinatorError, match="not authenticated with this job's key"):
        intruder.register("tcp://intruder")
    assert len(dropped(log)) == 2

    ctx = zmq.Context()
    raw = ctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 2000)
    raw.connect(f"tcp://127.0.0.1:{port}")
    try:
      def send(frames):
        raw.send_multipart(frames)
        return raw.recv_multipart()

      # a well-formed heartbeat with a MAC under no key of ours
      reg = host.registration
      forged = {"op": "heartbeat", "host": 0, "incarnation": reg.incarnation, "seq": 99}
      assert send([co.seal(b"x" * 32, co.C2S, forged)[0], b"\0" * 32])[1] == b""
      # a heartbeat seen on the wire, sent again (its counter does not grow)
      host.heartbeat()
      seen = co.seal(co.key_for(TOKEN), co.C2S, {"op": "heartbeat", "host": 0,
                                                  "incarnation": reg.incarnation, "seq": 2})
      assert co.unseal(co.key_for(TOKEN), co.S2C, send(seen))["op"] == "epoch"  # the first time
      assert send(seen)[1] == b""
      # a register whose challenge was answered once already
      hello = co.unseal(co.key_for(TOKEN), co.S2C, send(co.seal(
          co.key_for(TOKEN), co.C2S, {"op": "hello", "nonce": "n"})))
      register = co.seal(co.key_for(TOKEN), co.C2S, {
          "op": "register", "challenge": hello["challenge"], "host": 1, "address": "tcp://r",
          "last_epoch": 0})
      assert co.unseal(co.key_for(TOKEN), co.S2C, send(register))["op"] == "registered"
      assert send(register)[1] == b""
    finally:
      ctx.destroy(linger=0)
    lines = dropped(log)
    assert len(lines) == 5
    assert "another join token" in lines[2]
    assert "#2 of host 0 after #2 (a replay?)" in lines[3]
    assert "used or expired challenge (a replay?)" in lines[4]
    host._seq = 2  # the raw socket spoke for this host above
    after = host.heartbeat()
    assert after.hosts == (0, 1) and after.number == epoch.number + 1  # only the one register


def test_the_number_only_grows_across_a_restart_of_the_coordinator():
  port = free_port()
  with clients(port, 2) as (a, b):
    with coordinator(port):
      a.register("tcp://a")
      first = b.register("tcp://b").epoch
      b.leave()
      assert a.heartbeat().number == 3
    with pytest.raises(CoordinatorLost, match=rf"^no answer from the coordinator at "
                       rf"127\.0\.0\.1:{port} within 1 s \(heartbeat\)"):
      a.heartbeat()
    with coordinator(port) as log, clients(port, 1) as (newcomer,):
      # it kept nothing: the hosts tell it their ids and the numbers they saw; a newcomer
      # that asks for any id gets one only after a lease, when the others are back
      joined = []
      started = time.monotonic()
      thread = threading.Thread(target=lambda: joined.append(newcomer.register("tcp://c")))
      thread.start()
      assert a.heartbeat() is None
      epoch = a.register("tcp://a").epoch
      assert (epoch.number, epoch.hosts) == (4, (0,)) and epoch.boot != first.boot
      assert b.register("tcp://b").epoch.number == 5  # under its old id, 1
      thread.join(5)
      assert joined[0].host == 2 and joined[0].epoch.number == 6
      assert time.monotonic() - started >= LEASE_S
      assert [line.split(": ", 1)[1] for line in log if ": epoch " in line] == [
          "epoch 4: hosts 0 (host 0 joined)", "epoch 5: hosts 0,1 (host 1 joined)",
          "epoch 6: hosts 0,1,2 (host 2 joined)"]


def test_as_a_process_it_stops_on_sigterm_and_its_loss_is_one_line_on_a_host():
  port = free_port()
  env = dict(os.environ, DILOCO_JOIN_TOKEN="a-join-token-for-the-tests", PYTHONPATH=REPO)
  cmd = [sys.executable, "-m", "diloco_jax.runtime.coordinator", f"--port={port}",
         "--max_hosts=2", f"--lease_s={LEASE_S}"]

  def start() -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)

  proc = start()
  try:
    with clients(port, 1, timeout_s=5.0) as (host,):
      assert host.register("tcp://h").epoch.hosts == (0,)  # waits for it to listen
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(5)
      host.timeout_s = 0.5
      with pytest.raises(CoordinatorLost) as lost:
        host.heartbeat()
      assert str(lost.value).count("\n") == 0 and f"127.0.0.1:{port}" in str(lost.value)
      proc = start()
      host.timeout_s = 5.0
      assert host.heartbeat() is None
      assert host.register("tcp://h").epoch.number == 2
      os.kill(proc.pid, signal.SIGTERM)
      assert proc.wait(5) == 0
      assert proc.stderr.read().splitlines()[-1] == "coordinator: stopped"
  finally:
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(5)
