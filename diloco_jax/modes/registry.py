"""Every mode by name: `config.mode` -> its driver (`base.Driver`).

Adding a mode: its driver in one module of this folder, one line in `DRIVERS`, and its
name in `config.MODES` (the config layer, below this one, validates the name).
"""

from __future__ import annotations

from diloco_jax.modes import base
from diloco_jax.modes import ddp
from diloco_jax.modes import outer
from diloco_jax.modes import streaming

DRIVERS: dict[str, type[base.Driver]] = {
    "sync": outer.OuterStep,  # sync, delayed, eager: one driver, the mode picks its rule
    "delayed": outer.OuterStep,
    "eager": outer.OuterStep,
    "streaming": streaming.StreamingOuterStep,
    "ddp": ddp.DDPRound,
}


def driver(mode: str) -> type[base.Driver]:
  """The driver class of `mode`; a KeyError names the modes there are."""
  try:
    return DRIVERS[mode]
  except KeyError:
    raise KeyError(f"mode {mode!r}: one of {tuple(DRIVERS)}") from None
