"""Entry point: python -m diloco_jax.train --config=configs/tiny.py --workdir=DIR.

Override any field with --config.a.b=value; --print_config prints every field with its
value and meaning, then exits. On several hosts, run the same command on every host with
--coordinator_address, --num_hosts and --host_id (or DILOCO_* environment variables, or
under SLURM with none).

A bad flag or config stops the run with one line on stderr and exit status 1, before
anything is compiled.
"""

import faulthandler
import os
import re
import signal
import sys
import traceback

import ml_collections
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

# Only what the flags, --help and --print_config need: jax, orbax and the trainer take a
# second or more to import, and `main` imports them once it knows it will train.
from diloco_jax import config as config_lib
from diloco_jax import errors
from diloco_jax.runtime import hostmem
from diloco_jax.runtime import quiet

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Required: the config file (configs/*.py); override its fields with "
    "--config.a.b=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Required (but with --print_config): the directory for checkpoints, "
    "metrics, events and plots.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of host 0, the same on every host (env DILOCO_COORDINATOR_ADDRESS): host 0 "
    "serves the job's membership coordinator there (ddp: jax.distributed's coordination "
    "service). Unset with --num_hosts unset: one host, or SLURM.")
_NUM_HOSTS = flags.DEFINE_integer("num_hosts", None, "Hosts in the job (env DILOCO_NUM_HOSTS).")
_HOST_ID = flags.DEFINE_integer("host_id", None,
                                "This host's index in [0, num_hosts) (env DILOCO_HOST_ID).")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", 300, "Seconds to wait for every host to join at start-up.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", None, "Seconds without a heartbeat after which a host counts as "
    "dead: host 0's coordinator drops it and the others train on (default 10); ddp: the job "
    "stops (jax.distributed's, default 100).")
_RESTART = flags.DEFINE_bool(
    "restart_from_scratch", False, "Move the workdir's previous run (checkpoints, metrics, "
    "events, run.json) into workdir/previous/<time>/ and train from round 1. Without it, a "
    "workdir whose checkpoints cannot be read is refused rather than trained again.")
_LINK_TIMEOUT = flags.DEFINE_integer(
    "link_timeout", None, "ddp: seconds a host may be cut off from the others (a network "
    "outage) before every host stops with 'link lost' and exit code 1, for a restart "
    "(launch/local.py --max_restarts) to resume from the newest checkpoint; shorter "
    "outages are survived. Default: 40% of --heartbeat_timeout; 0: off "
    "(env DILOCO_LINK_TIMEOUT).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "Directory of JAX's persistent compilation cache, so that a "
    "run started again (after a preemption, a failure) loads its compiled programs instead "
    "of compiling them: default WORKDIR/compilation_cache; 'none': off. The environment's "
    "JAX_COMPILATION_CACHE_DIR, if set, is used instead.")
_JOIN_TOKEN_FILE = flags.DEFINE_string(
    "join_token_file", None, "File whose first line is the job's join token, the same on "
    "every host: a host with another token (or none) is refused by every host. Or set env "
    "DILOCO_JOIN_TOKEN_FILE, or DILOCO_JOIN_TOKEN to the token itself; never on the command "
    "line, where `ps` shows it. Unset: the job is unauthenticated (docs/security.md).")
_MEMBERSHIP = flags.DEFINE_string(
    "membership", None, "host:port of a membership coordinator on an always-on machine "
    "(python -m diloco_jax.membership.coordinator), the same on every host (env "
    "DILOCO_MEMBERSHIP): then no training host is the job's seat, and any may die while the "
    "others train on (docs/fault-tolerance.md). Unset: host 0 serves one at "
    "--coordinator_address.")
_MIN_HOSTS = flags.DEFINE_integer(
    "min_hosts", None, "Train once this many of the --num_hosts hosts have registered "
    "(default: all of them); host ids up to --num_hosts - 1 that start later join the "
    "running job at a round boundary, each with its own data shards.")
_WIRE_ADDRESS = flags.DEFINE_string(
    "wire_address", None, "host:port where the other hosts reach this host's sums "
    "(default: this host's address toward the coordinator, a free port).")
_ALLOW_PUBLIC = flags.DEFINE_bool(
    "allow_public_coordinator", False, "Run with a coordinator address that is a public "
    "(internet-routable) address; refused without this, since anyone who reaches its port "
    "can join the job.")
_COORDINATOR_GRACE = flags.DEFINE_float(
    "coordinator_grace", None, "Seconds a host of a live job waits, keeping its state, for a "
    "membership coordinator that stopped answering (restarted by launch/local.py, systemd or "
    "a person), before it stops (default 600; env DILOCO_COORDINATOR_GRACE).")
_INSECURE = flags.DEFINE_bool(
    "insecure", False, "Run a job of several hosts without a join token although its "
    "coordinator or wire listens beyond loopback (refused without this; also "
    "DILOCO_INSECURE=1): anyone who reaches those ports could join it or write into its "
    "sums. Every host says so at start.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print every config field with its value and what it means "
    "(with --config and its overrides), then exit; --workdir is not needed.")
# --config and --workdir are required, but checked in `main` rather than by absl, whose
# check would run before --help and --print_config could answer.

_HELP_FLAGS = ("help", "helpshort", "helpfull", "?")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with --help exiting 0 and every bad flag or config override
  reported in one line (absl prints a traceback or two lines, and exits 1 on --help)."""
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    if e.code == 1 and _asks_for_help(argv):  # absl's help flags exit 1 after printing
      sys.exit(0)
    raise
  except Exception as e:  # pylint: disable=broad-except
    # Only flags and the config file run here: whatever fails is the command line's fault,
    # and its traceback (absl's and ml_collections' frames) would say nothing more.
    sys.exit(_describe_flag_error(e, argv))


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


def _overrides(argv: list[str]) -> list[str]:
  """The fields overridden in argv: ["config.outer.lr", ...]."""
  out = []
  for a in _args(argv):
    m = re.fullmatch(r"--?(?:no)?config\.([^=]+)(=.*)?", a)
    if m:
      out.append(f"config.{m.group(1)}")
  return out


def _describe_flag_error(e: Exception, argv: list[str]) -> str:
  """One line that says what is wrong on the command line, for an exception raised while
  absl parsed it."""
  message = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
  path = _config_path(argv)
  if isinstance(e, OSError) and path is not None:  # the file did not load, and overrides
    return _config_file_error(path, e)            # of it were given
  if isinstance(e, (KeyError, AttributeError)):   # ml_collections: an override's field
    known = config_lib.known_names()
    unknown = [n for n in _overrides(argv) if n not in known]
    if unknown:
      return "\n".join(f"Invalid config: {config_lib.unknown_field(n)}" for n in unknown)
  if isinstance(e, flags.Error):
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
  if path is not None and _in_config_file(e, path):
    return _config_file_error(path, e)
  if path is not None and "get_config" in message:
    return f"Config file {path}: defines no get_config() returning the config"
  return f"Invalid config: {type(e).__name__}: {message}"


def _expected(name: str, parse_error: str) -> str:
  """What a config field's value must be, from its default's type."""
  default = config_lib.flatten(config_lib.get_default_config()).get(name)
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


def _config_file_error(path: str, e: BaseException | None) -> str:
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


def main(argv):
  if len(argv) > 1:
    sys.exit(f"Unexpected arguments: {argv[1:]} (flags are --name=value; see --help)")
  config = _CONFIG.value
  if config is None:
    sys.exit("Missing --config: the config file to run, e.g. --config=configs/tiny.py")
  if not isinstance(config, ml_collections.ConfigDict):  # the file did not load
    sys.exit(_config_file_error(config_flags.get_config_filename(flags.FLAGS["config"]),
                                getattr(config, "_error", None)))
  if _PRINT_CONFIG.value:
    print(config_lib.format_config(config))
    return
  if not _WORKDIR.value:
    sys.exit("Missing --workdir: the directory for checkpoints, metrics and plots, e.g. "
             "--workdir=/tmp/diloco_tiny")
  _check_init_from(config, frozenset(_overrides(sys.argv)))
  # Third-party lines are left out unless --verbosity asks for them; before jax is
  # imported, since C++ reads its log level once.
  if not flags.FLAGS["verbosity"].present:
    quiet.quiet_preemption_logs()
  # pylint: disable=import-outside-toplevel
  import jax

  from diloco_jax import compile_cache
  from diloco_jax.checkpoints import shared_dir
  from diloco_jax.checkpoints import store
  from diloco_jax.loop import trainer
  from diloco_jax.membership import start as start_lib
  from diloco_jax.runtime import cluster
  from diloco_jax.wire import dispatch
  # pylint: enable=import-outside-toplevel
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where is it stuck?
  host_id = _HOST_ID.value  # known before the hosts meet, where given
  if host_id is None and os.environ.get("DILOCO_HOST_ID", "").isdigit():
    host_id = int(os.environ["DILOCO_HOST_ID"])
  compile_cache.use(_COMPILATION_CACHE.value, _WORKDIR.value, host_id)
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO
    logging.set_verbosity(logging.WARNING)
  spec = cluster.Cluster(
      coordinator_address=_COORDINATOR.value, num_hosts=_NUM_HOSTS.value,
      host_id=_HOST_ID.value, initialization_timeout=_INIT_TIMEOUT.value,
      heartbeat_timeout=_HEARTBEAT_TIMEOUT.value, link_timeout=_LINK_TIMEOUT.value,
      join_token_file=_JOIN_TOKEN_FILE.value, allow_public_coordinator=_ALLOW_PUBLIC.value,
      insecure=_INSECURE.value, coordinator_grace=_COORDINATOR_GRACE.value)
  options = start_lib.Options(
      membership=_MEMBERSHIP.value or os.environ.get("DILOCO_MEMBERSHIP") or None,
      wire_address=_WIRE_ADDRESS.value, min_hosts=_MIN_HOSTS.value,
      last_epoch=store.last_epoch(_WORKDIR.value, host_id) if host_id is not None else 0)
  world = None
  try:
    # A save waiting for a host at a barrier gives up with the save's own timeout (orbax,
    # on the shared workdir of a single host or of ddp's hosts).
    shared_dir.set_barrier_timeout(config.checkpoint.timeout)
    # Before validation: hosts that disagree must all stop, not wait for each other.
    world = start_lib.start(config, spec, options)
    trainer.train_and_evaluate(config, _WORKDIR.value, restart_from_scratch=_RESTART.value,
                               world=world)
    if world.live:
      # Everything is written and the lease given back. Host 0 serves its coordinator
      # until the others have left; then every host exits now, not after the
      # interpreter's teardown, in which a second SIGTERM (the rest of the job being
      # stopped) would find no handler and kill a host that has already left cleanly.
      start_lib.finish(world)
      _exit(0)
    if world.num_hosts > 1:
      cluster.leave_together()
  except (errors.DilocoError, dispatch.CollectiveError) as e:
    _stopped(e, world)
  except KeyboardInterrupt:  # before training started (then Ctrl-C asks for a checkpoint)
    _fail("Interrupted (Ctrl-C) before training started; nothing was trained", code=130)


def _check_init_from(config: ml_collections.ConfigDict, given: frozenset[str]) -> None:
  """A model flag on the command line that contradicts `config.model.init_from`'s
  config.json stops the run here, in one line (every host reads the same directory)."""
  if not config.model.init_from:
    return
  from diloco_jax.data import resolve  # pylint: disable=import-outside-toplevel
  try:
    resolve.resolved(config, given)
  except config_lib.ConfigError as e:
    sys.exit(f"Invalid config: {e}")


def _stopped(e: Exception, world) -> None:
  """Ends the process with the one line that says why the run stopped (`e`: the package's
  failure, or a cross-host op's, whose cause says what failed), no traceback."""
  from diloco_jax.checkpoints import store  # pylint: disable=import-outside-toplevel
  from diloco_jax.wire import dispatch  # pylint: disable=import-outside-toplevel
  if not isinstance(e, dispatch.CollectiveError):
    _fail(errors.describe(e), e.exit_code)
  cause = e.__cause__
  if isinstance(cause, store.CheckpointError):  # a save on the dispatch thread
    _fail(f"Checkpoint error: {cause}")
  if world is not None and world.live:
    _fail(f"Stopped: {cause or e}")
  import jax  # pylint: disable=import-outside-toplevel  # main has imported it
  if jax.process_count() == 1:
    _fail(f"Stopped: {e}")
  # ddp: a peer is gone. Exit now rather than wait at JAX's shutdown barrier for a host
  # that will never arrive (which would end in an abort at the heartbeat timeout).
  sys.stderr.write(f"Stopped: {e}\nAnother host failed or was killed: see its log.\n")
  _exit(1)


def _fail(message: str, code: int = 1) -> None:
  """The one line that says why the run stopped, and nothing after it: one host exits at
  once (orbax's threads would print shutdown noise); several hosts, which all stop on the
  same error, meet at JAX's shutdown barrier as usual."""
  sys.stderr.write(message + "\n")
  import jax  # pylint: disable=import-outside-toplevel  # main has imported it
  if jax.process_count() > 1:
    sys.exit(code)
  _exit(code)


def _exit(code: int) -> None:
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(code)


if __name__ == "__main__":
  # Only the trainer's own process is started again for huge pages (a library import never
  # is): here, before jax is imported, that costs the flag modules' imports alone.
  hostmem.restart_with_huge_pages()
  app.run(main, flags_parser=parse_flags)
