"""Python's cyclic garbage collector in a trainer: what start-up built is never walked again.

CPython's collector walks every object it tracks in a full (oldest-generation)
collection. A trainer's start leaves a few hundred thousand of them that live as long as
the process: the modules of jax, flax, optax and numpy, jax's caches, the compiled
programs' Python side. Rounds then make young garbage that survives into the oldest
generation often enough for a full collection every 20-30 s, and each walked all of
start-up's objects: 0.09-0.14 s of CPU on configs/tiny.py, 0.25-0.38 s for a host held
to 0.36 of a core (bench/churn.py's quota), a pause every other host then waits for at
its next sum. A joiner's start met two or three of them. Frozen, a full collection of
the rounds' objects took 0.01 s of CPU there (bench/overhead.py times one in its
process: 76 ms before, under 0.1 ms after).

`gc.freeze` moves every tracked object to a generation no collection walks; objects made
afterwards are collected as before. So:
  - `imported`: once jax and the trainer's modules are imported (they are never garbage);
  - `settled`: once the start is over, after one full collection, so that no garbage of
    start-up (traces dropped by `jax.clear_caches`) is frozen with what is kept.
"""

from __future__ import annotations

import gc


def imported() -> None:
  """After the imports: the modules' objects, out of every later collection's walk."""
  gc.freeze()


def settled() -> None:
  """At the end of a start (before its first round; a joiner's, before it says it is ready):
  start-up's garbage collected, then what remains frozen. The one full collection costs
  what one of the rounds' would have (0.02-0.1 s of CPU on configs/tiny.py)."""
  gc.collect()
  gc.freeze()


def released() -> None:
  """At the end of a run in a process that goes on: what was frozen is walked again, so
  that a finished trainer's cycles can be collected."""
  gc.unfreeze()
