"""The results files of a directory, each read once and checked for where it came from.

A results file says which command wrote it, when and on what machine (bench/harness.py's
`provenance`); the page refuses one that does not. A run or one of its figures that the
page must no longer show is marked in the file itself: `"withdrawn": "reason"` on the run,
or `"withdrawn_figures": {"figure": "reason"}` for some of its figures.
"""

from __future__ import annotations

import glob
import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "bench", "results")
PROVENANCE = ("command", "date", "machine")


class ResultsError(Exception):
  """A results file the page cannot be made from; the message names the file."""


class Results:
  """The results files of a directory, each read and checked once. Calling it with a
  name (`results("wan")`) returns that file's figures and marks it as rendered."""

  def __init__(self, directory: str):
    self.directory = directory
    self.files = {os.path.basename(path)[:-len(".json")]: load(path)
                  for path in sorted(glob.glob(os.path.join(directory, "*.json")))}
    self.rendered: set[str] = set()
    self.honoured: set[int] = set()  # id() of each run whose withdrawal a section applied

  def __call__(self, name: str) -> dict:
    if name not in self.files:
      raise ResultsError(f"{shown(self.path(name))}: missing (the page renders it)")
    self.rendered.add(name)
    return self.files[name]

  def path(self, name: str) -> str:
    return os.path.join(self.directory, f"{name}.json")

  def unhonoured(self) -> list[str]:
    """The files with a withdrawal that no section applied: the page would show what
    they withdraw."""
    return [name for name, data in self.files.items()
            if any(id(run) not in self.honoured for run in withdrawing(data))]

  def error(self, name: str, what: str) -> ResultsError:
    """An error about one file, named as every error names it."""
    return ResultsError(f"{shown(self.path(name))}: {what}")


def shown(path: str) -> str:
  """A path as an error names it: from the repository's root when it is inside it."""
  path = os.path.abspath(path)
  return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def load(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise ResultsError(f"{shown(path)}: unreadable: {e}") from e
  missing = [key for key in PROVENANCE if not data.get(key)]
  if missing:
    raise ResultsError(
        f"{shown(path)}: no {', '.join(missing)}: every results file says which command "
        "wrote it, when and on what machine (bench/harness.py's provenance)")
  if not re.fullmatch(r"\d{4}-\d\d-\d\d", str(data["date"])):
    raise ResultsError(f"{shown(path)}: date {data['date']!r} is not YYYY-MM-DD")
  return data


# --- withdrawn runs and figures ---------------------------------------------------------


def kept(runs: list[dict]) -> list[dict]:
  """The runs a file still stands by: those without a `withdrawn` reason."""
  return [run for run in runs if not run.get("withdrawn")]


class Runs(dict):
  """A file's runs by name, for the page's text: asking for one the file lacks, or has
  withdrawn, is an error naming the file, not a KeyError."""

  def __init__(self, results: Results, name: str, runs: list[dict], key: str):
    super().__init__((run[key], run) for run in kept(runs))
    self.withdrawn = {run[key] for run in runs if run.get("withdrawn")}
    self.where, self.key = results.path(name), key

  def __missing__(self, value):
    why = "withdrawn" if value in self.withdrawn else "not in it"
    raise ResultsError(f"{shown(self.where)}: the page reads the run with {self.key} "
                       f"{value!r}, which is {why}")


def hidden(run: dict, figure: str) -> bool:
  """Whether one figure of a run is withdrawn (`withdrawn_figures`)."""
  return figure in run.get("withdrawn_figures", {})


def withdrawals(results: Results, name: str, runs: list[dict], key: str,
                label=str) -> list[dict]:
  """What file `name` withdraws, grouped by reason, in the file's order: for each reason
  its `items`, each a run (`label(run[key])`) withdrawn whole (`figure` None) or one
  figure of a run withdrawn."""
  groups: dict[str, dict] = {}

  def add(run: dict, reason, figure: str | None) -> None:
    if not isinstance(reason, str) or not reason.strip():
      raise results.error(name, f"{run[key]}: a withdrawal's reason must be words, not "
                          f"{reason!r}")
    if figure is not None and figure not in run:
      raise results.error(name, f"{run[key]} withdraws {figure}, a figure it does not have")
    groups.setdefault(reason, {"reason": reason, "items": []})["items"].append(
        {"run": label(run[key]), "figure": figure})

  for run in runs:
    results.honoured.add(id(run))
    if "withdrawn" in run:
      add(run, run["withdrawn"], None)
    for figure, reason in run.get("withdrawn_figures", {}).items():
      add(run, reason, figure)
  return list(groups.values())


def withdrawing(data) -> list[dict]:
  """Every object in a file's JSON that withdraws itself or some of its figures."""
  if isinstance(data, list):
    return [run for x in data for run in withdrawing(x)]
  if not isinstance(data, dict):
    return []
  here = [data] if "withdrawn" in data or "withdrawn_figures" in data else []
  return here + [run for x in data.values() for run in withdrawing(x)]
