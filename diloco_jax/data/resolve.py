"""The config as a run uses it, resolved one way for every command: a prepared corpus
brings its vocabulary (`prepared.resolved`), then `config.model.init_from`'s config.json
brings the model's fields (`pretrained.resolved`). `train`, the round loop's build and
`plan` all call this, so they size the same model."""

from __future__ import annotations

import ml_collections

from diloco_jax.data import prepared
from diloco_jax.models import pretrained


def resolved(config: ml_collections.ConfigDict, given: frozenset[str] = frozenset(),
             announce: bool = False) -> ml_collections.ConfigDict:
  """A copy of `config` with what its corpus and its pretrained model decide (the config
  itself when they decide nothing). `given`: the fields set on the command line, which must
  not contradict init_from's directory; `announce`: print a line per replaced field."""
  config = prepared.resolved(config, announce=announce)
  return pretrained.resolved(config, given, announce=announce)
