"""The command line's errors, each in one line: absl's flag parsing with --help exiting 0,
and a bad flag, config override or config file named in the words of the field or file at
fault rather than in absl's and ml_collections' text (a traceback, or two lines and a
usage hint).

Every entry point parses with `parse`; `train` and `plan`, which take a --config file,
read it with `loaded_config`. What absl and ml_collections say is matched here alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import traceback
from typing import Any, TypeVar

import ml_collections
from absl import flags
from ml_collections import config_flags

from diloco_jax import config as config_lib
from diloco_jax import errors

_HELP_FLAGS = ("help", "helpshort", "helpfull", "?")

T = TypeVar("T")


class FlagError(errors.DilocoError, ValueError):
  """A command's own flag has a value it cannot take; the message names the flag
  (`--hosts=2,x: comma-separated numbers`), so it is printed alone."""
  prefix = ""


def parse(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """absl's flag parsing (an `app.run` flags_parser), with --help exiting 0 (absl exits 1
  after printing) and every bad flag or config override reported in one line."""
  try:
    return flag_values(argv)
  except SystemExit as e:
    if e.code == 1 and _asks_for_help(argv):
      sys.exit(0)
    raise
  except Exception as e:  # pylint: disable=broad-except
    # Only flags and the config file run here: whatever fails is the command line's fault,
    # and its traceback (absl's and ml_collections' frames) would say nothing more.
    sys.exit(describe(e, argv))


def no_arguments(argv: list[str]) -> None:
  """Stops on words left after the flags (absl hands them to `main`)."""
  if len(argv) > 1:
    sys.exit(f"Unexpected arguments: {argv[1:]} (flags are --name=value; see --help)")


def loaded_config(missing: str, flag_values: flags.FlagValues = flags.FLAGS
                  ) -> ml_collections.ConfigDict:
  """The config of the --config flag, or an exit with one line: `missing` when it is not
  given, what is wrong with the file when it did not load (ml_collections defers that
  error to the value's first use when no override is given)."""
  flag = flag_values["config"]
  if flag.value is None:
    sys.exit(missing)
  if not isinstance(flag.value, ml_collections.ConfigDict):
    sys.exit(config_file_error(config_flags.get_config_filename(flag),
                               getattr(flag.value, "_error", None)))
  return flag.value


def read(options: type[T], flag_values: flags.FlagValues = flags.FLAGS) -> T:
  """The parsed flags as `options`, a dataclass whose fields are named as the flags."""
  return options(**{f.name: flag_values[f.name].value for f in dataclasses.fields(options)})


def overrides(argv: list[str]) -> list[str]:
  """The fields overridden in argv: ["config.outer.lr", ...]."""
  out = []
  for a in _args(argv):
    m = re.fullmatch(r"--?(?:no)?config\.([^=]+)(=.*)?", a)
    if m:
      out.append(f"config.{m.group(1)}")
  return out


def describe(e: Exception, argv: list[str]) -> str:
  """One line that says what is wrong on the command line, for an exception raised while
  absl parsed it."""
  message = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
  path = _config_path(argv)
  if isinstance(e, OSError) and path is not None:  # the file did not load, and overrides
    return config_file_error(path, e)             # of it were given
  if isinstance(e, (KeyError, AttributeError)):   # ml_collections: an override's field
    known = config_lib.known_names()
    unknown = [n for n in overrides(argv) if n not in known]
    if unknown:
      return "\n".join(f"Invalid config: {config_lib.unknown_field(n)}" for n in unknown)
  if isinstance(e, flags.Error):
    return _flag_error(e, message)
  if path is not None and _in_config_file(e, path):
    return config_file_error(path, e)
  if path is not None and "get_config" in message:
    return f"Config file {path}: defines no get_config() returning the config"
  return f"Invalid config: {type(e).__name__}: {message}"


def _flag_error(e: flags.Error, message: str) -> str:
  """absl's error for one flag, in the words of the config field or file at fault."""
  # absl: "flag --config.inner_steps=abc: invalid literal for int() with base 10: 'abc'".
  m = re.fullmatch(r"flag --(config\.[\w.]+)=(.*?): (.*)", message)
  if m:
    return f"Invalid config: {m.group(1)} = {m.group(2)!r}: {_expected(m.group(1), m.group(3))}"
  m = re.fullmatch(r"flag --config=(.*?): Error whilst parsing config file: (.*)", message)
  if m:  # ml_collections re-raised get_config()'s ValueError or TypeError as text
    path = m.group(1).split(":", 1)[0]
    lines = [line for file, line in re.findall(r'File "([^"]+)", line (\d+)', str(e))
             if os.path.abspath(file) == os.path.abspath(path)]
    where = f", line {lines[-1]}" if lines else ""
    return f"Config file {path}{where}: " + _last_line(str(e))
  return f"Invalid flags: {message} (see --help)"


def config_file_error(path: str, e: BaseException | None) -> str:
  """One line for a config file that did not load."""
  if not path:
    return "Config file not given: --config is empty (e.g. --config=configs/tiny.py)"
  if not os.path.exists(path):
    return f"Config file not found: {path}"
  if os.path.isdir(path):
    return f"Config file is a directory: {path}"
  where = ""
  if isinstance(e, SyntaxError) and e.lineno:
    where = f", line {e.lineno}"
  elif e is not None:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if os.path.abspath(f.filename) == os.path.abspath(path)]
    where = f", line {lines[-1]}" if lines else ""
  cause = e
  while isinstance(cause, OSError) and cause.__cause__ is not None:
    cause = cause.__cause__  # ml_collections wraps the file's error in OSErrors
  detail = f"{type(cause).__name__}: {_last_line(str(cause))}" if cause else "did not load"
  return f"Config file {path}{where}: {detail}"


def _args(argv: list[str]) -> list[str]:
  """The flags of argv (absl stops at '--')."""
  args = argv[1:]
  return args[:args.index("--")] if "--" in args else args


def _asks_for_help(argv: list[str]) -> bool:
  return any(a.lstrip("-").split("=")[0] in _HELP_FLAGS for a in _args(argv)
             if a.startswith("-"))


def _config_path(argv: list[str]) -> str | None:
  """The value of --config in argv (the last one), without a ':config_string'."""
  path, args = None, _args(argv)
  for i, a in enumerate(args):
    name, eq, value = a.lstrip("-").partition("=")
    if a.startswith("-") and name == "config":
      path = value if eq else (args[i + 1] if i + 1 < len(args) else "")
  return None if path is None else path.split(":", 1)[0]


def _expected(name: str, parse_error: str) -> str:
  """What a config field's value must be, from its default's type."""
  default: Any = config_lib.flatten(config_lib.get_default_config()).get(name)
  if isinstance(default, bool):
    return "must be true or false"
  if isinstance(default, int):
    return "must be an int"
  if isinstance(default, float):
    return "must be a number"
  if default is None and "ConfigDict" in parse_error:
    return "is a group of fields: set each one, e.g. --" + name + ".<field>=..."
  return parse_error


def _last_line(text: str) -> str:
  lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
  return lines[-1] if lines else text


def _in_config_file(e: BaseException, path: str) -> bool:
  """Whether `e` was raised by the code of the config file at `path`."""
  target = os.path.abspath(path)
  if isinstance(e, SyntaxError) and e.filename:
    return os.path.abspath(e.filename) == target
  return any(os.path.abspath(frame.filename) == target
             for frame in traceback.extract_tb(e.__traceback__))
