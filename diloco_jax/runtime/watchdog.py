"""The link watchdog: a host cut off from the others for longer than `--link_timeout` stops
with one line that says so, before JAX's heartbeat timeout aborts it without one."""

from __future__ import annotations

import os
import sys
import threading
import time

from diloco_jax.runtime import coordination


class LinkWatchdog:
  """Every host stops with "link lost" (exit 1) once it has been cut off from the job for
  `timeout_s`, so that a restart (`launch/local.py --max_restarts`) resumes from the
  newest checkpoint, instead of JAX aborting the hosts one by one up to a heartbeat
  timeout later (`sudo python -m bench.linkdrop` drops a link and shows what happens).

  Each host writes a counter to the coordination service's key-value store every second.
  A host whose own writes have not gone through for `timeout_s` is cut off from the
  service (which runs on host 0); host 0 also stops when another host's counter has not
  moved for `timeout_s` (that host is cut off, or gone). A host leaving normally marks
  itself done at exit. Shorter outages are survived: gRPC's and gloo's connections carry
  on once the link is back (`_keep_coordinator_connections`).
  """

  PERIOD_S = 1.0
  _KEY = "diloco_jax/alive/"

  def __init__(self, timeout_s: int):
    state = coordination.jax_distributed_state()
    self.timeout_s = timeout_s
    self._client, self._me, self._n = state.client, state.process_id, state.num_processes
    self._last_ok = time.monotonic()
    self._seen: dict[str, tuple[str, float]] = {}  # host -> (counter, when it changed)
    self._stopped = threading.Event()

  def start(self) -> None:
    import atexit
    # Registered after JAX's own shutdown hook, so it runs first (LIFO): no false alarm
    # while a host waits for the others at JAX's shutdown barrier.
    atexit.register(self.stop)
    threading.Thread(target=self._beat, name="diloco-link-beat", daemon=True).start()
    threading.Thread(target=self._watch, name="diloco-link-watch", daemon=True).start()

  def stop(self) -> None:
    if not self._stopped.is_set():
      self._stopped.set()
      try:
        self._client.key_value_set(f"{self._KEY}{self._me}", "done", allow_overwrite=True)
      except Exception:  # noqa: BLE001 -- leaving anyway
        pass

  def _beat(self) -> None:
    count = 0
    while not self._stopped.is_set():
      count += 1
      try:
        self._client.key_value_set(f"{self._KEY}{self._me}", str(count), allow_overwrite=True)
        if self._me == 0:
          now = time.monotonic()
          for key, value in self._client.key_value_dir_get(self._KEY):
            host = key.rsplit("/", 1)[1]
            if self._seen.get(host, (None,))[0] != value:
              self._seen[host] = (value, now)
        self._last_ok = time.monotonic()
      except Exception:  # noqa: BLE001 -- unreachable: the watch thread decides
        pass
      self._stopped.wait(self.PERIOD_S)

  def _watch(self) -> None:
    start = time.monotonic()
    while not self._stopped.wait(self.PERIOD_S):
      now = time.monotonic()
      if now - self._last_ok > self.timeout_s:
        self._lost(f"this host has not reached the coordination service (host 0) for "
                   f"{now - self._last_ok:.0f}s")
      if self._me == 0:
        for h in range(1, self._n):
          value, since = self._seen.get(str(h), (None, start))
          if value != "done" and now - since > self.timeout_s:
            self._lost(f"no word from host {h} for {now - since:.0f}s (its link is down, "
                       "or it stopped)")

  def _lost(self, why: str) -> None:
    if self._stopped.is_set():
      return
    sys.stderr.write(f"host {self._me}: link lost: {why} (--link_timeout={self.timeout_s}s). "
                     "Stopping this host; a restart resumes from the newest checkpoint.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)
