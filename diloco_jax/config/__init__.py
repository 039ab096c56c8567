"""The config: its schema (every field, its default and meaning) and its validation.

`from diloco_jax import config as config_lib; config_lib.get_default_config()` is how a
config file starts; `config_lib.validate(config)` checks one.
"""

from diloco_jax.config.checks import validate
from diloco_jax.config.schema import *  # noqa: F403 -- the schema's names are the config's
from diloco_jax.config.schema import __all__ as _schema_names

__all__ = ["validate", *_schema_names]
