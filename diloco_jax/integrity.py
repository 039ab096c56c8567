"""The outer state is the same on every host: a hash of it compared every N rounds.

After every outer step the replicated outer state (the anchor, the outer momentum, ...)
must be bit-identical on every host. A host whose memory flipped a bit, whose software
differs in a way the start-up check missed, or whose sum was tampered with drifts away
silently and drags the job's model with it. Every `anchor_check_every` rounds (and after
the last) each host hashes that state (sha256 of its bytes, `state.fingerprint`) and
publishes the hash in the coordination service's key-value store: gRPC to host 0, not a
collective, so it never queues behind a cross-host sum in flight on the dispatch thread.
Every host reads every hash and stops at the same round if any differ, naming the hosts
whose hash is not the majority's.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import numpy as np

from diloco_jax import state as state_lib

_KEY = "diloco_jax/anchor/"
Gather = Callable[[str, int], dict[int, str]]  # (this host's hash, round) -> host: hash


class AnchorMismatchError(RuntimeError):
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


def store_gather(client, host: int, num_hosts: int, timeout_s: int = 3600) -> Gather:
  """Gathers through the coordination service's key-value store (`client`): each host
  writes its own key, reads everyone's, and removes its key of two checks ago (every
  host has read that one: they are at most one round apart)."""
  published: collections.deque[str] = collections.deque()

  def gather(digest: str, round_: int) -> dict[int, str]:
    key = f"{_KEY}{round_}/"
    client.key_value_set(f"{key}{host}", digest, allow_overwrite=True)
    published.append(f"{key}{host}")
    hashes = {}
    for h in range(num_hosts):
      try:
        hashes[h] = client.blocking_key_value_get(f"{key}{h}", timeout_s * 1000)
      except Exception as e:  # noqa: BLE001 -- the store's timeout or a lost service
        raise AnchorMismatchError(f"round {round_}: host {h} did not publish its hash of "
                                  f"the outer state within {timeout_s}s: {e}") from None
    while len(published) > 2:
      try:
        client.key_value_delete(published.popleft())
      except Exception:  # noqa: BLE001 -- a leftover key costs a few bytes
        pass
    return hashes
  return gather


def collective_gather(allgather: Callable[[np.ndarray], np.ndarray], host: int) -> Gather:
  """Gathers with a collective (`allgather`: [live hosts, *x.shape]), for elastic mode,
  where the store cannot tell which hosts are still in the job: each row is a host's id
  and its hash's words."""
  def gather(digest: str, round_: int) -> dict[int, str]:
    del round_
    words = np.frombuffer(bytes.fromhex(digest), np.uint32)
    rows = allgather(np.concatenate([np.array([host], np.uint32), words]))
    return {int(row[0]): np.asarray(row[1:], np.uint32).tobytes().hex() for row in rows}
  return gather


class AnchorCheck:
  """Whether round r is checked, and the check: `every` rounds (0: never), after the
  last round, and after every round with `debug_checks`."""

  def __init__(self, gather: Gather | None, every: int, last_round: int, always: bool):
    self.gather, self.every, self.last_round, self.always = gather, every, last_round, always

  def due(self, r: int) -> bool:
    return self.always or (self.every > 0 and (r % self.every == 0 or r == self.last_round))

  def __call__(self, tree: Any, r: int) -> dict[str, Any]:
    """Round r's record figures: the hash of `tree` (16 hex), the seconds spent hashing,
    and in all (with the wait for the other hosts' hashes). Raises AnchorMismatchError if
    any host's hash differs. One host (gather None): the hash alone."""
    t = time.perf_counter()
    digest = state_lib.fingerprint(tree)
    hashed = time.perf_counter() - t
    if self.gather is not None:
      hashes = self.gather(digest, r)
      if len(set(hashes.values())) > 1:
        raise AnchorMismatchError(mismatch_message(r, hashes))
    return {"anchor_hash": digest[:16], "anchor_hash_time": hashed,
            "anchor_check_time": time.perf_counter() - t}
