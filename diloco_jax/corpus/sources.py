"""The documents of a corpus to prepare: input paths to sources, and each source's texts.

A source is a file, or a directory written by `datasets.save_to_disk` (its Arrow files):
- text (`.txt`, `.md`, `.py`, ... see TEXT_EXTENSIONS): the whole file is one document, so
  a source file stays in one piece (read as UTF-8; invalid bytes become U+FFFD);
- `.jsonl` / `.jsonl.gz`: one document per line, the string in `text_field`;
- `.parquet`: one document per row of column `text_field`, read in row batches;
- a saved dataset (`state.json` + Arrow IPC files): the same, read from memory maps.
Documents come out one at a time in input order, so a corpus is never held in memory.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import gzip
import importlib
import json
import os
from collections.abc import Iterator
from collections.abc import Sequence

from diloco_jax import errors

TEXT_EXTENSIONS = (".txt", ".text", ".md", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc",
                   ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh")
_ROWS_PER_BATCH = 1024
_LISTED = 5  # skipped paths named in a message, then a count


class InputError(errors.DilocoError):
  """A problem with what the user gave (an input, a flag, a file), said in one line."""
  prefix = "Invalid input"


def require(module: str):
  """Imports a module of the `prepare` extra, or says in one line how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError:
    raise InputError(f"{module.split('.')[0]} is not installed; run pip install -e "
                     "'.[prepare]' (in the diloco_jax checkout)") from None


@dataclasses.dataclass(frozen=True)
class Source:
  """Attributes: path (as found); kind, one of text, jsonl, parquet, arrow; files, the
  files it reads in order (a saved dataset's Arrow files, else the path itself)."""
  path: str
  kind: str
  files: tuple[str, ...]


def file_kind(path: str, text_extensions: Sequence[str]) -> str | None:
  lower = path.lower()
  if lower.endswith((".jsonl", ".jsonl.gz")):
    return "jsonl"
  if lower.endswith(".parquet"):
    return "parquet"
  if lower.endswith(tuple(e.lower() for e in text_extensions)):
    return "text"
  return None


def find_sources(inputs: Sequence[str], text_extensions: Sequence[str],
                 exclude: Sequence[str] = ()) -> tuple[list[Source], list[str]]:
  """(the sources of every --input, a file, a directory or a glob, in order, each once;
  the paths skipped).

  Directories are walked in sorted order; hidden files and directories, __pycache__, what
  an `exclude` glob matches (by name or by path) and files of unknown formats are skipped.
  An input with nothing to read is an InputError.
  """
  sources, seen, all_skipped = [], set(), []
  for pattern in inputs:
    if any(c in pattern for c in "*?["):
      matches = sorted(glob.glob(pattern, recursive=True))
      if not matches:
        raise InputError(f"--input={pattern} matches no file")
    elif os.path.exists(pattern):
      matches = [pattern]
    else:
      raise InputError(f"--input={pattern}: no such file or directory")
    found, skipped = [], []
    for path in matches:
      _collect(path, text_extensions, exclude, found, skipped)
    if not found:
      known = ".jsonl, .jsonl.gz, .parquet, a datasets.save_to_disk directory, or text: "
      raise InputError(
          f"--input={pattern}: no file of a known format ({known}{' '.join(text_extensions)}; "
          f"--text_extensions changes the last); skipped: {listing(skipped) or 'nothing there'}")
    all_skipped += skipped
    for source in found:
      if os.path.realpath(source.path) not in seen:
        seen.add(os.path.realpath(source.path))
        sources.append(source)
  return sources, all_skipped


def _collect(path: str, text_extensions, exclude, found: list, skipped: list) -> None:
  """Appends the sources under `path` to `found` in a fixed order (a saved dataset in a
  directory before that directory's files, subdirectories after), the rest to `skipped`."""
  if _skip(os.path.basename(os.path.normpath(path)), path, exclude, hidden=False):
    skipped.append(path)
    return
  if not os.path.isdir(path):
    kind = file_kind(path, text_extensions)
    if kind:
      found.append(Source(path, kind, (path,)))
    else:
      skipped.append(path)
    return
  saved = _saved_dataset(path)
  if saved is not None:
    found.extend(saved)
    return
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for d in list(dirs):
      full = os.path.join(root, d)
      if _skip(d, full, exclude):
        skipped.append(full + "/")
      elif (saved := _saved_dataset(full)) is not None:
        found.extend(saved)
      else:
        continue
      dirs.remove(d)  # os.walk does not descend into the dirs removed here
    for name in sorted(files):
      full = os.path.join(root, name)
      kind = None if _skip(name, full, exclude) else file_kind(name, text_extensions)
      if kind:
        found.append(Source(full, kind, (full,)))
      else:
        skipped.append(full)


