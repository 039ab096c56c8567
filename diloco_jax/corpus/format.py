"""A prepared corpus on disk (docs/prepared_format.md): its token shards, its manifest, and
putting a finished one in place.

A split's shard `<split>-NNNNN.bin` is a flat little-endian array of the manifest's dtype:
documents end to end, each followed by EOS, never cut across shards. Its index
`<split>-NNNNN.idx` holds documents + 1 little-endian uint64 offsets: where each document
starts, then the shard's token count; document d is tokens [idx[d], idx[d+1]), EOS last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

FORMAT = "diloco_jax.prepared/1"
SHARD_TOKENS = 1 << 26  # about 128 MiB of uint16: few files, each cheap to memory-map


class SplitWriter:
  """Writes one split's shards: documents end to end, a shard closed at the document that
  brings it to `shard_tokens`; the .idx (offsets) is written as the .bin grows."""

  def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int):
    self.directory, self.split, self.shard_tokens = directory, split, shard_tokens
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.shards, self.documents, self.tokens, self.bytes = [], 0, 0, 0
    self._bin = None

  def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: int) -> None:
    """Documents laid end to end (each with its EOS), their lengths, their text's bytes."""
    self.documents, self.tokens = self.documents + len(lengths), self.tokens + len(tokens)
    self.bytes += text_bytes
    ends, first = np.cumsum(lengths), 0
    while first < len(lengths):
      if self._bin is None:
        self._open()
      start = int(ends[first] - lengths[first])
      last = int(np.searchsorted(ends, start + self.shard_tokens - self._count))
      stop = min(last + 1, len(lengths))
      piece = tokens[start:ends[stop - 1]].astype(self.dtype, copy=False)
      self._bin.write(piece.data)
      self._hash.update(piece.data)
      self._idx.write((self._count + ends[first:stop] - start).astype("<u8").data)
      self._count, self._docs = self._count + len(piece), self._docs + stop - first
      if self._count >= self.shard_tokens:
        self._close()
      first = stop

  def close(self) -> dict:
    """The split's manifest entry."""
    if self._bin is not None:
      self._close()
    return {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
            "shards": self.shards}

  def _open(self) -> None:
    self._name = f"{self.split}-{len(self.shards):05d}"
    # Open until the shard is full, across calls to add; closed by _close.
    self._bin = open(os.path.join(self.directory, self._name + ".bin"), "wb")  # noqa: SIM115
    self._idx = open(os.path.join(self.directory, self._name + ".idx"), "wb")  # noqa: SIM115
    self._idx.write(np.zeros(1, "<u8").data)
    self._hash, self._count, self._docs = hashlib.sha256(), 0, 0

  def _close(self) -> None:
    for f in (self._bin, self._idx):
      f.flush()
      os.fsync(f.fileno())  # the manifest, written later, must not outlive its shards
      f.close()
    self.shards.append({"file": self._name + ".bin", "index": self._name + ".idx",
                        "documents": self._docs, "tokens": self._count,
                        "sha256": self._hash.hexdigest()})
    self._bin = None


def load_shard(directory: str, shard: dict, dtype: str) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, offsets) of a shard (a manifest shard entry), memory-mapped: document d is
  tokens[offsets[d]:offsets[d + 1]], its EOS last."""
  tokens = np.memmap(os.path.join(directory, shard["file"]), np.dtype(dtype).newbyteorder("<"),
                     mode="r")
  return tokens, np.memmap(os.path.join(directory, shard["index"]), "<u8", mode="r")


def read_manifest(directory: str) -> dict | None:
  """The manifest of the prepared corpus in `directory`, None if it holds none."""
  try:
    with open(os.path.join(directory, "manifest.json")) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def missing_files(manifest: dict, directory: str) -> list[str]:
  """The files the manifest names that `directory` lacks."""
  names = [manifest["tokenizer"]["file"]] if manifest["tokenizer"]["file"] else []
  for split in manifest["splits"].values():
    names += [n for shard in split["shards"] for n in (shard["file"], shard["index"])]
  return [n for n in names if not os.path.isfile(os.path.join(directory, n))]


def write_json(path: str, value: dict) -> None:
  """Writes `value` to `path` atomically: a reader sees the old file or the whole new one."""
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, indent=1)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def remove(path: str) -> None:
  """Removes a file or a directory tree, if there."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)


def publish(staging: str, output: str) -> None:
  """Puts the complete corpus built in `staging` at `output`, replacing what is there.

  Two renames: a crash between them leaves no corpus at `output` rather than a mixed one
  (the old one whole in `staging`.replaced, which the next publish removes)."""
  old = staging + ".replaced"
  remove(old)
  if os.path.lexists(output):
    os.rename(output, old)
  os.rename(staging, output)
  remove(old)
