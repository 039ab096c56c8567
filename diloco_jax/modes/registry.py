"""Every mode by name: `config.mode` -> its driver (`base.Driver`), and the modes that have
a trait.

The mode list is `names.DRIVER_PATHS`, whose drivers this module imports: whatever must
know a mode (config validation, the planner, `simulate`, the resume) asks its driver's
traits here rather than naming it, and builds the names its messages list from `names()`.
Adding a mode: its driver in one module of this folder, and one line in `names.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from diloco_jax.modes import base
from diloco_jax.modes import names as names_lib
from diloco_jax.modes import outer


def _load(path: str) -> type[base.Driver]:
  """The driver class at "module:Class" of this folder."""
  module, _, cls = path.partition(":")
  return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


DRIVERS: dict[str, type[base.Driver]] = {
    mode: _load(path) for mode, path in names_lib.DRIVER_PATHS.items()}


def driver(mode: str) -> type[base.Driver]:
  """The driver class of `mode`; a KeyError names the modes there are."""
  try:
    return DRIVERS[mode]
  except KeyError:
    raise KeyError(f"mode {mode!r}: one of {tuple(DRIVERS)}") from None


def rule(mode: str) -> type | None:
  """The `algo.diloco` rule whose round is `mode` (None: streaming's fragments, ddp's steps)."""
  found = driver(mode)
  return found.rule_class if issubclass(found, outer.OuterStep) else None


def names(where: Callable[[type[base.Driver]], Any] = lambda d: True) -> tuple[str, ...]:
  """The modes whose driver `where` holds true of, in this registry's order."""
  return tuple(mode for mode, d in DRIVERS.items() if where(d))


def listed(modes: Sequence[str], last: str = "or", quoted: bool = True) -> str:
  """"'sync', 'delayed' or 'eager'": modes as an error message lists them."""
  words = [repr(m) if quoted else m for m in modes] or ["none"]
  return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"
