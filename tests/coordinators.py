"""The membership coordinator for the tests: one in a thread with clients over its sockets, and
hosts that speak to a Ledger directly at fake times (tests/test_coordinator.py,
test_ledger.py, test_admission.py)."""

from __future__ import annotations

import contextlib
import threading

from bench.harness import free_port  # noqa: F401 -- the tests import it from here
from diloco_jax.membership import coordinator as co
from diloco_jax.membership.client import Client
from diloco_jax.runtime import security


TOKEN = security.JoinToken("a-join-token-for-the-tests", "the test")
LEASE_S = 0.4


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


class Hosts:
  """Hosts that speak to a Ledger directly, at fake times: each request carries its host's
  next counter."""

  def __init__(self, ledger: co.Ledger):
    self.ledger, self.incarnation, self.seq = ledger, {}, {}

  def register(self, host: int, now: float = 0.0) -> dict:
    challenge = self.ledger.handle({"op": "hello", "nonce": "n"}, now)["challenge"]
    answer = self.ledger.handle({"op": "register", "challenge": challenge, "host": host,
                                 "address": f"h{host}:1", "last_epoch": 0}, now)
    self.incarnation[host], self.seq[host] = answer["incarnation"], 0
    return answer

  def join(self, host: int, now: float = 0.0) -> dict:
    return self.register(host, now)["epoch"]

  def frame(self, host: int, op: str, **fields) -> dict:
    self.seq[host] += 1
    return {"op": op, "host": host, "incarnation": self.incarnation[host],
            "seq": self.seq[host], **fields}

  def heartbeat(self, host: int, now: float) -> dict:
    return self.ledger.handle(self.frame(host, "heartbeat"), now)

  def leave(self, host: int, now: float) -> dict:
    return self.ledger.handle(self.frame(host, "leave"), now)

  def vote(self, host: int, epoch: int, step: int, now: float, ok: bool = True,
           suspect: int | None = None, boundary: bool = False) -> dict:
    return self.ledger.handle(self.frame(host, "commit", epoch=epoch, step=step, ok=ok,
                                         suspect=suspect, boundary=boundary), now)


def ledger_of(n: int, accuse_s: float | None = None) -> tuple[co.Ledger, Hosts, list[str], int]:
  """A Ledger with hosts 0..n-1 registered at time 0 (lease 10 s); its log, the epoch."""
  log = []
  ledger = co.Ledger(max_hosts=4, lease_s=10.0, log=log.append, accuse_s=accuse_s)
  hosts = Hosts(ledger)
  for h in range(n):
    epoch = hosts.join(h)
  return ledger, hosts, log, epoch["number"]


def verdict(answer: dict) -> tuple[bool, int, tuple[int, ...]]:
  assert answer["op"] == "verdict", answer
  after = co.Epoch.from_json(answer["next"])
  return answer["commit"], after.number, after.hosts
