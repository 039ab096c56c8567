"""The outer state is the same on every host: a hash of it compared every N rounds.

After every outer step the replicated outer state (the anchor, the outer momentum, ...)
must be bit-identical on every host. A host whose memory flipped a bit, whose software
differs in a way the start-up check missed, or whose sum was tampered with drifts away
silently and drags the job's model with it. Every `anchor_check_every` rounds (and after
the last) each host hashes that state (sha256 of its bytes, `state.fingerprint`) and
publishes the hash in the coordination service's key-value store: gRPC to host 0, not a
collective, so it never queues behind a cross-host sum in flight on the dispatch thread.
The hashes are read one round later, when every host has long published its own (in sync
mode the next round's sum cannot finish before), so no host waits for a slower one; the
last round's are read at once. Every host reads every hash and stops at the same round if
any differ, naming the round and the hosts whose hash is not the majority's.
"""

from __future__ import annotations

import collections
import time
from typing import Any
from typing import Callable
from typing import Protocol

import numpy as np

from diloco_jax import errors
from diloco_jax.algo import state as state_lib

_KEY = "diloco_jax/anchor/"


class HashExchange(Protocol):
  """How the hosts share their hashes: `publish` this host's hash of round r, `collect`
  every host's hash of round r (host -> hash). `deferred`: `collect` may run rounds after
  `publish` (the key-value store); otherwise right after it, on every host at once (a
  collective)."""
  deferred: bool

  def publish(self, digest: str, round_: int) -> None: ...

  def collect(self, round_: int) -> dict[int, str]: ...


class AnchorMismatchError(errors.DilocoError, RuntimeError):
  """The outer state differs between hosts after an outer step."""


def odd_hosts(hashes: dict[int, str]) -> list[int]:
  """Hosts whose hash is not the one most hosts hold; all of them if no hash has a
  strict majority (two hosts that differ: there is no telling which one is wrong)."""
  common, n = collections.Counter(hashes.values()).most_common(1)[0]
  if n * 2 <= len(hashes):
    return sorted(hashes)
  return sorted(h for h, x in hashes.items() if x != common)


def mismatch_message(round_: int, hashes: dict[int, str]) -> str:
  odd = odd_hosts(hashes)
  listed = ", ".join(f"host {h}: {x[:16]}" for h, x in sorted(hashes.items()))
  if len(odd) == len(hashes):
    who = "the hosts disagree with no majority"
  else:
    who = (f"host{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
           f"diverged from the others")
  return (f"round {round_}: the outer state differs between hosts: {who} ({listed}). "
          "Its memory, software or network corrupted the state. The newest checkpoint's "
          "shared state is host 0's: a restart resumes every host from it.")


class StoreExchange:
  """Through the coordination service's key-value store (`client`): each host writes its
  own key and reads everyone's, and removes its key of three checks ago (every host has
  read that one: a host does not get more than a round ahead of another)."""
  deferred = True

  def __init__(self, client, host: int, num_hosts: int, timeout_s: int = 3600):
    self.client, self.host, self.num_hosts, self.timeout_s = client, host, num_hosts, timeout_s
    self._published: collections.deque[str] = collections.deque()

  def publish(self, digest: str, round_: int) -> None:
    key = f"{_KEY}{round_}/{self.host}"
    self.client.key_value_set(key, digest, allow_overwrite=True)
    self._published.append(key)
    while len(self._published) > 3:
      try:
        self.client.key_value_delete(self._published.popleft())
      except Exception:  # noqa: BLE001 -- a leftover key costs a few bytes
        pass

  def collect(self, round_: int) -> dict[int, str]:
    hashes = {}
    for h in range(self.num_hosts):
      try:
        hashes[h] = self.client.blocking_key_value_get(f"{_KEY}{round_}/{h}",
                                                       self.timeout_s * 1000)
      except Exception as e:  # noqa: BLE001 -- the store's timeout or a lost service
        raise AnchorMismatchError(f"round {round_}: host {h} did not publish its hash of "
                                  f"the outer state within {self.timeout_s}s: {e}") from None
    return hashes


class CollectiveExchange:
  """With a collective (`allgather`: [live hosts, *x.shape]), for a job that outlives a
  host, where the store cannot tell which hosts are still in the job: each row is a
  host's id and its hash's words."""
  deferred = False

  def __init__(self, allgather: Callable[[np.ndarray], np.ndarray], host: int):
    self.allgather, self.host, self._digest = allgather, host, None

  def publish(self, digest: str, round_: int) -> None:
    self._digest = digest

  def collect(self, round_: int) -> dict[int, str]:
    words = np.frombuffer(bytes.fromhex(self._digest), np.uint32)
    rows = self.allgather(np.concatenate([np.array([self.host], np.uint32), words]))
    return {int(row[0]): np.asarray(row[1:], np.uint32).tobytes().hex() for row in rows}


class AnchorCheck:
  """Called after every round's outer step: hashes the outer state when due (every
  `every` rounds, 0: never; after the last round; every round with `debug_checks`), and
  compares the hashes of the round before, or of this one when it is the last or the
  exchange cannot wait (module docstring)."""

  def __init__(self, exchange: HashExchange | None, every: int, last_round: int,
               always: bool):
    self.exchange, self.every, self.last_round, self.always = exchange, every, last_round, always
    self._unread: int | None = None  # a round whose hashes are published, not yet compared

  def due(self, r: int) -> bool:
    return self.always or (self.every > 0 and (r % self.every == 0 or r == self.last_round))

  def __call__(self, tree: Any, r: int) -> dict[str, Any]:
    """Round r's record figures (none when nothing was due): the hash of `tree` (16
    hex), the seconds spent hashing, and in all (publishing, and comparing what was due).
    Raises AnchorMismatchError if any host's hash of a compared round differs. One host
    (exchange None): the hash alone."""
    t = time.perf_counter()
    compared = self._unread is not None
    if compared:
      self._compare(self._unread)
    figures = {}
    if self.due(r):
      digest = state_lib.fingerprint(tree)
      figures = {"anchor_hash": digest[:16], "anchor_hash_time": time.perf_counter() - t}
      if self.exchange is not None:
        self.exchange.publish(digest, r)
        self._unread = r
        if not self.exchange.deferred or r >= self.last_round:
          self._compare(r)
    if figures or compared:
      figures["anchor_check_time"] = time.perf_counter() - t
    return figures

  def _compare(self, r: int) -> None:
    self._unread = None
    hashes = self.exchange.collect(r)
    if len(set(hashes.values())) > 1:
      raise AnchorMismatchError(mismatch_message(r, hashes))
