"""The entry points' shared parts (diloco_jax/cli): every line the command line's errors
produce, the one mapping from a failure to its line and exit status, and a cross-host
failure that ends `train` in its `Stopped:` line with no traceback. The commands'
own lines are tested with the commands (test_errors, test_sample, test_export, test_plan,
test_prepare)."""

import ast
import dataclasses
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax.checkpoints import store
from diloco_jax.cli import command_line
from diloco_jax.cli import exits
from diloco_jax.wire import dispatch

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = "--config=configs/tiny.py"


def _flag_values(args: list[str]) -> flags.FlagValues:
  """The flags of `train` that the errors name (--config and --workdir), on their own
  FlagValues: ml_collections reads the overrides from `sys_argv`."""
  sys.modules.pop("config_config", None)  # ml_collections' module of the last file loaded
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                  sys_argv=["prog", *args])
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  return fv


def parse_error(*args: str) -> str:
  """What `command_line.parse` exits with for `args`: its one line (or a line per field)."""
  with pytest.raises(SystemExit) as e:
    command_line.parse(["prog", *args], _flag_values(list(args)))
  assert isinstance(e.value.code, str), e.value.code
  return e.value.code


@pytest.fixture
def config_files(tmp_path):
  files = {"name_error.py": "def get_config():\n  return undefined_name\n",
           "syntax.py": "def get_config(:\n  pass\n",
           "raises.py": "def get_config():\n  raise ValueError('lr must be > 0')\n",
           "no_get_config.py": "x = 1\n",
           "returns_none.py": "def get_config():\n  return None\n"}
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  (tmp_path / "a_directory").mkdir()
  return tmp_path


# ------------------------------------------------------------- the command line's errors

def test_an_unknown_field_is_named_with_the_likeliest_one():
  assert parse_error(TINY, "--config.outer.lrr=0.5") == (
      "Invalid config: config.outer.lrr: unknown field; did you mean config.outer.lr?")
  assert parse_error(TINY, "--config.outer.lrr=0.5", "--config.outr.lr=1").splitlines() == [
      "Invalid config: config.outer.lrr: unknown field; did you mean config.outer.lr?",
      "Invalid config: config.outr.lr: unknown field; did you mean config.outer.lr?"]


@pytest.mark.parametrize("override, expected", [
    ("--config.inner_steps=abc", "config.inner_steps = 'abc': must be an int"),
    ("--config.outer.lr=fast", "config.outer.lr = 'fast': must be a number"),
    ("--config.outer.nesterov=maybe", "config.outer.nesterov = 'maybe': must be true or false"),
    ("--config.outer=1", "config.outer = '1': is a group of fields: set each one, e.g. "
     "--config.outer.<field>=..."),
])
def test_a_value_of_the_wrong_type_says_what_the_field_takes(override, expected):
  assert parse_error(TINY, override) == f"Invalid config: {expected}"


def test_a_bad_flag_is_absls_words_in_one_line():
  assert parse_error("--bogus=1") == (
      "Invalid flags: Unknown command line flag 'bogus' (see --help)")
  assert parse_error("--workdir") == (
      "Invalid flags: Missing value for flag --workdir (see --help)")


def test_a_config_file_that_is_not_there(config_files):
  # With an override, ml_collections loads the file while parsing, and fails there.
  assert parse_error("--config=configs/nope.py", "--config.seed=1") == (
      "Config file not found: configs/nope.py")
  assert parse_error("--config=", "--config.seed=1") == (
      "Config file not given: --config is empty (e.g. --config=configs/tiny.py)")
  directory = config_files / "a_directory"
  assert parse_error(f"--config={directory}", "--config.seed=1") == (
      f"Config file is a directory: {directory}")


def test_a_config_file_that_fails_names_its_line(config_files):
  path = config_files / "name_error.py"
  for args in ([], ["--config.seed=1"]):
    assert parse_error(f"--config={path}", *args) == (
        f"Config file {path}, line 2: NameError: name 'undefined_name' is not defined")
  path = config_files / "syntax.py"
  assert parse_error(f"--config={path}", "--config.seed=1").startswith(
      f"Config file {path}, line 1: SyntaxError: invalid syntax")
  path = config_files / "raises.py"  # ml_collections re-raises a ValueError as text
  assert parse_error(f"--config={path}") == (
      f"Config file {path}, line 2: ValueError: lr must be > 0")


def test_a_config_file_without_a_config(config_files):
  path = config_files / "no_get_config.py"
  assert parse_error(f"--config={path}", "--config.seed=1") == (
      f"Config file {path}: defines no get_config() returning the config")
  # Anything else that fails while parsing: its type and message, in one line.
  line = parse_error(f"--config={config_files / 'returns_none.py'}", "--config.seed=1")
  assert line.startswith("Invalid config: KeyError: ") and "\n" not in line, line


