"""Experimental elasticity (config.elastic, sync mode): the job outlives a dead host.

What JAX allows on CPU (checked with jax 0.10.2; see docs/fault-tolerance.md):
- With `jax_enable_recoverability`, the survivors of a dead non-coordinator host keep
  running; the coordination service drops the dead host after the heartbeat timeout, and
  a new mesh over the survivors' devices carries their sums.
- A restarted host reconnects to the coordination service but cannot join the survivors'
  collectives (gloo keys its connections by device list, with no generation). So a
  returning host only announces itself; at the next round boundary the survivors write a
  checkpoint and every host exits with EXIT_RESTART; the launcher starts the whole world
  again, which resumes from that checkpoint with the returning host's replicas restarted
  from the anchor.

`wire.live.LiveCollective` is the cross-host sum for this mode: the live hosts meet at a
coordination-service barrier before each collective, and after a failure agree on the
new set of live hosts and do it again. (`multihost_utils.live_devices` would count a
returning host as live and wait for it.) The job still dies with host 0 (the coordinator).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from diloco_jax.runtime import coordination

EXIT_RESTART = 75  # every host exits with this to ask the launcher for a restart
_RUNNING = "diloco/elastic/running"
_REJOIN = "diloco/elastic/rejoin/"
_RESTART = "diloco/elastic/restart"
_LEFT = "diloco/elastic/left/"


def _client():
  return coordination.coordination_client()


def enable(collective_timeout_s: int) -> None:
  """Before jax.distributed starts: survivors outlive a dead host, and a sum waiting on a
  dead peer times out instead of hanging."""
  jax.config.update("jax_enable_recoverability", True)
  flag = f"--xla_cpu_collective_timeout_seconds={collective_timeout_s}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def mark_running() -> None:
  """Host 0, once training starts: a host that connects later is a returning one."""
  _client().key_value_set(_RUNNING, "1")


def is_returning() -> bool:
  try:
    return _client().key_value_try_get(_RUNNING) == "1"
  except Exception:  # noqa: BLE001 -- not found
    return False


def return_and_wait(timeout_s: int = 24 * 3600) -> None:
  """A returning host: asks to join and waits for the survivors' restart signal."""
  host = jax.process_index()
  print(f"host {host}: the job is running without this host; asking to rejoin. The "
        f"hosts will checkpoint at the next round boundary and restart together.",
        flush=True)
  _client().key_value_set(f"{_REJOIN}{host}", "1")
  # The survivors ask the coordination service who is alive before every collective, a
  # call that waits for every alive host, this one included: keep answering it.
  threading.Thread(target=_answer_liveness_checks, daemon=True).start()
  _client().blocking_key_value_get(_RESTART, timeout_s * 1000)


def _answer_liveness_checks() -> None:
  hosts = list(range(jax.process_count()))
  while True:
    try:
      _client().get_live_nodes(hosts)
    except Exception:  # noqa: BLE001 -- the job is restarting
      time.sleep(0.1)


def rejoin_requested() -> list[int]:
  """Host 0: returning hosts waiting to join."""
  return sorted(int(k.rsplit("/", 1)[1]) for k, _ in _client().key_value_dir_get(_REJOIN))


def signal_restart() -> None:
  _client().key_value_set(_RESTART, "1")


def finish() -> None:
  """The end of an elastic run. Under recoverability JAX's shutdown no longer waits for
  everyone, and a host that leaves first can abort the others: the live hosts meet at a
  barrier, then exit (host 0, which runs the coordination service, last)."""
  client, host = _client(), jax.process_index()
  live = sorted(client.get_live_nodes(list(range(jax.process_count()))))
  client.wait_at_barrier("diloco/elastic/end", 600_000, live)
  if host == 0:
    # Every other host says it is leaving before it exits. Not get_live_nodes: once a
    # host has exited, that call blocks until the heartbeat timeout declares it dead
    # (100 s by default, after the run's last line).
    deadline = time.monotonic() + 10
    while (len(client.key_value_dir_get(_LEFT)) < len(live) - 1
           and time.monotonic() < deadline):
      time.sleep(0.05)
  else:
    client.key_value_set(f"{_LEFT}{host}", "1")
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def stop_together() -> None:
  """Before exiting on an error every host stops on: the hosts meet at a barrier of their
  own (up to 30 s: a host that does not stop is not waited for longer), and host 0, whose
  coordination service the others need until then, returns last. JAX's own shutdown
  barrier aborts the process (signal 6) in elastic mode instead."""
  try:
    _client().wait_at_barrier("diloco_jax/stopping", 30_000)
  except Exception:  # noqa: BLE001 -- a host that does not stop, or is gone: exit anyway
    pass
  if jax.process_index() == 0:
    time.sleep(2.0)
