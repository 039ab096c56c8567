"""Entry point: python -m diloco_jax.train --config=configs/tiny.py --workdir=DIR."""

from absl import app
from absl import flags
from ml_collections import config_flags

from diloco_jax import config as config_lib
from diloco_jax import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py); override fields with --config.x=y.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, events and plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except config_lib.ConfigError as e:
    raise SystemExit(f"Invalid config:\n{e}") from None


if __name__ == "__main__":
  app.run(main)
