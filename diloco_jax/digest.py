"""Content hashes of files: where a run's inputs came from (corpus sources, pretrained
weights), written beside what was made from them."""

import hashlib


def file_sha256(path: str) -> str:
  """The file's sha256 (hex), read in 16 MiB blocks: weights files run to gigabytes."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 24):
      digest.update(block)
  return digest.hexdigest()
