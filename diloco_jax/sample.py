"""Entry point: python -m diloco_jax.sample --workdir=DIR --prompt="Once upon a time".

Samples text from the model a run trained, with the run's own tokenizer; how, and the
functions behind it (`generate`, the codecs, `SampleError`): diloco_jax/readback/sampling.py,
whose names this module still answers to (`diloco_jax.sample.generate`).

A bad flag, prompt or workdir stops with one line on stderr and exit status 1.
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags
from absl import logging

from diloco_jax import errors


def define_flags() -> None:
  """The command's flags, defined when it runs as a command (not on import: sample and
  export share flag names, and a process may import both)."""
  global _WORKDIR, _PROMPT, _MAX_NEW_TOKENS, _TEMPERATURE, _TOP_K, _SEED, _STEP, _NUM_SAMPLES
  _WORKDIR = flags.DEFINE_string("workdir", None, "Required: the --workdir of a training run.")
  _PROMPT = flags.DEFINE_string(
      "prompt", "", "The text to continue; for synthetic or tokens data, space-separated token "
      "ids. Empty: prepared data starts a new document (from EOS); other data needs a prompt.")
  _MAX_NEW_TOKENS = flags.DEFINE_integer(
      "max_new_tokens", 100, "Tokens to generate; with the prompt's, at most model.seq_len.",
      lower_bound=1)
  _TEMPERATURE = flags.DEFINE_float(
      "temperature", 1.0, "Divides the logits before sampling; 0: greedy (the likeliest token).",
      lower_bound=0.0)
  _TOP_K = flags.DEFINE_integer(
      "top_k", 0, "Sample among the k likeliest tokens only; 0: among all.", lower_bound=0)
  _SEED = flags.DEFINE_integer("seed", 0, "Seeds the sampling: the same seed, the same text.")
  _STEP = flags.DEFINE_integer(
      "step", None, "The checkpoint (round) to read; default: the newest.", lower_bound=0)
  _NUM_SAMPLES = flags.DEFINE_integer(
      "num_samples", 1, "Samples to draw from the prompt (in one batch), printed one after "
      "another.", lower_bound=1)


_HELP_FLAGS = ("help", "helpshort", "helpfull", "?")


def main(argv):
  if len(argv) > 1:
    _fail(f"Unexpected arguments: {argv[1:]} (flags are --name=value; see --help)")
  if not _WORKDIR.value:
    _fail("Missing --workdir: the --workdir of a training run, e.g. --workdir=/tmp/diloco_tiny")
  if not flags.FLAGS["verbosity"].present:  # orbax warns that a read-only reader is read-only
    logging.set_verbosity(logging.ERROR)
  from diloco_jax.readback import sampling  # pylint: disable=import-outside-toplevel
  try:
    texts = sampling.sample(_WORKDIR.value, _PROMPT.value,
                            max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                            top_k=_TOP_K.value, seed=_SEED.value, step=_STEP.value,
                            num_samples=_NUM_SAMPLES.value)
  except errors.DilocoError as e:  # whatever its kind, named by the command: `sample: ...`
    _fail(errors.describe(e, "sample"), e.exit_code)
  for i, text in enumerate(texts):
    if len(texts) > 1:
      print(f"{'-' * 20} sample {i + 1} of {len(texts)} {'-' * 20}")
    print(text, flush=True)
  _exit(0)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with --help exiting 0 (absl exits 1) and a bad flag reported in
  one line (absl prints a usage hint after it)."""
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    if e.code == 1 and any(a.lstrip("-").split("=")[0] in _HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  except flags.Error as e:
    _fail(f"Invalid flags: {' '.join(str(e).split())} (see --help)")


def _fail(message: str, code: int = 1) -> None:
  sys.stderr.write(message + "\n")
  _exit(code)


def _exit(code: int) -> None:
  """Exits now: orbax's threads, left from reading the checkpoint, would print noise at
  shutdown."""
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(code)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)
