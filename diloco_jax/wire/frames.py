"""The wire's frames: a fixed header, a payload, and (with a join token) a MAC.

One zmq message = [header, payload] or, with a key, [header, payload, mac]. A buffer larger
than one chunk travels as several messages, each sealed on its own, so a receiver checks
(and a sum consumes) each as it arrives, and no frame exceeds `MAX_CHUNK` (receivers refuse
larger ones before reading them).

The header (`HEADER`, network byte order) says: the magic and version, the message kind
(scatter, gather, all-to-all, point-to-point), the epoch, the sender and receiver host ids,
the sender's sequence number on this (sender, receiver) pair, the message's total bytes and
this chunk's offset in it. Version 2's MAC (`mac`) is UMAC's construction with HMAC-SHA256
as its last step: HMAC-SHA256(k_mac, header || payload length || NH*(payload)), where NH* is
the NH hash of UMAC (Black et al., "UMAC: fast and secure message authentication", 1999; RFC
4418's L1 hash) under a secret key k_nh: for each 1024-byte block of the payload
(zero-padded), two passes of Σ_i ((m_2i + k_2i) mod 2^32)(m_2i+1 + k_2i+1) mod 2^64 over
its little-endian 32-bit words m, the second pass with the key shifted by two words
(UMAC's Toeplitz iteration). Both keys come from the epoch's key (`epoch.epoch_key`, so
from the join token, the epoch number and the epoch's nonce) by HMAC-SHA256. Why it is a MAC: NH* is
2^-64-almost-universal on equal-length inputs (two 2^-32 passes), so an attacker who does
not know k_nh finds another payload with the same NH* with probability at most 2^-64 per
try; the length and the whole header (epoch, sender, receiver, sequence number, offset) go
into HMAC-SHA256, a PRF, whose tags say nothing about k_nh; any other forgery is a new PRF
input, whose tag cannot be predicted. Why not HMAC-SHA256 over the payload itself (version
1): SHA-256 runs at about 2 GB/s on one core even with SHA-NI, and every byte is hashed by
its sender and its receiver, which made the keyed sum slower than gloo's; NH* is a few
vector passes in numpy (about twice SHA-256's speed on one core, GIL released: bench/wire.py
measures both), and the HMAC then hashes 16 bytes per KiB.

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
import functools
import hashlib
import hmac
import struct
import threading

import numpy as np

from diloco_jax import errors

MAGIC, VERSION = b"DJWF", 2  # 2: the MAC of header + NH*(payload) (module docstring)
HEADER = struct.Struct("!4sBB2xQIIQQQ")  # magic, version, kind, epoch, sender, receiver,
#                                          seq, total bytes, offset
MAC_BYTES = hashlib.sha256().digest_size
MAX_CHUNK = 4 << 20  # bytes of payload in one frame, at most
NH_BLOCK = 1024  # bytes of payload per NH block: 256 32-bit words
NH_SHIFT = 2  # words between the key of NH*'s first pass and its second's
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
  """A frame that is not accepted; str(e) says why, in words for the one log line.
  `header`: the frame's, when it names another epoch."""
  prefix = "Dropped"

  def __init__(self, why: str, sender: int | None = None, header: Header | None = None):
    super().__init__(why)
    self.sender, self.header = sender, header


NH_ROWS = 1024  # blocks per numpy pass: each thread's scratch is 3 MiB
_scratch = threading.local()


@functools.lru_cache(maxsize=16)
def _subkeys(key: bytes) -> tuple[np.ndarray, bytes]:
  """k_nh and k_mac of an epoch's key, each an HMAC-SHA256 expansion. k_nh comes as each
  pass's 256 words, repeated for NH_ROWS blocks (flat adds are faster than broadcast)."""
  words = NH_BLOCK // 4 + NH_SHIFT
  stream = b"".join(hmac.digest(key, f"wire v{VERSION}|nh|{i}".encode(), "sha256")
                    for i in range(-(-4 * words // 32)))
  k_nh = np.frombuffer(stream[:4 * words], "<u4").astype(np.uint32)
  passes = np.stack([np.tile(k_nh[NH_SHIFT * i:][:NH_BLOCK // 4], (NH_ROWS, 1))
                     for i in range(2)])
  return passes, hmac.digest(key, f"wire v{VERSION}|mac".encode(), "sha256")


def nh(passes: np.ndarray, payload) -> bytes:
  """NH*(payload) (module docstring): 16 bytes per 1024-byte block, little-endian."""
  data = np.frombuffer(payload, np.uint8)
  full = data.size // NH_BLOCK
  sums = np.empty((-(-data.size // NH_BLOCK), 2), "<u8")
  words = data[:full * NH_BLOCK].view("<u4").reshape(full, NH_BLOCK // 4)
  for start in range(0, full, NH_ROWS):
    _nh_rows(passes, words[start:start + NH_ROWS], sums[start:full][:NH_ROWS])
  if full < len(sums):  # the last block, zero-padded (the length is MACed too)
    last = np.zeros(NH_BLOCK, np.uint8)
    last[:data.size - full * NH_BLOCK] = data[full * NH_BLOCK:]
    _nh_rows(passes, last.view("<u4").reshape(1, NH_BLOCK // 4), sums[full:])
  return sums.tobytes()


def _nh_rows(passes: np.ndarray, m: np.ndarray, sums: np.ndarray) -> None:
  """Both passes of NH over the blocks `m` (at most NH_ROWS rows of 256 words)."""
  if not hasattr(_scratch, "words"):  # preallocated: fresh temporaries cost page faults
    _scratch.words = np.empty((NH_ROWS, NH_BLOCK // 4), np.uint32)
    _scratch.lo = np.empty((NH_ROWS, NH_BLOCK // 8), np.uint64)
    _scratch.hi = np.empty((NH_ROWS, NH_BLOCK // 8), np.uint64)
  rows = len(m)
  a, lo, hi = _scratch.words[:rows], _scratch.lo[:rows], _scratch.hi[:rows]
  for i in range(2):  # uint32 sums and uint64 products and totals wrap, as NH's do
    np.add(m, passes[i, :rows], out=a)
    v = a.view(np.uint64)  # word 2j in the low half, 2j + 1 in the high half
    np.bitwise_and(v, 0xFFFFFFFF, out=lo)
    np.right_shift(v, 32, out=hi)
    np.einsum("ij,ij->i", lo, hi, out=sums[:, i])  # Σ lo·hi per block, one pass


def mac(key: bytes, header: bytes, payload) -> bytes:
  passes, k_mac = _subkeys(key)
  digest = nh(passes, payload)  # a memoryview of a large buffer: read without a copy
  return hmac.digest(k_mac, header + struct.pack("!Q", memoryview(payload).nbytes) + digest,
                     "sha256")


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
    raise Dropped(f"it belongs to epoch {h.epoch}, not {epoch}", h.sender, h)
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
