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
import signal
import sys

import ml_collections
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

# Only what the flags, --help and --print_config need: jax, orbax and the trainer take a
# second or more to import, and `main` imports them once it knows it will train.
from diloco_jax import config as config_lib
from diloco_jax.cli import command_line
from diloco_jax.cli import exits
from diloco_jax.runtime import hostmem
from diloco_jax.runtime import quiet

# Read by command_line.loaded_config, which names a file that did not load.
config_flags.DEFINE_config_file(
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

TRAIN = exits.Command(
    interrupted="Interrupted (Ctrl-C) before training started; nothing was trained")
# (Once training runs, Ctrl-C asks for a checkpoint at the round's end: runtime/preemption.)


# app.run's flags_parser: --help exits 0, a bad flag or config override is one line.
parse_flags = command_line.parse


def main(argv):
  command_line.no_arguments(argv)
  config = command_line.loaded_config(
      "Missing --config: the config file to run, e.g. --config=configs/tiny.py")
  if _PRINT_CONFIG.value:
    print(config_lib.format_config(config))
    return
  if not _WORKDIR.value:
    sys.exit("Missing --workdir: the directory for checkpoints, metrics and plots, e.g. "
             "--workdir=/tmp/diloco_tiny")
  # Two steps, since a cross-host failure is worded by the world the job started.
  world = exits.run(lambda: _start(config), TRAIN)
  exits.run(lambda: _train(config, world), TRAIN, world)


def _start(config: ml_collections.ConfigDict):
  """This host's start: checks that need no device, then the hosts meet; the World."""
  _check_init_from(config, frozenset(command_line.overrides(sys.argv)))
  # Third-party lines are left out unless --verbosity asks for them; before jax is
  # imported, since C++ reads its log level once.
  if not flags.FLAGS["verbosity"].present:
    quiet.quiet_preemption_logs()
  # pylint: disable=import-outside-toplevel
  from diloco_jax import compile_cache
  from diloco_jax.checkpoints import store
  # Before the hosts meet, as `_train` needs it: its import takes a second or more, which
  # a host would otherwise spend after it has joined the others.
  from diloco_jax.loop import trainer  # noqa: F401  # pylint: disable=unused-import
  from diloco_jax.membership import start as start_lib
  from diloco_jax.runtime import cluster
  from diloco_jax.runtime import collector
  # pylint: enable=import-outside-toplevel
  collector.imported()  # the modules' objects: never walked by a collection again
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
  # Before validation: hosts that disagree must all stop, not wait for each other.
  return start_lib.start(config, spec, options)


def _train(config: ml_collections.ConfigDict, world) -> None:
  """The run, then this host's end of the job."""
  # pylint: disable=import-outside-toplevel
  from diloco_jax.loop import trainer
  from diloco_jax.membership import start as start_lib
  from diloco_jax.runtime import cluster
  # pylint: enable=import-outside-toplevel
  trainer.train_and_evaluate(config, _WORKDIR.value, restart_from_scratch=_RESTART.value,
                             world=world)
  if world.live:
    # Everything is written and the lease given back. Host 0 serves its coordinator
    # until the others have left; then every host exits now, not after the
    # interpreter's teardown, in which a second SIGTERM (the rest of the job being
    # stopped) would find no handler and kill a host that has already left cleanly.
    start_lib.finish(world)
    exits.exit_now(0)
  if world.num_hosts > 1:
    cluster.leave_together()


def _check_init_from(config: ml_collections.ConfigDict, given: frozenset[str]) -> None:
  """A model flag on the command line that contradicts `config.model.init_from`'s
  config.json stops the run (a ConfigError, in one line; every host reads the same
  directory)."""
  if not config.model.init_from:
    return
  from diloco_jax.data import resolve  # pylint: disable=import-outside-toplevel
  resolve.resolved(config, given)


if __name__ == "__main__":
  # Only the trainer's own process is started again for huge pages (a library import never
  # is): here, before jax is imported, that costs the flag modules' imports alone.
  hostmem.restart_with_huge_pages()
  app.run(main, flags_parser=parse_flags)