def test_a_config_file_that_did_not_load_is_named_at_its_first_use():
  """Without an override, ml_collections parses the flag without loading the file: the
  entry point's `loaded_config` says what is wrong instead of a traceback at first use."""
  fv = _flag_values([TINY.replace("tiny", "nope")])
  command_line.parse(["prog", TINY.replace("tiny", "nope")], fv)
  with pytest.raises(SystemExit, match="^Config file not found: configs/nope.py$"):
    command_line.loaded_config("Missing --config", fv)
  fv = _flag_values([])
  command_line.parse(["prog"], fv)
  with pytest.raises(SystemExit, match="^Missing --config$"):
    command_line.loaded_config("Missing --config", fv)
  fv = _flag_values([TINY, "--config.seed=7"])
  command_line.parse(["prog", TINY, "--config.seed=7"], fv)
  assert command_line.loaded_config("Missing --config", fv).seed == 7


def test_words_after_the_flags():
  command_line.no_arguments(["prog"])
  with pytest.raises(SystemExit, match=r"^Unexpected arguments: \['extra'\] \(flags are "
                     r"--name=value; see --help\)$"):
    command_line.no_arguments(["prog", "extra"])


def test_the_overrides_of_a_command_line():
  assert command_line.overrides(["prog", TINY, "--config.outer.lr=1", "--noconfig.x.y",
                                 "-config.seed=2", "--workdir=w", "--", "--config.z=1"]) == [
      "config.outer.lr", "config.x.y", "config.seed"]


def test_parsed_flags_as_a_commands_options():
  @dataclasses.dataclass(frozen=True)
  class Options:
    workdir: str | None

  fv = _flag_values([])
  command_line.parse(["prog", "--workdir=/tmp/w"], fv)
  assert command_line.read(Options, fv) == Options(workdir="/tmp/w")


def test_a_flag_error_is_its_message_alone():
  e = command_line.FlagError("--hosts=2,x: comma-separated numbers")
  assert isinstance(e, ValueError) and errors.describe(e) == str(e)


# -------------------------------------------------------------- how a command ends

SAMPLE = exits.Command(prefix="sample", interrupted="sample: interrupted")


def _collective(cause: BaseException) -> dispatch.CollectiveError:
  e = dispatch.CollectiveError(3, "cross-host sum", cause)
  e.__cause__ = cause
  return e


@dataclasses.dataclass
class _World:
  live: bool


@pytest.mark.parametrize("e, command, world, processes, expected", [
    (KeyboardInterrupt(), SAMPLE, None, 1, exits.Stop("sample: interrupted", 130)),
    (config_lib.ConfigError("config.a = 1: bad\nconfig.b: unknown"), exits.Command(), None, 1,
     exits.Stop("Invalid config: config.a = 1: bad\nInvalid config: config.b: unknown")),
    (store.CheckpointError("gone"), SAMPLE, None, 1, exits.Stop("sample: gone")),
    (store.CheckpointError("gone"), exits.Command(prefix=""), None, 1, exits.Stop("gone")),
    (OSError(28, "No space left on device"), exits.Command(prefix="prepare", also=(OSError,)),
     None, 1, exits.Stop("prepare: [Errno 28] No space left on device")),
    (_collective(store.CheckpointError("disk full")), exits.Command(), None, 1,
     exits.Stop("Checkpoint error: disk full")),
    (_collective(ConnectionError("peer 1 gone")), exits.Command(), None, 1,
     exits.Stop("Stopped: cross-host sum failed in round 3: ConnectionError: peer 1 gone")),
    (_collective(ConnectionError("host 1 dropped")), exits.Command(), _World(live=True), 1,
     exits.Stop("Stopped: host 1 dropped")),
    (_collective(ConnectionError("peer 1 gone")), exits.Command(), _World(live=False), 2,
     exits.Stop("Stopped: cross-host sum failed in round 3: ConnectionError: peer 1 gone\n"
                "Another host failed or was killed: see its log.", now=True)),
], ids=["ctrl-c", "own prefix, a line per field", "the command's prefix", "message alone",
        "also", "a save on the dispatch thread", "a collective", "live: the cause",
        "ddp: a peer gone"])
def test_the_line_and_exit_status_of_each_failure(e, command, world, processes, expected):
  assert exits.stop_for(e, command, world, processes) == expected


def test_a_failure_no_command_expects_is_not_worded():
  assert exits.stop_for(ValueError("a bug"), SAMPLE) is None
  assert exits.stop_for(OSError("a bug"), exits.Command(prefix="plan")) is None
  assert exits.stop_for(SystemExit(2), SAMPLE) is None


