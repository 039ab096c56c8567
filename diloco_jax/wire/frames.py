"""The wire's frames: a fixed header, a payload, and (with a join token) a MAC.

One zmq message = [header, payload] or, with a key, [header, payload, mac]. A buffer larger
than one chunk travels as several messages, each sealed on its own, so a receiver checks
(and a sum consumes) each as it arrives, and no frame exceeds `MAX_CHUNK` (receivers refuse
larger ones before reading them).

The header (`HEADER`, network byte order) says: the magic and version, the message kind
(scatter, gather, all-to-all, point-to-point), the epoch, the sender and receiver host ids,
the sender's sequence number on this (sender, receiver) pair, the message's total bytes and
this chunk's offset in it. The MAC is HMAC-SHA256 under the epoch's key (`epoch.epoch_key`)
over header + payload: epoch, sender, receiver and sequence number are all covered.

A receiver (`check`) drops a frame, and says why in one line, when it is malformed, names
another epoch or another receiver, comes from a host that is not a member, fails its MAC,
or carries a sequence number this pair has already used (a replay) or skipped. Sequence
numbers start at 0 on every pair in every epoch; the key changes with the epoch, so a frame
of an earlier epoch fails its MAC even where its number would fit.

HELLO frames (`peers.Peers`' start of an epoch) carry no sequence number: a member resends
one until the peer says it heard it, so duplicates are expected and harmless (each says only
"I am in this epoch; I have / have not heard you").
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

from diloco_jax import errors

MAGIC, VERSION = b"DJWF", 1
HEADER = struct.Struct("!4sBB2xQIIQQQ")  # magic, version, kind, epoch, sender, receiver,
#                                          seq, total bytes, offset
MAC_BYTES = hashlib.sha256().digest_size
MAX_CHUNK = 4 << 20  # bytes of payload in one frame, at most
SCATTER, GATHER, ALL_TO_ALL, POINT, HELLO = 1, 2, 3, 4, 5
KINDS = {SCATTER: "sum (reduce-scatter)", GATHER: "all-gather", ALL_TO_ALL: "all-to-all",
         POINT: "point-to-point", HELLO: "hello"}


@dataclasses.dataclass(frozen=True)
class Header:
  kind: int
  epoch: int
  sender: int
  receiver: int
  seq: int
  total: int
  offset: int

  def pack(self) -> bytes:
    return HEADER.pack(MAGIC, VERSION, self.kind, self.epoch, self.sender, self.receiver,
                       self.seq, self.total, self.offset)


class Dropped(errors.DilocoError):
  """A frame that is not accepted; str(e) says why, in words for the one log line."""
  prefix = "Dropped"

  def __init__(self, why: str, sender: int | None = None):
    super().__init__(why)
    self.sender = sender


def mac(key: bytes, header: bytes, payload) -> bytes:
  h = hmac.new(key, header, "sha256")
  h.update(payload)  # a memoryview of a large buffer: hashed without a copy
  return h.digest()


def seal(header: Header, payload, key: bytes | None) -> list:
  """The frames of one message: [header, payload] or [header, payload, mac]."""
  packed = header.pack()
  return [packed, payload] if key is None else [packed, payload, mac(key, packed, payload)]


def check(parts: list, *, key: bytes | None, epoch: int, me: int, members: set[int],
          expected_seq: dict[int, int]) -> tuple[Header, memoryview]:
  """The header and payload of a received message (`parts`: its frames' buffers), or
  Dropped naming why. Advances `expected_seq[sender]` on success."""
  raw = bytes(parts[0])
  if len(raw) != HEADER.size:
    raise Dropped(f"a header of {len(raw)} bytes, not {HEADER.size}")
  magic, version, *fields = HEADER.unpack(raw)
  if magic != MAGIC or version != VERSION:
    raise Dropped(f"not a diloco_jax wire v{VERSION} frame")
  h = Header(*fields)
  if len(parts) != (2 if key is None else 3):
    raise Dropped(f"{len(parts)} frames where a message has {2 if key is None else 3}"
                  + (" (no MAC: the sender has no join token?)" if key is not None
                     and len(parts) == 2 else ""), h.sender)
  payload = memoryview(parts[1])
  if h.epoch != epoch:
    raise Dropped(f"it belongs to epoch {h.epoch}, not {epoch}", h.sender)
  if h.receiver != me:
    raise Dropped(f"addressed to host {h.receiver}, not this host ({me})", h.sender)
  if h.sender not in members or h.sender == me:
    raise Dropped(f"host {h.sender} is not a peer in epoch {epoch}", h.sender)
  if h.kind not in KINDS or h.offset + payload.nbytes > h.total:
    raise Dropped(f"a malformed header (kind {h.kind}, {payload.nbytes} bytes at offset "
                  f"{h.offset} of {h.total})", h.sender)
  if key is not None and not hmac.compare_digest(mac(key, raw, payload), bytes(parts[2])):
    raise Dropped("bad MAC (another join token, or altered)", h.sender)
  if h.kind == HELLO:  # outside the sequence: resent until answered, idempotent
    return h, payload
  want = expected_seq.get(h.sender, 0)
  if h.seq < want:
    raise Dropped(f"a replay: sequence number {h.seq} was already used (next is {want})",
                  h.sender)
  if h.seq > want:
    raise Dropped(f"sequence number {h.seq} skips ahead of {want}", h.sender)
  expected_seq[h.sender] = want + 1
  return h, payload
