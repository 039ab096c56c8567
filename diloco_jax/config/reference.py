"""The config reference page (docs/config-reference.md), generated from the schema.

`schema.field_docs` reads each field's meaning from the comment on the line that declares
it, which is also what `--print_config` prints; this module lays the same text out as
Markdown tables, so the page cannot say something the schema does not.

  python -m diloco_jax.config.reference           # print the page
  python -m diloco_jax.config.reference --write   # write docs/config-reference.md
  python -m diloco_jax.config.reference --check   # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from diloco_jax.config import schema

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"

_HEAD = """\
# Config reference

Every field of the config, its default and its meaning, in the order
`get_default_config()` (in `diloco_jax/config/schema.py`) declares them. This page is
generated from the comments on those lines, the same text `--print_config` prints beside
a resolved config's values; `python -m diloco_jax.config.reference --write` regenerates it
and a test fails when it is stale. How configs and overrides work:
[configuration](configuration.md).

A field marked **yes** under *resume* may change when a run resumes from its checkpoints;
every other field must equal the checkpoint's, since it changes the math (a resumed run is
bit-identical to one never interrupted).
"""


def markdown() -> str:
  """The whole page."""
  defaults = schema.flatten(schema.get_default_config())
  resumable = set(schema.RESUMABLE_CHANGES)
  out = [_HEAD]
  group = None
  docs = schema.field_docs()
  # The top-level fields first, wherever the schema declares them (some close it), then
  # each group in the schema's order.
  order = list(dict.fromkeys(["", *map(_group, docs)]))
  for name in sorted(docs, key=lambda n: order.index(_group(n))):
    doc, notes = docs[name]
    here = _group(name)
    if here != group or notes:
      if here != group:
        out.append(f"\n## `config.{here}`" if here else "\n## Top-level fields")
        group = here
      out.extend(f"\n{_cell(note)}" for note in notes)
      out.append("\n| field | default | meaning | resume |\n|---|---|---|---|")
    resume = "yes" if name in resumable else ""
    out.append(f"| `{name}` | `{defaults[name]!r}` | {_cell(doc)} | {resume} |")
  return "\n".join(out) + "\n"


def _group(name: str) -> str:
  """"model" for config.model.x; "" for a top-level field."""
  parts = name.split(".")
  return parts[1] if len(parts) > 2 else ""


def _cell(text: str) -> str:
  """Text that cannot break a table row."""
  return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  action = parser.add_mutually_exclusive_group()
  action.add_argument("--write", action="store_true", help=f"write {PAGE.name}")
  action.add_argument("--check", action="store_true",
                      help=f"exit 1 if {PAGE.name} differs from what this prints")
  args = parser.parse_args(argv)
  page = markdown()
  if args.write:
    PAGE.write_text(page)
  elif args.check:
    if not PAGE.exists() or PAGE.read_text() != page:
      print(f"{PAGE} is stale: run python -m diloco_jax.config.reference --write")
      return 1
  else:
    sys.stdout.write(page)
  return 0


if __name__ == "__main__":
  sys.exit(main())
