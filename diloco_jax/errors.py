"""The package's failures: one base, `DilocoError`, below every layer that raises one.

An entry point runs its work in `cli.exits.run`, which catches `DilocoError` and prints
`describe(e)`: one line, `<prefix>: <message>`, then exits with `e.exit_code`. A new
failure needs only a subclass with its prefix; no entry point has a list to keep up to
date, and none ends in a traceback for an error the package raised on purpose.
"""


class DilocoError(Exception):
  """Base of every failure the package reports; its message says what is wrong, in one
  line (a ConfigError: a line per bad field).

  Attributes:
    prefix: the words `train` prints before the message: the kind of failure.
    exit_code: the process's exit status when the failure ends a command.
  """
  prefix = "Stopped"
  exit_code = 1


class ConfigError(DilocoError, ValueError):
  """A config value is invalid; the message names each bad field (e.g. config.outer.lr)."""
  prefix = "Invalid config"


def describe(e: DilocoError, prefix: str | None = None) -> str:
  """What an entry point prints for `e`: `<prefix>: <line>` for each line of its message.
  `prefix` replaces the error's own: a tool whose every failure is its input names itself
  ('sample'); '' prints the message alone."""
  prefix = e.prefix if prefix is None else prefix
  lines = str(e).splitlines() or [""]
  return "\n".join(f"{prefix}: {line}" if prefix else line for line in lines)
