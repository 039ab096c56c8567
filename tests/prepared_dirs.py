"""Prepared corpora for the tests, written without `diloco_jax.prepare`: tagged documents,
a small writer of the format (docs/prepared_format.md; the "bytes" tokenizer: a token per
UTF-8 byte, EOS 256), and the data and training configs that read them
(tests/test_prepared_data.py, test_prepared_training.py, test_sample.py)."""

import hashlib
import json
import os
import random
import re
import time

import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.data import pipeline as data_lib
from tests import multihost


EOS, VOCAB = 256, 257
SEQ_LEN, BATCH = 32, 4
TAG = re.compile(rb"<([te])(\d{4})\.\d\d>")
WORDS = ("alpha", "beta", "gamma", "λx", "naïve", "déjà", "Ω", "zeta", "eta", "theta")


def document(kind: str, i: int, rng: random.Random) -> str:
  """Segments of at most 17 bytes, each opening with the document's tag and its own
  number, <t0012.07> (train) or <e0003.00> (eval): every window of L+1 = 33 tokens holds
  a whole one, so windows differ, and show which documents they were cut from."""
  return "".join(f"<{kind}{i:04d}.{j:02d}>{rng.choice(WORDS)} "
                 for j in range(rng.randint(3, 30)))


def corpus_documents(num_train: int = 240, num_eval: int = 40, seed: int = 0):
  rng = random.Random(seed)
  return ([document("t", i, rng) for i in range(num_train)],
          [document("e", i, rng) for i in range(num_eval)])


def write_prepared(directory, train: list[str], eval_: list[str],
                   docs_per_shard: int = 70) -> str:
  """A prepared directory in the format of docs/prepared_format.md (bytes tokenizer)."""
  os.makedirs(directory, exist_ok=True)
  splits = {}
  for split, docs in (("train", train), ("eval", eval_)):
    shards = []
    for n, first in enumerate(range(0, len(docs), docs_per_shard)):
      encoded = [list(d.encode()) + [EOS] for d in docs[first:first + docs_per_shard]]
      tokens = np.array([t for e in encoded for t in e], "<u2")
      index = np.array([0, *np.cumsum([len(e) for e in encoded])], "<u8")
      name = f"{split}-{n:05d}"
      tokens.tofile(os.path.join(directory, name + ".bin"))
      index.tofile(os.path.join(directory, name + ".idx"))
      shards.append({"file": name + ".bin", "index": name + ".idx", "documents": len(encoded),
                     "tokens": len(tokens),
                     "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
    splits[split] = {"documents": len(docs), "tokens": sum(s["tokens"] for s in shards),
                     "bytes": sum(len(d.encode()) for d in docs), "shards": shards}
  manifest = {"format": "diloco_jax.prepared/1", "vocab_size": VOCAB, "eos_id": EOS,
              "dtype": "uint16", "tokenizer": {"kind": "bytes", "file": None},
              "splits": splits, "eval": {"fraction": 0.15, "max_documents": None, "seed": 0},
              "sources": [], "args": {"tokenizer": "bytes"},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
  with open(os.path.join(directory, "manifest.json"), "w") as f:
    json.dump(manifest, f)
  return str(directory)


def data_config(path: str, **overrides):
  c = config_lib.get_default_config().data
  c.update(dict(source="prepared", path=path, vocab_size=VOCAB, seed=3))
  c.update(overrides)
  return c


def host_data(c, **kw):
  args = dict(seq_len=SEQ_LEN, batch_size=BATCH, replicas_per_host=2, num_eval_batches=2)
  args.update(kw)
  return data_lib.make_host_data(c, **args)


def draw(hosts: list[data_lib.HostData], num_batches: int) -> list[list[np.ndarray]]:
  """The windows of `num_batches` batches of every replica (host-major order: g)."""
  batches = [[], [], [], []]
  for _ in range(num_batches):
    for h, d in enumerate(hosts):
      for r, batch in enumerate(d.next_batch()):
        batches[2 * h + r] += list(batch)
  return batches


def tags(windows, decode=None) -> set[bytes]:
  """The documents (b"t0012", b"e0003") that windows of tokens were cut from."""
  decode = decode or (lambda w: bytes(np.asarray(w)[np.asarray(w) != EOS].astype(np.uint8)))
  return {b"".join(m) for w in windows for m in TAG.findall(decode(w))}


def train_config(path: str, **overrides):
  return multihost.small_config(**{"data.source": "prepared", "data.path": path,
                                   "data.vocab_size": VOCAB, **overrides})
