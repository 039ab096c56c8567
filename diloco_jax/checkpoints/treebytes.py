"""A pytree as bytes: its leaves' raw bytes end to end, in tree order, and back.

The layout of a host checkpoint's .bin files (checkpoints/per_host.py) and of the shared
state a healing host receives (checkpoints/recovery.py). The tree's structure, shapes and dtypes
come from the reader's own state (`like`), and `index` records them beside the bytes so a
file from another run or version is refused, naming the first leaf that differs.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np


class LayoutError(ValueError):
  """Bytes that do not hold the expected tree; the message says where and how."""


def _leaves(tree: Any) -> list[np.ndarray]:
  return [np.ascontiguousarray(x) for x in jax.tree.leaves(tree)]


def index(tree: Any) -> list[list]:
  """[dtype name, shape, byte offset] of each leaf of `tree` laid end to end."""
  out, offset = [], 0
  for a in _leaves(tree):
    out.append([a.dtype.name, list(a.shape), offset])
    offset += a.nbytes
  return out


def to_bytes(tree: Any) -> bytes:
  """The leaves' bytes end to end, in tree order (what a .bin file holds)."""
  return b"".join(a.reshape(-1).view(np.uint8).tobytes() for a in _leaves(tree))


def from_buffer(buffer, like: Any, where: str) -> Any:
  """The tree shaped like `like` whose leaves are `buffer`'s bytes end to end (a copy)."""
  leaves, treedef = jax.tree.flatten(like)
  out, offset = [], 0
  for x in leaves:
    dtype, shape = np.dtype(x.dtype), tuple(np.shape(x))
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset + size > len(buffer):
      raise LayoutError(f"{where} is shorter than this run's state ({len(buffer)} "
                            f"bytes; leaf {len(out)} needs bytes {offset}..{offset + size})")
    out.append(np.frombuffer(buffer, dtype, count=size // max(dtype.itemsize, 1),
                             offset=offset).reshape(shape).copy())
    offset += size
  if offset != len(buffer):
    raise LayoutError(f"{where} holds {len(buffer)} bytes, this run's state {offset}")
  return jax.tree.unflatten(treedef, out)


def check_layout(saved: list[list], like: Any, where: str) -> None:
  want = [[a.dtype.name, list(a.shape)] for a in _leaves(like)]
  got = [entry[:2] for entry in saved]
  if got != want:
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    raise LayoutError(
        f"{where} does not hold this run's state: {len(got)} leaves, this run {len(want)}; "
        f"leaf {first}: {got[first] if first < len(got) else None} vs "
        f"{want[first] if first < len(want) else None}")


def write(path: str, tree: Any) -> None:
  with open(path, "wb") as f:
    for a in _leaves(tree):
      f.write(memoryview(a.reshape(-1).view(np.uint8)))
    f.flush()
    os.fsync(f.fileno())


