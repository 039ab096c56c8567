"""The package's import contract: its layers, no import cycle, short modules.

Every import counts, a deferred one inside a function too: a cycle through a function body
is still a cycle (the package had `config -> model -> export -> trained -> checkpoint ->
config` that way). The check reads the source with `ast`, so it needs nothing installed
and runs in well under a second.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterable
from collections.abc import Mapping

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "diloco_jax"

# Top to bottom. A module may import from its own unit (a subpackage or a top-level
# module) and from any unit of a lower layer; units of one layer are independent.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("diloco_jax", "train", "prepare", "sample", "export", "plan"),  # entry points, the root
    ("cli",),  # what the entry points share: the command line's errors, how a command ends
    ("loop", "readback"),
    ("checkpoints", "reporting"),
    ("membership",),  # who trains together: coordinator, leases, the epoch's collective
    ("config", "planning"),  # a run judged before it exists, by its mode's traits
    ("modes",),
    ("wire", "data", "device"),
    ("runtime",),
    ("algo", "models", "corpus"),
    ("errors", "units", "digest", "_version", "compile_cache"),
)
MAX_LINES = 400


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
  """{dotted name: path} of every module of the package (a package by its __init__)."""
  found = {}
  for path in package.rglob("*.py"):
    parts = path.relative_to(package.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def imports(name: str, path: pathlib.Path, known: Iterable[str]) -> set[str]:
  """The package's modules that module `name` imports, anywhere in its body."""
  known = set(known)
  is_package = path.name == "__init__.py"
  found = set()

  def resolve(target: str) -> str | None:
    while target and target not in known:  # an attribute of a module: the module
      target = target.rpartition(".")[0]
    return target or None

  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = name.split(".") if is_package else name.split(".")[:-1]
        parent = parent[:len(parent) - node.level + 1]
        base = ".".join(parent + ([node.module] if node.module else []))
      # `from a import b` imports module a.b if there is one, else a's attribute b.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    for target in targets:
      if target.split(".")[0] == PACKAGE.name and (module := resolve(target)) != name:
        found.add(module)
  return found


def graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
  found = modules(package)
  return {name: imports(name, path, found) for name, path in found.items()}


def unit(module: str) -> str:
  """The layer unit a module belongs to: its subpackage, or itself at the top level."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(edges: Mapping[str, Iterable[str]],
                     layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
  level = {u: i for i, units in enumerate(layers) for u in units}
  wrong = []
  for a, targets in sorted(edges.items()):
    for b in sorted(targets):
      ua, ub = unit(a), unit(b)
      if ua != ub and level[ua] >= level[ub]:
        how = "a peer" if level[ua] == level[ub] else "a higher layer"
        wrong.append(f"{a} imports {b} ({ub}: {how} than {ua})")
  return wrong


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def test_every_import_goes_down_the_layers():
  assert layer_violations(graph()) == []


def test_no_import_cycle():
  assert cycles(graph()) == []


def test_every_subpackage_and_top_level_module_has_a_layer():
  listed = {u for units in LAYERS for u in units}
  assert {unit(m) for m in modules()} == listed


def test_modules_are_short():
  long = {name: n for name, path in modules().items()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert long == {}, f"over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("source, expected", [
    # algo (bottom) reaching up into loop: a layer broken
    ({"algo/diloco.py": "from diloco_jax.loop import trainer\n", "loop/trainer.py": ""},
     "diloco_jax.algo.diloco imports diloco_jax.loop.trainer"),
    # wire and data are peers
    ({"wire/exchange.py": "def f():\n  import diloco_jax.data.pipeline\n",
      "data/pipeline.py": ""},
     "diloco_jax.wire.exchange imports diloco_jax.data.pipeline (data: a peer"),
])
def test_the_contract_catches_a_broken_layer(tmp_path, source, expected):
  root = tmp_path / "diloco_jax"
  for path, text in source.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
  assert any(v.startswith(expected) for v in layer_violations(graph(root)))


def test_the_contract_catches_a_cycle_through_a_deferred_import(tmp_path):
  root = tmp_path / "diloco_jax"
  (root / "models").mkdir(parents=True)
  (root / "models" / "model.py").write_text("def load():\n  from . import exported\n")
  (root / "models" / "exported.py").write_text("from diloco_jax.models import model\n")
  assert cycles(graph(root)) == [["diloco_jax.models.exported", "diloco_jax.models.model"]]


def test_importing_the_package_starts_nothing():
  """A library import runs no jax and never starts the interpreter again (the trainer's
  huge-page re-exec belongs to `python -m diloco_jax.train` alone): run again, a process
  would print its first line twice."""
  script = ("import sys; print('before', flush=True); import diloco_jax, diloco_jax.loop, "
            "diloco_jax.checkpoints, diloco_jax.reporting, diloco_jax.readback; "
            "print('jax' in sys.modules)")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        check=True, cwd=PACKAGE.parent)
  assert done.stdout.split() == ["before", "False"]


def test_a_start_imports_neither_torch_nor_orbax(tmp_path):
  """What a start imports before round 1 (the trainer, its data pipeline, host 0's metric
  writers) leaves out torch, which tensorboardX imports where installed (about 1 s), and
  orbax, which grain imports (0.1 s; the checkpoints import it at their first save).
  Both import normally afterwards."""
  script = (
      "import sys; from diloco_jax.loop import trainer; from diloco_jax.checkpoints import "
      "shared_dir; from diloco_jax.data import pipeline; from diloco_jax.reporting import "
      f"writers; writers.MetricsWriter({str(tmp_path)!r}, first_round=1).close(); "
      "print(sorted(m for m in ('torch', 'orbax.checkpoint') if m in sys.modules)); "
      "import orbax.checkpoint, grain; print('orbax', orbax.checkpoint.__version__)")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=PACKAGE.parent, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines()[0] == "[]"
  assert done.stdout.splitlines()[1].startswith("orbax ")
  assert (tmp_path / "tensorboard").is_dir()


def test_the_architecture_page_names_every_room_and_module():
  """docs/architecture.md's table has a row for every layer, naming each of its folders
  (`loop/`) or modules (`train.py`), and every module of a folder by its name (`build`)."""
  page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
  rows = [line for line in page.splitlines() if line.startswith("| ")]
  for layer in LAYERS:
    for unit in layer:
      if unit == PACKAGE.name:
        continue
      folder = PACKAGE / unit
      where = f"`{unit}/`" if folder.is_dir() else f"`{unit}.py`"
      row = next((r for r in rows if where in r.split(" | ")[1]), None)
      assert row is not None, f"docs/architecture.md: no row names {where}"
      if folder.is_dir():
        for module in sorted(folder.glob("*.py")):
          if module.stem != "__init__":
            assert f"`{module.stem}`" in row or f"`{module.stem} (" in row or (
                f"`{module.stem}." in row), f"docs/architecture.md: {unit}/{module.name}"
