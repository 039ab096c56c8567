"""Entry point: python -m diloco_jax.sample --workdir=DIR --prompt="Once upon a time".

Samples text from the model a run trained, with the run's own tokenizer; how, and the
functions behind it (`generate`, the codecs, `SampleError`): diloco_jax/readback/sampling.py.

A bad flag, prompt or workdir stops with one line on stderr and exit status 1.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app
from absl import flags
from absl import logging

from diloco_jax.cli import command_line
from diloco_jax.cli import exits

# Every failure is the command's input (the workdir, the prompt, a flag): `sample: ...`.
SAMPLE = exits.Command(prefix="sample", interrupted="sample: interrupted (Ctrl-C)")


def define_flags() -> None:
  """The command's flags, defined when it runs as a command (not on import: sample and
  export share flag names, and a process may import both); `Options` reads them."""
  flags.DEFINE_string("workdir", None, "Required: the --workdir of a training run.")
  flags.DEFINE_string(
      "prompt", "", "The text to continue; for synthetic or tokens data, space-separated token "
      "ids. Empty: prepared data starts a new document (from EOS); other data needs a prompt.")
  flags.DEFINE_integer(
      "max_new_tokens", 100, "Tokens to generate; with the prompt's, at most model.seq_len.",
      lower_bound=1)
  flags.DEFINE_float(
      "temperature", 1.0, "Divides the logits before sampling; 0: greedy (the likeliest token).",
      lower_bound=0.0)
  flags.DEFINE_integer(
      "top_k", 0, "Sample among the k likeliest tokens only; 0: among all.", lower_bound=0)
  flags.DEFINE_integer("seed", 0, "Seeds the sampling: the same seed, the same text.")
  flags.DEFINE_integer(
      "step", None, "The checkpoint (round) to read; default: the newest.", lower_bound=0)
  flags.DEFINE_integer(
      "num_samples", 1, "Samples to draw from the prompt (in one batch), printed one after "
      "another.", lower_bound=1)


@dataclasses.dataclass(frozen=True)
class Options:
  """The command's flags, parsed (each field is the flag of its name)."""
  workdir: str | None
  prompt: str
  max_new_tokens: int
  temperature: float
  top_k: int
  seed: int
  step: int | None
  num_samples: int


def main(argv: list[str]) -> None:
  command_line.no_arguments(argv)
  options = command_line.read(Options)
  if not options.workdir:
    sys.exit("Missing --workdir: the --workdir of a training run, e.g. "
             "--workdir=/tmp/diloco_tiny")
  if not flags.FLAGS["verbosity"].present:  # orbax warns that a read-only reader is read-only
    logging.set_verbosity(logging.ERROR)
  texts = exits.run(lambda: _sample(options), SAMPLE)
  for i, text in enumerate(texts):
    if len(texts) > 1:
      print(f"{'-' * 20} sample {i + 1} of {len(texts)} {'-' * 20}")
    print(text, flush=True)
  exits.exit_now(0)  # orbax's threads, left from reading the checkpoint, would print noise


def _sample(o: Options) -> list[str]:
  from diloco_jax.readback import sampling  # pylint: disable=import-outside-toplevel
  return sampling.sample(o.workdir, o.prompt, max_new_tokens=o.max_new_tokens,
                         temperature=o.temperature, top_k=o.top_k, seed=o.seed, step=o.step,
                         num_samples=o.num_samples)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=command_line.parse)