def _skip(name: str, path: str, exclude: Sequence[str], hidden: bool = True) -> bool:
  """Whether a file or directory met in a walk is skipped: hidden, __pycache__ or excluded
  (an input named explicitly is only checked against `exclude`)."""
  if hidden and (name.startswith(".") or name == "__pycache__"):
    return True
  return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p) for p in exclude)


def _saved_dataset(path: str) -> list[Source] | None:
  """The sources of a `datasets.save_to_disk` directory (a Dataset, or a DatasetDict's
  splits in its own order), or None if `path` is not one (a state.json of another kind)."""
  def read(name):
    try:
      with open(os.path.join(path, name)) as f:
        value = json.load(f)
      return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
      return {}

  splits = read("dataset_dict.json").get("splits")
  if isinstance(splits, list):
    return [s for split in splits for s in _saved_dataset(os.path.join(path, split)) or []]
  files = read("state.json").get("_data_files")
  if not isinstance(files, list):
    return None
  return [Source(path, "arrow", tuple(os.path.join(path, f["filename"]) for f in files))]


def listing(paths: Sequence[str]) -> str:
  """The first few paths, then how many more."""
  more = f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else ""
  return ", ".join(paths[:_LISTED]) + more


def describe(sources: Sequence[Source]) -> str:
  return listing([s.path for s in sources])


# ----------------------------------------------------------------------------- reading

class Reader:
  """Reads the documents of sources, for the summary counting the empty ones it skips and
  listing in `replaced` the text files that were not valid UTF-8 (bad bytes read as U+FFFD)."""

  def __init__(self, text_field: str):
    self.text_field = text_field
    self.replaced: list[str] = []
    self.empty = 0

  def documents(self, source: Source) -> Iterator[str]:
    """The non-empty documents of `source` in order; an unreadable file is an InputError
    naming it."""
    for text in self._all(source):
      if text:
        yield text
      else:
        self.empty += 1

  def _all(self, source: Source) -> Iterator[str]:
    read = {"text": self._text, "jsonl": self._jsonl, "parquet": self._parquet,
            "arrow": self._arrow}[source.kind]
    for path in source.files:
      try:
        yield from read(path)
      except InputError:
        raise
      except (OSError, EOFError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read it: {e}") from None
      except Exception as e:  # pyarrow's (ArrowException is not importable before pyarrow
        # is known to be installed)
        if type(e).__module__.startswith("pyarrow"):
          raise InputError(f"{path}: cannot read it: {e}") from None
        raise

  def _text(self, path: str) -> Iterator[str]:
    with open(path, "rb") as f:
      data = f.read()
    try:
      yield data.decode("utf-8")
    except UnicodeDecodeError:
      self.replaced.append(path)
      yield data.decode("utf-8", errors="replace")

  def _jsonl(self, path: str) -> Iterator[str]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        where = f"{path}, line {number}"
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise InputError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict):
          raise InputError(f"{where}: a JSON {type(record).__name__}, not an object")
        if self.text_field not in record:
          raise InputError(f"{where}: no field {self.text_field!r} (it has: "
                           f"{', '.join(record) or 'no fields'}); choose one with --text_field")
        yield self._checked(record[self.text_field], where)

  def _checked(self, value, where: str) -> str:
    if not isinstance(value, str):
      raise InputError(f"{where}: field {self.text_field!r} is {json.dumps(value)[:40]}, not "
                       "a string")
    return value

  def _column(self, schema, path: str) -> int:
    pa = require("pyarrow")
    if self.text_field not in schema.names:
      raise InputError(f"{path}: no column {self.text_field!r} (it has: "
                       f"{', '.join(schema.names)}); choose one with --text_field")
    kind = schema.field(self.text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
      raise InputError(f"{path}: column {self.text_field!r} holds {kind}, not strings")
    return schema.get_field_index(self.text_field)

  def _rows(self, batches, path: str) -> Iterator[str]:
    row = 0
    for column in batches:
      texts = column.to_pylist()
      if column.null_count:
        first = next(i for i, t in enumerate(texts) if t is None)
        raise InputError(f"{path}, row {row + first} (from 0): field {self.text_field!r} "
                         "is null, not a string")
      yield from texts
      row += len(texts)

  def _parquet(self, path: str) -> Iterator[str]:
    pq = require("pyarrow.parquet")
    with pq.ParquetFile(path) as parquet:
      self._column(parquet.schema_arrow, path)
      batches = parquet.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[self.text_field])
      yield from self._rows((b.column(0) for b in batches), path)

  def _arrow(self, path: str) -> Iterator[str]:
    pa = require("pyarrow")
    # datasets writes the IPC stream format; the file format is read too. Memory-mapped,
    # so only the batches being turned into strings are in memory.
    with pa.memory_map(path) as source:
      try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
      except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      index = self._column(reader.schema, path)
      yield from self._rows((b.column(index) for b in batches), path)
