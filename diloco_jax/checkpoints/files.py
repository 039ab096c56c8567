"""The files of a host checkpoint (checkpoints/per_host.py), each checked before use.

  <item>.safetensors  a pytree (`shared`, `own`) as a safetensors file: one tensor per
                      leaf, named by its path in the tree (`jax.tree_util.keystr`, e.g.
                      `.anchor['params']['Dense_0']['kernel']`). A leaf whose dtype
                      safetensors' numpy reader lacks (bfloat16, say) is stored as its
                      bits (an unsigned integer of its width) and its dtype recorded.
  meta.json           the round, config, world, ...; per .safetensors file its sha256
                      (what `sha256sum` prints), its size and its leaves' names in tree
                      order; and the sha256 of meta.json's own content, which it cannot
                      hold as a file hash.

A file is read whole, its sha256 compared with meta.json's, and only then parsed: a byte
changed on disk is found before any of it is used, and the error names the file. The
tree's structure, shapes and dtypes come from the reader's own state (`like`); a leaf
missing, extra or of another shape or dtype is an error naming the file and the leaf.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy

from diloco_jax.checkpoints import store

# Version 1 (raw leaf bytes end to end, with an index) is refused: per_host.py says how.
FORMAT = "diloco_jax.host_checkpoint/2"
META = "meta.json"
META_SHA = "meta_sha256"  # meta.json's key for the hash of its own content
# The dtypes safetensors' numpy reader gives back; any other is stored as its bits.
NATIVE = {"float64", "float32", "float16", "int64", "uint64", "int32", "uint32", "int16",
          "uint16", "int8", "uint8", "bool", "complex64"}
_READ_BYTES = 16 << 20


class FormatError(store.CheckpointError):
  """A checkpoint of another format than this version's (an earlier one's, say)."""


def filename(item: str) -> str:
  return f"{item}.safetensors"


def _named(tree: Any) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(path) or "<root>", leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _describe(dtype, shape) -> str:
  return f"{np.dtype(dtype).name}{list(shape)}"


def _tensors(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """The leaves by name, as safetensors stores them, and the dtypes stored as bits."""
  tensors, bits = {}, {}
  for name, leaf in _named(tree):
    a = np.asarray(leaf)
    if not a.flags.c_contiguous:
      a = np.ascontiguousarray(a)  # a copy, of this leaf only (never 0-d: those are contiguous)
    if a.dtype.name not in NATIVE:
      bits[name] = a.dtype.name
      a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    tensors[name] = a
  return tensors, bits


def encode(tree: Any) -> tuple[bytes, dict[str, Any]]:
  """`tree` as the bytes of a safetensors file, and their record (as `write`'s): a state
  sent to a host that joins a live job, checked by `to_tree` as a file read from disk."""
  tensors, bits = _tensors(tree)
  data = safetensors.numpy.save(tensors)
  return data, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "leaves": list(tensors), **({"bits": bits} if bits else {})}


def write(path: str, tree: Any) -> dict[str, Any]:
  """Writes `tree` to `path`, on disk (fsynced) when it returns; its record for
  meta.json: sha256 and bytes of the file, the leaves' names in tree order, and the
  dtypes of leaves stored as bits."""
  tensors, bits = _tensors(tree)
  safetensors.numpy.save_file(tensors, path)
  digest, size = hashlib.sha256(), 0
  with open(path, "rb") as f:  # hashed as read back: what the disk was given
    while chunk := f.read(_READ_BYTES):
      digest.update(chunk)
      size += len(chunk)
    os.fsync(f.fileno())
  return {"sha256": digest.hexdigest(), "bytes": size, "leaves": list(tensors),
          **({"bits": bits} if bits else {})}


def read(path: str, record: dict[str, Any]) -> bytes:
  """The bytes of the file at `path`, once their sha256 is the one `record` holds."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise store.CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
  check(data, record, path)
  return data


def check(data: bytes, record: dict[str, Any], where: str) -> None:
  """Raises unless `data` has the size and sha256 of `record` (a file's in meta.json)."""
  got = hashlib.sha256(data).hexdigest()
  if got != record["sha256"]:
    size = (f"; {len(data)} bytes, {record['bytes']} written"
            if len(data) != record["bytes"] else "")
    raise store.CheckpointError(
        f"{where}: sha256 mismatch (meta.json records {record['sha256'][:12]}, the bytes "
        f"read hash to {got[:12]}{size}): changed or cut short since it was written")


def leaves(data: bytes, record: dict[str, Any], where: str) -> dict[str, np.ndarray]:
  """The leaves `data` (a checked file's bytes) holds, by name, in their dtypes."""
  try:
    arrays = safetensors.numpy.load(data)
  except (safetensors.SafetensorError, KeyError, ValueError) as e:
    raise store.CheckpointError(f"{where}: not a safetensors file this version reads "
                                f"({type(e).__name__}: {e})") from None
  for name, dtype in record.get("bits", {}).items():
    if name in arrays:
      arrays[name] = arrays[name].view(np.dtype(dtype))
  return arrays


def to_tree(data: bytes, like: Any, record: dict[str, Any], where: str) -> Any:
  """The tree shaped like `like` whose leaves `data` (a checked file's bytes) holds."""
  arrays = leaves(data, record, where)
  named = _named(like)
  extra = sorted(arrays.keys() - {name for name, _ in named})
  if extra:
    raise store.CheckpointError(f"{where} holds leaves this run's state does not have: "
                                f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
  out = []
  for name, want in named:
    if name not in arrays:
      raise store.CheckpointError(f"{where} has no leaf {name} ({len(arrays)} leaves; "
                                  f"this run's state has {len(named)})")
    a = arrays[name]
    dtype, shape = np.dtype(want.dtype), tuple(np.shape(want))
    if a.dtype != dtype or a.shape != shape:
      raise store.CheckpointError(
          f"{where}: leaf {name} is {_describe(a.dtype, a.shape)}, this run's state "
          f"{_describe(dtype, shape)}")
    out.append(a)
  return jax.tree.unflatten(jax.tree.structure(like), out)


def _content_sha(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def meta_bytes(meta: dict) -> bytes:
  """meta.json's bytes: `meta` with the sha256 of its content (keys sorted)."""
  body = json.loads(json.dumps(meta, default=str))  # as it will read back
  return json.dumps({**body, META_SHA: _content_sha(body)}, sort_keys=True).encode()


def write_meta(path: str, meta: dict) -> None:
  """meta.json (`meta_bytes`), fsynced."""
  with open(path, "wb") as f:
    f.write(meta_bytes(meta))
    f.flush()
    os.fsync(f.fileno())


def load_meta(data: bytes, where: str) -> dict:
  """meta.json's content from its bytes, once its format and own sha256 are checked."""
  try:
    meta = json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise store.CheckpointError(f"{where}: not JSON ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise FormatError(
        f"{where}: a checkpoint of format {found!r}; this version reads {FORMAT!r} only"
        + (" (format 1: written by an earlier diloco_jax, which resumes it)"
           if found == "diloco_jax.host_checkpoint/1" else ""))
  want = meta.pop(META_SHA, None)
  if want != _content_sha(meta):
    raise store.CheckpointError(f"{where}: sha256 mismatch (its content is not what was "
                                f"written)")
  return meta
