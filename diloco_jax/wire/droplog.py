"""Lines about input this process dropped, bounded whatever a sender does.

Anyone who reaches a port can make a process drop frames, as fast as the network allows and
under any claimed host id. A line per frame, or a set of every (sender, reason) seen, would
let such a sender fill the log or the memory. `DropLog` says the first drop of each
(peer address, reason) in one line, counts the rest, and says the count once a minute; it
remembers at most `MAX_KEYS` pairs (the oldest forgotten first), and beyond that many in one
minute it folds every new pair into one line per minute. The peer address is the one the
connection came from (never an id the frame claims), without its port: a sender that opens
a connection per frame is still one sender.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable

MAX_KEYS = 256  # (address, reason) pairs remembered
EVERY_S = 60.0  # how often a pair's suppressed count is said


def host_of(address: str | None) -> str:
  """'10.0.0.1:51234' -> '10.0.0.1' (a new connection's port says nothing about who)."""
  if not address:
    return "an unknown address"
  host, sep, port = address.rpartition(":")
  return host if sep and port.isdigit() else address


class DropLog:
  """One line per (address, reason) per `EVERY_S`, with the count of those it held back."""

  def __init__(self, log: Callable[[str], None], where: str,
               clock: Callable[[], float] = time.monotonic):
    self._log, self._where, self._clock = log, where, clock
    self._seen: collections.OrderedDict[tuple[str, str], list] = collections.OrderedDict()
    self._overflow, self._overflow_said = 0, -EVERY_S
    self.dropped = 0  # every drop, said or not

  def __call__(self, address: str | None, why: str, claim: str = "") -> None:
    """A frame from `address` dropped for `why`; `claim` (e.g. " (claims host 2)") is said
    in its line, but never tells senders apart: anyone can claim anything."""
    self.dropped += 1
    now, who = self._clock(), host_of(address)
    # numbers (sequence numbers, sizes, ids) vary frame to frame: one reason is one shape
    key = (who, re.sub(r"\d+", "#", why)[:120])
    seen = self._seen.get(key)
    if seen is not None:
      seen[1] += 1
      self._seen.move_to_end(key)
      if now - seen[0] >= EVERY_S:
        self._log(f"{self._where}: dropped {seen[1]} more frame(s) from {who}{claim} in "
                  f"{now - seen[0]:.0f} s: {why}")
        seen[0], seen[1] = now, 0
      return
    churning = False
    if len(self._seen) >= MAX_KEYS:  # forget the pair heard from least recently
      churning = now - self._seen.popitem(last=False)[1][0] < EVERY_S
    self._seen[key] = [now, 0]
    if not churning:
      self._log(f"{self._where}: dropped a frame from {who}{claim}: {why}")
      return
    # more than MAX_KEYS pairs within a minute: their first lines too become one a minute
    self._overflow += 1
    if now - self._overflow_said >= EVERY_S:
      self._log(f"{self._where}: dropped frames from {self._overflow} more sender(s) or "
                f"reason(s) (the last from {who}: {why})")
      self._overflow, self._overflow_said = 0, now
