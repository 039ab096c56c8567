"""Third-party imports without the optional packages they would pull in on the start's
path (measured on 2 CPU cores): tensorboardX imports torch where it is installed (about
1 s), grain imports orbax (0.1 s; the checkpoints import it at their first save)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def without(*names: str) -> Iterator[None]:
  """Imports inside see the modules `names` as not installed: `import name` raises
  ImportError, which the packages above catch (they only register extras for it). A
  module already imported is left as it is, and every name is importable again after."""
  hidden = [name for name in names if name not in sys.modules]
  for name in hidden:
    sys.modules[name] = None  # type: ignore[assignment]  # the import system's "absent"
  try:
    yield
  finally:
    for name in hidden:
      if sys.modules.get(name, 0) is None:
        del sys.modules[name]