def test_run_returns_the_works_result_or_the_failures_status(capsys):
  command = exits.Command(prefix="prepare", exits=False)
  assert exits.run(lambda: 7, command) == 7

  def fails():
    raise _collective(ConnectionError("peer 1 gone"))
  assert exits.run(fails, command) == 1
  err = capsys.readouterr().err
  assert err == "Stopped: cross-host sum failed in round 3: ConnectionError: peer 1 gone\n"

  def bug():
    raise ZeroDivisionError("a bug")
  with pytest.raises(ZeroDivisionError):  # its traceback is what to read
    exits.run(bug, command)


def test_a_collective_error_ends_train_in_its_line_alone(tmp_path):
  """Through `train`'s main, as `python -m diloco_jax.train` runs it: the line, exit
  status 1, no traceback before it or after it."""
  script = ("from absl import app\n"
            "from diloco_jax import train\n"
            "from diloco_jax.loop import trainer\n"
            "from diloco_jax.wire import dispatch\n"
            "def failed(*args, **kwargs):\n"
            "  try:\n"
            "    raise ConnectionError('peer 1 gone')\n"
            "  except ConnectionError as e:\n"
            "    raise dispatch.CollectiveError(3, 'cross-host sum', e) from e\n"
            "trainer.train_and_evaluate = failed\n"
            "app.run(train.main, flags_parser=train.parse_flags)\n")
  proc = subprocess.run([sys.executable, "-c", script, TINY, f"--workdir={tmp_path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert (proc.returncode, proc.stdout, proc.stderr) == (
      1, "", "Stopped: cross-host sum failed in round 3: ConnectionError: peer 1 gone\n"), (
          proc.stdout + proc.stderr)


# ---------------------------------------------------------------- the commands' flags

ENTRY_POINTS = ("train", "sample", "export", "plan", "prepare")


def test_no_entry_point_keeps_state_in_module_globals():
  """The flags a command parsed reach its work as arguments (its `Options`), not through
  `global` statements."""
  found = [f"{name}.py:{node.lineno}" for name in ENTRY_POINTS
           for node in ast.walk(ast.parse((REPO / "diloco_jax" / f"{name}.py").read_text()))
           if isinstance(node, ast.Global)]
  assert found == []


@pytest.mark.parametrize("command, args", [
    ("sample", ["--workdir=w", "--prompt=a b", "--top_k=3", "--step=2"]),
    ("export", ["--workdir=w", "--output=o.safetensors", "--dtype=bfloat16"]),
    ("plan", [TINY, "--hosts=8,16", "--sweep", "--json=p.json"]),
])
def test_each_commands_options_are_its_flags(command, args):
  """Every field of a command's Options is one of its flags, and every flag but
  --config and --smoke (plan reads them itself) is a field."""
  script = (f"from absl import flags\n"
            f"from diloco_jax import {command} as c\n"
            f"from diloco_jax.cli import command_line\n"
            f"c.define_flags()\n"
            f"command_line.parse(['prog', *{args!r}])\n"
            f"own = {{f.name for f in flags.FLAGS.get_flags_for_module(c.__name__)}}\n"
            f"print(sorted(own - {{'config', 'smoke'}}))\n"
            f"import dataclasses, json\n"
            f"print(json.dumps(dataclasses.asdict(command_line.read(c.Options))))\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  names, options = proc.stdout.splitlines()
  module = importlib.import_module(f"diloco_jax.{command}")  # (defines no flag on import)
  assert names == str(sorted(f.name for f in dataclasses.fields(module.Options)))
  options = json.loads(options)
  for arg in args[1 if command == "plan" else 0:]:  # (plan's --config is not an option)
    name, eq, value = arg.lstrip("-").partition("=")
    assert str(options[name]) == value if eq else options[name] is True, (arg, options)


@pytest.mark.parametrize("command, args, expected", [
    ("sample", ["--max_new_tokens=0"], "Invalid flags: flag --max_new_tokens=0: 0 is not "
     "a positive integer (see --help)"),
    ("sample", ["extra"], "Unexpected arguments: ['extra'] (flags are --name=value; see "
     "--help)"),
    ("export", ["--workdir=w", "--output=o.safetensors", "--max_shard_size=5XB"],
     "--max_shard_size=5XB: a size such as 5GB, 500MB or 1000000 (bytes)"),
    ("plan", ["--config=configs/nope.py"], "Config file not found: configs/nope.py"),
    ("plan", [TINY, "--config.outr.lr=1"],
     "Invalid config: config.outr.lr: unknown field; did you mean config.outer.lr?"),
    ("plan", [TINY, "--step_time=0.1", "--hosts=2,x"], "--hosts=2,x: comma-separated numbers"),
], ids=["sample: a flag's bound", "sample: words", "export: its own flag",
        "plan: no config file", "plan: an unknown field", "plan: its own flag"])
def test_a_bad_command_line_is_one_line(command, args, expected):
  proc = subprocess.run([sys.executable, "-m", f"diloco_jax.{command}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert (proc.returncode, proc.stderr) == (1, expected + "\n"), proc.stdout + proc.stderr
