"""docs/performance.md is what bench/report.py renders from bench/results/*.json.

The page is generated, never edited by hand: a bench that writes new figures leaves the
page stale until `python bench/report.py --write` runs, and this test says so. A results
file must say where it came from (command, date, machine); the report refuses one that
does not, naming it. Both run in-process in well under a second.
"""

import json
import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import report  # noqa: E402


def test_page_is_up_to_date():
  with open(report.PAGE, encoding="utf-8") as f:
    page = f.read()
  assert page == report.render(), ("docs/performance.md is stale: run python "
                                   "bench/report.py --write")


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
