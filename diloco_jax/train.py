"""Entry point: python -m diloco_jax.train --config=configs/tiny.py --workdir=DIR.

On several hosts, run the same command on every host with --coordinator_address,
--num_hosts and --host_id (or DILOCO_* environment variables, or under SLURM with none).
"""

import faulthandler
import os
import signal
import sys
import traceback

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from diloco_jax import config as config_lib
from diloco_jax import checkpoint
from diloco_jax import dispatch
from diloco_jax import distributed
from diloco_jax import elastic
from diloco_jax import skips
from diloco_jax import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py); override fields with --config.x=y.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, events and plots.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of host 0's coordination service, the same on every host "
    "(env DILOCO_COORDINATOR_ADDRESS). Unset with --num_hosts unset: one host, or SLURM.")
_NUM_HOSTS = flags.DEFINE_integer("num_hosts", None, "Hosts in the job (env DILOCO_NUM_HOSTS).")
_HOST_ID = flags.DEFINE_integer("host_id", None,
                                "This host's index in [0, num_hosts) (env DILOCO_HOST_ID).")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", 300, "Seconds to wait for every host to join at start-up.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds without a heartbeat after which a host counts as dead "
    "and the job stops.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where is it stuck?
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO
    logging.set_verbosity(logging.WARNING)
  cluster = distributed.Cluster(
      coordinator_address=_COORDINATOR.value, num_hosts=_NUM_HOSTS.value,
      host_id=_HOST_ID.value, initialization_timeout=_INIT_TIMEOUT.value,
      heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
  config = _CONFIG.value
  try:
    if config.elastic:
      elastic.enable(config.elastic_timeout)
    distributed.initialize(cluster)
    multi_host_elastic = config.elastic and jax.process_count() > 1
    if multi_host_elastic and elastic.is_returning():
      elastic.return_and_wait()
      _exit(elastic.EXIT_RESTART)
    # Before validation: hosts that disagree must all stop, not wait for each other.
    distributed.check_same_config(config, timeout_s=_INIT_TIMEOUT.value)
    trainer.train_and_evaluate(config, _WORKDIR.value)
    if multi_host_elastic:
      elastic.finish()
  except trainer.RestartForRejoin:
    _exit(elastic.EXIT_RESTART)
  except config_lib.ConfigError as e:
    sys.exit(f"Invalid config:\n{e}")
  except distributed.StartupError as e:
    sys.exit(f"Start-up failed: {e}")
  except checkpoint.CheckpointError as e:
    sys.exit(f"Checkpoint error: {e}")
  except skips.BadPseudoGradientError as e:
    sys.exit(f"Stopped: {e}")
  except dispatch.CollectiveError as e:
    # A peer is gone: exit now rather than wait at JAX's shutdown barrier for a host that
    # will never arrive (which would end in an abort at the heartbeat timeout).
    traceback.print_exc()
    sys.stderr.write(f"Stopped: {e}\nAnother host failed or was killed: see its log.\n")
    _exit(1)


def _exit(code: int) -> None:
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(code)


if __name__ == "__main__":
  app.run(main)
