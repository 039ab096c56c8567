"""Pseudo-gradients on the wire: encodings, their exact byte counts and their error bounds.

Every format encodes a flat float32 vector on the host (numpy) and decodes back to
float32; sums of decoded vectors are taken in float32. Formats:

  none  float32, 4 bytes per entry.
  bf16  bfloat16 (round to nearest even), 2 bytes; relative error ≤ 2⁻⁸.
  int8  blocks of BLOCK entries share one float32 scale s = max|x|/127; q = round(x/s)
        in [−127, 127]. 1 byte per entry + 4 per block (0.254× of float32 at 256).
        |x − x̂| ≤ s/2 per block.
  4bit  blockwise int4: s = max|x|/7, q in [−7, 7], two entries per byte. 0.5 byte per
        entry + 4 per block (0.129× of float32). |x − x̂| ≤ s/2. Chosen over E3M0 FP4
        (sign and a 3-bit exponent, the Streaming DiLoCo format): both are 4 bits, but
        E3M0 rounds to powers of two, a relative error of up to 1/3 on every entry
        however the block is scaled, while int4 with an absmax scale has an absolute
        bound tied to the block's largest entry, keeps zeros and multiples of the
        scale exact, and costs one multiply to decode.
  2bit  blockwise, four levels (q + ½)·s for q in {−2, −1, 0, 1} with s = max|x|/1.5,
        four entries per byte: 0.25 byte per entry + 4 per block (0.066× of float32).
        No zero level (±½s is the finest): with the same two bits a zero level would
        leave three levels and a bound of max|x|/2; this one is |x − x̂| ≤ s/2 = max|x|/3,
        and ±max|x| are exact. Meant for use with error feedback, which carries the rest.
  topk  the largest `fraction` of entries by magnitude, as int32 indices + float32
        values (8 bytes each); what is left out is the caller's to carry (error
        feedback, `encode` returns the decoded vector for that).
  chunk_topk  SparseLoCo's: the vector is cut into chunks of `topk_chunk` entries, the
        last one zero-padded; the vector is a fragment's leaves flattened and concatenated
        in tree order, so a chunk can run across tensor boundaries. Every chunk keeps its
        k = chunk_k(fraction, chunk) = max(1, round(fraction x chunk)) largest entries by
        magnitude (Python's `round`: halves go to the even integer), as uint16 offsets in
        the chunk and values of `value_bits` bits: 32 (float32), or a sign bit and b − 1
        bits of magnitude, 2^(b−1) levels at the cell midpoints of [lo, hi] = [min|v|,
        max|v|] over the chunk's kept non-zero values (two float32 per chunk), so
        |v − v̂| ≤ (hi − lo) / 2^b. (A quantizer over [−max, max] would spend its levels
        near zero, where no kept value is.) At 4096 entries, k = 64 and 2 bits: 152 bytes
        per chunk, 0.0093x of float32. Every chunk keeps the same k, so every host's
        message has the same size: the messages are all-gathered whole
        (`collective.reduce_encoded`), since a sum of sparse vectors is not sparse.
        Exact zeros: a chunk with m < k non-zero entries (the zero-padded last chunk, a
        leaf whose Δ is 0) sends its m non-zeros first, by ascending offset, then k − m
        padding slots that repeat the previous slot's offset (offset 0 when m = 0) with
        code 0; a slot whose offset equals the one before it decodes to nothing, so zeros
        arrive as exact zeros, not as ±(lo + w/2), in the same bytes. (When m = 0 the first slot is
        not padding but decodes to 0: lo = hi = 0.) The error feedback that carries what
        is left out is the caller's (exchange.py): for the mean, one accumulator per host
        over the sum of its replicas' Δ, where the SparseLoCo paper keeps one per worker
        (a robust aggregation sends, and so accumulates, one row per replica).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

FORMATS = ("none", "bf16", "int8", "4bit", "2bit", "topk", "chunk_topk")
GATHERED = ("chunk_topk",)  # all-gathered, not reduced chunk by chunk on the way
VALUE_BITS = (2, 4, 32)
BLOCK = 256  # entries per scale (int8, 4bit, 2bit)
_TWO_BIT_MAX = 1.5  # the outermost level, in units of the scale
_QMAX = {"int8": 127, "4bit": 7}


@dataclasses.dataclass
class Encoded:
  """An encoded vector: the arrays that cross the wire, and the decoded length."""
  fmt: str
  size: int
  parts: dict[str, np.ndarray]

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in self.parts.values())


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
  pad = (-x.size) % block
  return np.pad(x, (0, pad)).reshape(-1, block)


def _scaled_blocks(x: np.ndarray, block: int, top: float) -> tuple[np.ndarray, np.ndarray]:
  """x in blocks divided by each block's scale s = max|x| / top, and the scales (a block
  of zeros keeps s = 0 and is divided by 1)."""
  b = _blocks(x, block)
  scale = (np.abs(b).max(axis=1) / np.float32(top)).astype(np.float32)
  return b / np.where(scale > 0, scale, np.float32(1))[:, None], scale


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
  """Codes < 2^bits, 8 / bits per byte, the first in the low bits."""
  per = 8 // bits
  codes = np.pad(codes.ravel().astype(np.uint8), (0, (-codes.size) % per)).reshape(-1, per)
  return np.bitwise_or.reduce(codes << (bits * np.arange(per, dtype=np.uint8)), axis=1)


def _unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
  per = 8 // bits
  shifts = bits * np.arange(per, dtype=np.uint8)
  return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).ravel()[:n]


def _sign_magnitude(values: np.ndarray, bits: int) -> dict[str, np.ndarray]:
  """[chunks, k] -> sign + (bits − 1)-bit magnitude codes over each chunk's [lo, hi].

  [lo, hi] spans the non-zero values only: the zeros are padding slots that the offsets
  mark and the decoder drops, so they must not pull lo down to 0. A chunk with no
  non-zero value sends lo = hi = 0.
  """
  mag = np.abs(values)
  kept = values != 0
  lo = np.where(kept, mag, np.float32(np.inf)).min(axis=1)
  lo = np.where(kept.any(axis=1), lo, np.float32(0))
  hi = np.where(kept, mag, np.float32(0)).max(axis=1)
  levels = 1 << (bits - 1)
  width = (hi - lo) / np.float32(levels)  # 0 when every kept value has one magnitude
  safe = np.where(width > 0, width, np.float32(1))
  j = np.clip(np.floor((mag - lo[:, None]) / safe[:, None]), 0, levels - 1)
  codes = np.where(kept, j + levels * (values < 0), 0).astype(np.uint8)
  return {"q": _pack(codes, bits), "lo": lo.astype(np.float32), "hi": hi.astype(np.float32)}


def _sign_magnitude_decode(p: dict[str, np.ndarray], bits: int, n_chunks: int,
                           k: int) -> np.ndarray:
  levels = 1 << (bits - 1)
  codes = _unpack(p["q"], bits, n_chunks * k).reshape(n_chunks, k)
  lo, hi = p["lo"][:, None], p["hi"][:, None]
  width = (hi - lo) / np.float32(levels)
  mag = lo + ((codes % levels).astype(np.float32) + np.float32(0.5)) * width
  return np.where(codes >= levels, -mag, mag).astype(np.float32)


def chunk_k(topk_fraction: float, topk_chunk: int) -> int:
  """Entries kept per chunk by chunk_topk: max(1, round(fraction x chunk)) with Python's
  `round`, which sends halves to the even integer: 2.5 keeps 2, 0.5 rounds to 0 and keeps 1."""
  return max(1, int(round(topk_fraction * topk_chunk)))


def encode(x: np.ndarray, fmt: str, *, block: int = BLOCK, topk_fraction: float = 0.01,
           topk_chunk: int = 4096, value_bits: int = 2) -> Encoded:
  """Encodes a flat float32 vector."""
  x = np.asarray(x, np.float32).ravel()
  if fmt == "none":
    return Encoded(fmt, x.size, {"values": x.copy()})
  if fmt == "bf16":
    # Sent as its bits: XLA's CPU collectives widen bfloat16 to float32 on the wire
    # (bench/wan.py's veth counter showed float32's bytes), integers cross as they are.
    return Encoded(fmt, x.size, {"bits": x.astype(jnp.bfloat16).view(np.uint16)})
  if fmt in _QMAX:
    qmax = _QMAX[fmt]
    scaled, scale = _scaled_blocks(x, block, qmax)
    q = np.clip(np.rint(scaled), -qmax, qmax).astype(np.int8).ravel()
    if fmt == "4bit":  # two's-complement nibbles, two per byte
      q = _pack(q & 0x0F, 4)
    return Encoded(fmt, x.size, {"q": q, "scale": scale})
  if fmt == "2bit":
    scaled, scale = _scaled_blocks(x, block, _TWO_BIT_MAX)
    codes = np.clip(np.floor(scaled), -2, 1) + 2  # the levels' index, 0..3
    return Encoded(fmt, x.size, {"q": _pack(codes, 2), "scale": scale})
  if fmt == "topk":
    if not 0 < topk_fraction <= 1:
      raise ValueError(f"topk fraction {topk_fraction}: must be in (0, 1]")
    k = max(1, int(round(topk_fraction * x.size)))
    idx = np.argpartition(np.abs(x), x.size - k)[x.size - k:]
    idx = np.sort(idx).astype(np.int32)
    return Encoded(fmt, x.size, {"indices": idx, "values": x[idx]})
  if fmt == "chunk_topk":
    k = chunk_k(topk_fraction, topk_chunk)
    chunks = _blocks(x, topk_chunk)
    idx = np.argpartition(-np.abs(chunks), k - 1, axis=1)[:, :k]
    values = np.take_along_axis(chunks, idx, axis=1)
    # Non-zeros by ascending offset, then the zeros as padding slots that repeat the
    # previous offset (the module docstring's encoding): a kept zero must decode to 0.
    idx = np.where(values != 0, idx, topk_chunk)
    order = np.argsort(idx, axis=1, kind="stable")
    idx, values = np.take_along_axis(idx, order, axis=1), np.take_along_axis(values, order, 1)
    nonzero = (idx < topk_chunk).sum(axis=1)
    last = np.take_along_axis(idx, np.maximum(nonzero - 1, 0)[:, None], axis=1)
    idx = np.where(idx < topk_chunk, idx, np.where(nonzero[:, None] > 0, last, 0))
    parts = ({"values": values.ravel()} if value_bits == 32
             else _sign_magnitude(values, value_bits))
    return Encoded(fmt, x.size, {"indices": idx.astype(np.uint16).ravel(), **parts})
  raise ValueError(f"unknown compression format {fmt!r}; one of {FORMATS}")


def decode(enc: Encoded, *, block: int = BLOCK, topk_fraction: float = 0.01,
           topk_chunk: int = 4096, value_bits: int = 2) -> np.ndarray:
  """The float32 vector `enc` stands for (with the options it was encoded with)."""
  p = enc.parts
  if enc.fmt == "chunk_topk":
    k = chunk_k(topk_fraction, topk_chunk)
    n_chunks = p["indices"].size // k
    values = (p["values"] if value_bits == 32
              else _sign_magnitude_decode(p, value_bits, n_chunks, k))
    idx = p["indices"].reshape(n_chunks, k).astype(np.int64)
    # A slot repeating the offset before it is padding (a zero): it goes to a spare
    # column that is cut off, so it cannot overwrite the real value at that offset.
    pad = np.zeros_like(idx, bool)
    pad[:, 1:] = idx[:, 1:] == idx[:, :-1]
    out = np.zeros((n_chunks, topk_chunk + 1), np.float32)
    np.put_along_axis(out, np.where(pad, topk_chunk, idx), values.reshape(n_chunks, k), axis=1)
    return out[:, :topk_chunk].ravel()[:enc.size]
  if enc.fmt == "none":
    return p["values"].astype(np.float32)
  if enc.fmt == "bf16":
    return p["bits"].view(jnp.bfloat16).astype(np.float32)
  if enc.fmt in _QMAX:
    q = p["q"]
    if enc.fmt == "4bit":
      nib = _unpack(q, 4, 2 * q.size).astype(np.int8)
      q = np.where(nib > 7, nib - 16, nib).astype(np.int8)
    n_blocks = p["scale"].size
    q = q[:n_blocks * block].reshape(n_blocks, block).astype(np.float32)
    return (q * p["scale"][:, None]).ravel()[:enc.size]
  if enc.fmt == "2bit":
    n_blocks = p["scale"].size
    levels = _unpack(p["q"], 2, n_blocks * block).reshape(n_blocks, block).astype(np.float32)
    return ((levels - np.float32(1.5)) * p["scale"][:, None]).ravel()[:enc.size]
  if enc.fmt == "topk":
    out = np.zeros(enc.size, np.float32)
    out[p["indices"]] = p["values"]
    return out
  raise ValueError(f"unknown compression format {enc.fmt!r}")


def error_bound(x: np.ndarray, fmt: str, *, block: int = BLOCK) -> np.ndarray:
  """Per-entry bound on |x − decode(encode(x))| (topk: none, it drops entries)."""
  x = np.asarray(x, np.float32).ravel()
  if fmt == "none":
    return np.zeros_like(x)
  if fmt == "bf16":
    return np.abs(x) * np.float32(2.0 ** -8)
  if fmt in _QMAX or fmt == "2bit":  # half a level's step: max|x| / (2 top)
    b = _blocks(x, block)
    half_step = np.abs(b).max(axis=1) / np.float32(2 * _QMAX.get(fmt, _TWO_BIT_MAX))
    return np.repeat(half_step, block)[:x.size] * np.float32(1 + 1e-6)
  raise ValueError(f"no error bound for {fmt!r}")
