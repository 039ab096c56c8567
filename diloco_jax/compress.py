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
  topk  the largest `fraction` of entries by magnitude, as int32 indices + float32
        values (8 bytes each); what is left out is the caller's to carry (error
        feedback, `encode` returns the decoded vector for that).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

FORMATS = ("none", "bf16", "int8", "4bit", "topk")
BLOCK = 256  # entries per scale (int8, 4bit)
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


def encode(x: np.ndarray, fmt: str, *, block: int = BLOCK,
           topk_fraction: float = 0.01) -> Encoded:
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
    b = _blocks(x, block)
    scale = (np.abs(b).max(axis=1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(b / safe[:, None]), -qmax, qmax).astype(np.int8)
    if fmt == "4bit":  # two's-complement nibbles, two per byte
      nib = (q.ravel() & 0x0F).astype(np.uint8)
      nib = np.pad(nib, (0, nib.size % 2))
      q = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    return Encoded(fmt, x.size, {"q": q.ravel(), "scale": scale})
  if fmt == "topk":
    if not 0 < topk_fraction <= 1:
      raise ValueError(f"topk fraction {topk_fraction}: must be in (0, 1]")
    k = max(1, int(round(topk_fraction * x.size)))
    idx = np.argpartition(np.abs(x), x.size - k)[x.size - k:]
    idx = np.sort(idx).astype(np.int32)
    return Encoded(fmt, x.size, {"indices": idx, "values": x[idx]})
  raise ValueError(f"unknown compression format {fmt!r}; one of {FORMATS}")


def decode(enc: Encoded, *, block: int = BLOCK) -> np.ndarray:
  """The float32 vector `enc` stands for."""
  p = enc.parts
  if enc.fmt == "none":
    return p["values"].astype(np.float32)
  if enc.fmt == "bf16":
    return p["bits"].view(jnp.bfloat16).astype(np.float32)
  if enc.fmt in _QMAX:
    q = p["q"]
    if enc.fmt == "4bit":
      lo, hi = (q & 0x0F).astype(np.int8), (q >> 4).astype(np.int8)
      nib = np.stack([lo, hi], axis=1).ravel()
      q = np.where(nib > 7, nib - 16, nib).astype(np.int8)
    n_blocks = p["scale"].size
    q = q[:n_blocks * block].reshape(n_blocks, block).astype(np.float32)
    return (q * p["scale"][:, None]).ravel()[:enc.size]
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
  if fmt in _QMAX:
    b = _blocks(x, block)
    half_step = np.abs(b).max(axis=1) / np.float32(2 * _QMAX[fmt])
    return np.repeat(half_step, block)[:x.size] * np.float32(1 + 1e-6)
  raise ValueError(f"no error bound for {fmt!r}")
