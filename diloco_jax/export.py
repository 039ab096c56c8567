"""python -m diloco_jax.export --workdir=W --output=DIR/model.safetensors: a trained model as
a safetensors file, with its config beside it.

What it writes (the safetensors file, config.json, the tokenizer) and the tensor names:
`diloco_jax/models/exported.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import ml_collections
from absl import app
from absl import flags
from absl import logging

from diloco_jax.cli import command_line
from diloco_jax.cli import exits

# The checkpoint reader and the model (jax, orbax) are imported where they are used, so
# that --help answers at once.

# Every failure's message names the flag or file at fault: it is printed alone.
EXPORT = exits.Command(prefix="")


def define_flags() -> None:
  """The command's flags, defined when it runs as a command (not on import: sample and
  export share flag names, and a process may import both); `Options` reads them."""
  flags.DEFINE_string("workdir", None, "Required: the training run's --workdir.")
  flags.DEFINE_string(
      "output", None, "Required: the file to write, ending in .safetensors (name it "
      "model.safetensors for Hugging Face's from_pretrained); config.json goes beside it.")
  flags.DEFINE_integer("step", None, "The checkpoint (round) to export; default: the newest.")
  flags.DEFINE_bool("overwrite", False, "Replace files that exist already.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                    "The tensors' dtype in the file (training keeps float32).")
  flags.DEFINE_string(
      "max_shard_size", "5GB", "Above this, the tensors are cut into files of at most this "
      "size with an index (Hugging Face's layout): bytes, or a number with KB, MB, GB (powers "
      "of 1000) or KiB, MiB, GiB.")


@dataclasses.dataclass(frozen=True)
class Options:
  """The command's flags, parsed (each field is the flag of its name)."""
  workdir: str | None
  output: str | None
  step: int | None
  overwrite: bool
  dtype: str
  max_shard_size: str


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
  """Bytes of '5GB', '500MiB' or '1000000'; a FlagError (a ValueError) naming the flag
  otherwise."""
  number = text.strip().upper().rstrip("BIKMGT")
  unit = text.strip().upper()[len(number):]
  try:
    size = float(number) * _UNITS[unit]
  except (ValueError, KeyError):
    raise command_line.FlagError(f"--max_shard_size={text}: a size such as 5GB, 500MB or "
                                 "1000000 (bytes)") from None
  if size < 1:
    raise command_line.FlagError(f"--max_shard_size={text}: must be at least 1 byte")
  return int(size)


def corpus_files(config: ml_collections.ConfigDict) -> tuple[str | None, int | None]:
  """(the tokenizer file, the EOS id) of a run on a prepared corpus, from its manifest;
  None for what is unknown (other data, a byte tokenizer, a corpus no longer there)."""
  if config.data.source != "prepared":
    return None, None
  try:
    with open(os.path.join(config.data.path, "manifest.json")) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    print(f"Note: {config.data.path}/manifest.json cannot be read: no tokenizer or EOS id "
          "exported")
    return None, None
  eos = manifest.get("eos_id")
  name = (manifest.get("tokenizer") or {}).get("file")
  path = os.path.join(config.data.path, name) if name else None
  if path and not os.path.isfile(path):
    print(f"Note: {path} is missing: no tokenizer exported")
    path = None
  return path, None if eos is None else int(eos)


def export(workdir: str, output: str, step: int | None = None,
           overwrite: bool = False, dtype: str = "float32",
           max_shard_bytes: int | None = None) -> list[str]:
  """The model of `workdir`'s newest checkpoint (or `step`'s) to `output`; returns the
  paths written. Raises exported.ExportError, trained.LoadError or model.ModuleError."""
  from diloco_jax.readback import trained as trained_lib  # pylint: disable=import-outside-toplevel
  from diloco_jax.models import exported  # pylint: disable=import-outside-toplevel
  exported.check_output(output)  # before the checkpoint is read: it takes seconds
  exported.check_free([output, os.path.join(os.path.dirname(output) or ".", exported.CONFIG)],
                      overwrite)
  trained = trained_lib.load(workdir, step)
  tokenizer, eos_id = corpus_files(trained.config)
  run = {"mode": trained.config.mode, "round": trained.round, "finished": trained.finished,
         "workdir": os.path.abspath(workdir)}
  return exported.write(output, trained.model, trained.params, run=run, tokenizer=tokenizer,
                        eos_id=eos_id, overwrite=overwrite, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)


def main(argv: list[str]) -> None:
  command_line.no_arguments(argv)
  options = command_line.read(Options)
  for name in ("workdir", "output"):
    if not getattr(options, name):
      sys.exit(f"Missing --{name} (see --help)")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every read, and warns that it is
    logging.set_verbosity(logging.ERROR)    # read-only: nothing the user needs
  paths = exits.run(lambda: export(options.workdir, options.output, options.step,
                                   options.overwrite, options.dtype,
                                   parse_size(options.max_shard_size)), EXPORT)
  print("Wrote " + ", ".join(paths))


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=command_line.parse)
