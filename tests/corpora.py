"""Inputs for `python -m diloco_jax.prepare` in every format it reads, on small generated
corpora, and an independent reading of the files it writes (tests/test_prepare.py,
test_prepare_errors.py, test_prepared_training.py)."""

import gzip
import hashlib
import json
import os
import random

import numpy as np

from diloco_jax import prepare
from diloco_jax.corpus import format as corpus_format


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DOCS = 300


# Words with multi-byte characters, and the spellings of special tokens: a document that
# contains "<|endoftext|>" as text must not get an EOS id in its middle.
WORDS = ["the", "quick", "brown", "fox", "héllo", "世界", "naïve", "def", "return", "x = 1",
         "<|endoftext|>", "</s>", "\t", "🙂", "\n"]


def make_texts(n: int = N_DOCS, seed: int = 0) -> list[str]:
  """Distinct documents (each starts with its number) of 1 to 80 words."""
  rng = random.Random(seed)
  return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))
          for i in range(n)]


TEXTS = make_texts()


# -------------------------------------------------------------------------- input files

def write_txt(root, texts):
  """One file per document in two subdirectories (sorted order = document order), plus
  files that must be skipped: hidden, __pycache__, an unknown extension."""
  for i, text in enumerate(texts):
    sub = root / ("a" if i < len(texts) // 2 else "b")
    sub.mkdir(parents=True, exist_ok=True)
    (sub / f"{i:04d}.txt").write_bytes(text.encode())
  (root / ".hidden.txt").write_text("hidden")
  (root / "__pycache__").mkdir()
  (root / "__pycache__" / "x.txt").write_text("cache")
  (root / "notes.csv").write_text("a,b")
  return root


def write_jsonl(path, texts, field="text"):
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as f:
    for i, text in enumerate(texts):
      f.write(json.dumps({"id": i, field: text}) + "\n")
      if i % 50 == 0:
        f.write("\n")  # blank lines are not documents
  return path


def write_parquet(path, texts, field="text"):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path,
                 row_group_size=64)  # several row groups and batches
  return path


def write_saved(path, texts):
  import datasets
  datasets.disable_progress_bars()
  datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path), num_shards=2)
  return path


WRITERS = {"txt": lambda d, t: write_txt(d / "txt", t),
           "jsonl": lambda d, t: write_jsonl(d / "c.jsonl", t),
           "jsonl.gz": lambda d, t: write_jsonl(d / "c.jsonl.gz", t),
           "parquet": lambda d, t: write_parquet(d / "c.parquet", t),
           "save_to_disk": lambda d, t: write_saved(d / "saved", t)}


# ------------------------------------------------------------------------------ reading

def run(*args) -> int:
  return prepare.main([str(a) for a in args])


def is_eval(seed: int, index: int, fraction: float) -> bool:
  """The draw the format spec states: blake2b-64 of f"{seed}:{index}" under the fraction."""
  digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


def read_split(out, manifest, split):
  """Every document of a split (EOS included), counted from the files themselves."""
  docs, entry = [], manifest["splits"][split]
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for shard in entry["shards"]:
    raw = (out / shard["file"]).read_bytes()
    assert shard["sha256"] == hashlib.sha256(raw).hexdigest()
    assert len(raw) == shard["tokens"] * itemsize
    tokens, offsets = corpus_format.load_shard(str(out), shard, manifest["dtype"])
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > 0)
    assert len(offsets) == shard["documents"] + 1
    docs += [np.array(tokens[offsets[d]:offsets[d + 1]]) for d in range(len(offsets) - 1)]
  assert entry["documents"] == len(docs)
  assert entry["tokens"] == sum(len(d) for d in docs)
  return docs


def check_corpus(out, texts, *, fraction=0.1, seed=0, shard_tokens=None, decode=None,
                 encode=None):
  """Checks the corpus at `out` holds exactly `texts`, each in its drawn split, ending in
  EOS and nowhere else; decode(ids) must give the text back, or encode(text) the ids."""
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["format"] == "diloco_jax.prepared/1"
  assert manifest["dtype"] == ("uint16" if manifest["vocab_size"] <= 65536 else "uint32")
  eos, drawn = manifest["eos_id"], [is_eval(seed, i, fraction) for i in range(len(texts))]
  for split, want in [("train", False), ("eval", True)]:
    docs = read_split(out, manifest, split)
    expected = [t for t, e in zip(texts, drawn) if e == want]
    assert len(docs) == len(expected)
    for doc, text in zip(docs, expected):
      assert doc[-1] == eos and eos not in doc[:-1]
      assert doc.max() < manifest["vocab_size"]
      if decode:
        assert decode(doc[:-1]) == text
      else:
        assert doc[:-1].tolist() == encode(text)
    entry = manifest["splits"][split]
    assert entry["bytes"] == sum(len(t.encode()) for t in expected)
    if shard_tokens:  # cut at the document that brings a shard to shard_tokens
      for shard in entry["shards"][:-1]:
        tokens, offsets = corpus_format.load_shard(str(out), shard, manifest["dtype"])
        assert len(tokens) >= shard_tokens > offsets[-2]
  assert 0 < sum(drawn) < len(texts)  # the draw gave both splits documents
  assert manifest["eval"] == {"fraction": fraction, "max_documents": None, "seed": seed}
  return manifest


def decode_bytes(ids):
  return bytes(ids.astype(np.uint8)).decode()


def bpe_decoder(out):
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  return lambda ids: tok.decode(ids.tolist(), skip_special_tokens=False)
