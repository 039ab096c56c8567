"""docs/performance.md is what bench/report.py renders from bench/results/*.json.

The page is generated, never edited by hand: a bench that writes new figures leaves the
page stale until `python -m bench.report --write` runs, and this test says so. A results
file must say where it came from (command, date, machine); the report refuses one that
does not, naming it. What the page leaves out (a withdrawn run or figure) is said in the
results files, and the page says it left it out. All but the command line's test run
in-process in well under a second.
"""

import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from bench import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_page_is_up_to_date():
  with open(report.PAGE, encoding="utf-8") as f:
    page = f.read()
  assert page == report.render(), ("docs/performance.md is stale: run python -m "
                                   "bench.report --write")


@pytest.mark.parametrize("key", report.PROVENANCE)
def test_a_results_file_without_provenance_is_refused(tmp_path, key):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  path = results / "overhead.json"
  data = json.loads(path.read_text(encoding="utf-8"))
  del data[key]
  path.write_text(json.dumps(data), encoding="utf-8")
  with pytest.raises(report.ResultsError, match=rf"overhead\.json: no {key}"):
    report.render(str(results))
  # The command line says the same in one line, and fails.
  assert report.main([f"--results={results}"]) == 1


def test_a_results_file_on_no_section_is_refused(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "new.json").write_text(
      json.dumps({"command": "python bench/new.py", "date": "2026-01-01", "machine": "m"}),
      encoding="utf-8")
  with pytest.raises(report.ResultsError, match=r"new\.json: on no section"):
    report.render(str(results))


def copy_results(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  return results


def edit(results, name: str, change) -> None:
  """Applies `change` to the figures of results file `name`, in place."""
  path = results / f"{name}.json"
  data = json.loads(path.read_text(encoding="utf-8"))
  change(data)
  path.write_text(json.dumps(data), encoding="utf-8")


def cells(page: str, first: str) -> list[str]:
  """The cells of the one table row whose first cell is `first`."""
  rows = [line for line in page.split("\n") if line.startswith(f"| {first} | ")]
  assert len(rows) == 1, (first, rows)
  return rows[0][2:-2].split(" | ")


def test_a_withdrawn_run_or_figure_is_not_shown(tmp_path):
  """`withdrawn` on a run drops its row; `withdrawn_figures` blanks those figures of a run;
  the page says what it does not show and why, and nothing else on it changes."""
  results = copy_results(tmp_path)
  why = "ran beside another job"

  def withdraw(data):
    for row in data["rows"]:
      if row["mode"] == "none":
        row["withdrawn"] = why
      if row["mode"] == "sync-int8":
        row["withdrawn_figures"] = {"wall_s": why}
  edit(results, "wan_wire", withdraw)
  before, page = report.render(), report.render(str(results))
  none = [line for line in before.split("\n") if line.startswith("| none (reference) |")]
  int8 = cells(before, "sync, int8")
  assert len(none) == 1 and cells(page, "sync, int8") == [int8[0], "–", *int8[2:]]
  # Nothing else changed: the row gone, the wall time blanked, one paragraph more.
  diff = [line for line in difflib.unified_diff(before.split("\n"), page.split("\n"),
                                                lineterm="", n=0)
          if line[:1] in "+-" and not line.startswith(("+++", "---"))]
  removed = [line[1:] for line in diff if line[0] == "-"]
  added = [line[1:] for line in diff if line[0] == "+"]
  assert removed == [none[0], "| " + " | ".join(int8) + " |"]
  assert added[0] == "| " + " | ".join(cells(page, "sync, int8")) + " |"
  assert " ".join(" ".join(added[1:]).split()) == (
      f"Not shown: the none (reference) row and the wall time of sync, int8; this run {why}.")


def test_the_files_withdrawals_are_data():
  """What the page leaves out is said in the results files, not in the code."""
  with open(os.path.join(report.RESULTS, "wan_wire.json"), encoding="utf-8") as f:
    wire = json.load(f)
  assert {r["mode"]: r.get("withdrawn") or r.get("withdrawn_figures")
          for r in wire["rows"] if "withdrawn" in r or "withdrawn_figures" in r} == {
      "sync-bf16": "measured code that has changed since",
      "streaming-p2": {"idle_fraction": "measured code that has changed since"}}
  page = " ".join(report.render().split())
  assert ("Not shown: the sync, bf16 row and the outer-step idle of streaming P=2, τ=0, α=0 "
          "(H=20); this run measured code that has changed since.") in page
  assert ("Not shown: the file's trials baseline and keepconn, which ran code without the "
          "link watchdog.") in page
  for path in glob.glob(os.path.join(REPO, "bench", "figures", "*.py")) + [report.__file__]:
    with open(path, encoding="utf-8") as f:
      code = f.read()
    assert not re.search(r"20\d\d-\d\d-\d\d", code), f"{path}: a date in the code"


def without_outer_steps(data):
  del data["outer_steps"]


@pytest.mark.parametrize("name, change, error", [
    # a section that applies no withdrawal would show the run
    ("wan", lambda d: d["rows"][0].update(withdrawn="stale"),
     r"wan\.json: withdraws a run or figure that its section shows"),
    ("eta", lambda d: d.update(withdrawn="stale"), r"eta\.json: withdraws a run or figure"),
    # the page's text reads the run
    ("wan_wire", lambda d: [r.update(withdrawn="stale") for r in d["rows"]
                            if r["mode"] == "sync-topk"],
     r"wan_wire\.json: the page reads the run with mode 'sync-topk', which is withdrawn"),
    ("wan_wire", lambda d: d["rows"][0].update(withdrawn_figures={"speed": "stale"}),
     r"wan_wire\.json: none withdraws speed, a figure it does not have"),
    ("linkdrop", lambda d: d["trials"][1].update(withdrawn=" "),
     r"linkdrop\.json: recov: a withdrawal's reason must be words"),
    ("linkdrop", lambda d: d["trials"][1].update(withdrawn_figures={"drop_s": "stale"}),
     r"linkdrop\.json: withdraws a figure of a trial"),
    ("quality_sweep", without_outer_steps, r"quality_sweep\.json: no outer_steps"),
    ("quality", lambda d: d["outer_steps"].pop("configs/eager.py"),
     r"quality\.json: eager's configs/eager\.py has no outer step"),
])
def test_a_results_file_the_page_cannot_show_is_refused(tmp_path, name, change, error):
  results = copy_results(tmp_path)
  edit(results, name, change)
  with pytest.raises(report.ResultsError, match=error):
    report.render(str(results))
  assert report.main([f"--results={results}"]) == 1


def test_the_command_line():
  """`python -m bench.report` from the repository's root: --help names its flags, --check
  passes."""
  script = ["-m", "bench.report"]
  done = subprocess.run([sys.executable, *script, "--help"], capture_output=True, text=True,
                        timeout=60, cwd=REPO)
  assert done.returncode == 0 and "--write" in done.stdout and "--check" in done.stdout
  done = subprocess.run([sys.executable, *script, "--check"], capture_output=True, text=True,
                        timeout=60, cwd=REPO)
  assert done.returncode == 0, done.stderr


def test_the_generator_is_short_modules():
  """The words are the template's; the code that reads the figures stays in short modules."""
  paths = glob.glob(os.path.join(REPO, "bench", "figures", "*.py")) + [report.__file__]
  long = {os.path.relpath(p, REPO): n for p in paths
          if (n := len(open(p, encoding="utf-8").read().splitlines())) > 400}
  assert not long, long
