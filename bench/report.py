"""The performance page, docs/performance.md, rendered from bench/results/*.json.

  python -m bench.report          # the page's Markdown, on stdout
  python -m bench.report --write  # writes it to docs/performance.md
  python -m bench.report --check  # exit 1 if docs/performance.md is not what it would write

The page's words are the template bench/performance.md.j2 (Jinja); every figure in it,
and every ratio or share beside one (DiLoCo / plain, % above sync, a target met or
missed), comes from bench/figures/, whose functions read the results files. So the page
cannot drift from the results. Each results file must say where it came from (`command`,
`date`, `machine`: bench/harness.py's `provenance` writes them); a file without them, or
one that no section renders, stops the report with an error naming the file. A run the
page must no longer show carries `"withdrawn": "reason"` in its file. After a bench
writes new results, run --write: tests/test_performance_page.py fails while the page is
stale. The page has tables only: the plots some benches write beside their JSON are for
whoever ran them, and git ignores them.
"""

from __future__ import annotations

import argparse
import os
import sys

import jinja2

from bench.figures import link
from bench.figures import live
from bench.figures import markdown
from bench.figures import planner
from bench.figures import quality
from bench.figures import runs
from bench.figures import training
from bench.figures.results import PROVENANCE  # noqa: F401  (the tests read it here)
from bench.figures.results import RESULTS
from bench.figures.results import Results
from bench.figures.results import ResultsError
from bench.figures.results import shown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "performance.md")
TEMPLATE = "performance.md.j2"  # in bench/

# The template's name for each section's figures -> the function that reads them.
SECTIONS = {
    "overhead": training.overhead, "overhead_peer": training.overhead_peer,
    "outer_step": training.outer_step, "wire": training.wire, "checkpoint": training.checkpoint,
    "wan": link.wan, "wan_wire": link.wan_wire, "wan_sparseloco": link.wan_sparseloco,
    "quality": quality.quality, "quality_sweep": quality.sweep, "quality_long": quality.long,
    "quality_tree": quality.tree,
    "eta": runs.eta, "restart": runs.restart, "chaos": runs.chaos,
    "stragglers": runs.stragglers, "models": training.models, "memory": training.memory,
    "data": training.data, "linkdrop": runs.linkdrop, "poison": runs.poison,
    "peer": runs.peer, "plan": planner.plan, "leave": live.leave, "hosts": live.hosts, "sizes": live.sizes,
    "wan_live": live.wan_live,
    "churn": live.churn, "churn_uninterrupted": live.churn_uninterrupted,
    "startup": runs.startup, "peer_wan": link.peer_wan,
    "inner_step": training.inner_step, "gpu_check": training.gpu_check,
}


def render(results_dir: str = RESULTS) -> str:
  """The page's Markdown from the results files in `results_dir`. Raises ResultsError
  naming the file when one lacks its provenance or no section renders it."""
  results = Results(results_dir)
  figures = {name: section(results) for name, section in SECTIONS.items()}
  machines = sorted({d["machine"] for d in results.files.values()})
  page = template().render(figures, machines=machines, files=results)
  unrendered = sorted(set(results.files) - results.rendered)
  if unrendered:
    raise ResultsError(f"{shown(results.path(unrendered[0]))}: on no section of the page "
                       "(add its figures to bench/figures/ and its words to "
                       f"bench/{TEMPLATE})")
  ignored = results.unhonoured()
  if ignored:
    raise ResultsError(f"{shown(results.path(ignored[0]))}: withdraws a run or figure that "
                       "its section shows (bench/figures/ applies no withdrawal there)")
  return markdown.reflow(page) + "\n"


def template() -> jinja2.Template:
  env = jinja2.Environment(
      loader=jinja2.FileSystemLoader(os.path.join(REPO, "bench")),
      undefined=jinja2.StrictUndefined,  # a misspelt figure fails, never prints as nothing
      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
  env.filters.update(markdown.FILTERS)
  return env.get_template(TEMPLATE)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group()
  what.add_argument("--write", action="store_true", help=f"write {shown(PAGE)}")
  what.add_argument("--check", action="store_true",
                    help=f"exit 1 if {shown(PAGE)} differs from what --write would write")
  parser.add_argument("--results", default=RESULTS, help="the results directory")
  args = parser.parse_args(argv)
  try:
    page = render(args.results)
  except ResultsError as e:
    print(f"bench/report.py: {e}", file=sys.stderr)
    return 1
  if args.check:
    if current(PAGE) != page:
      print(f"{shown(PAGE)} is stale: run python -m bench.report --write", file=sys.stderr)
      return 1
  elif args.write:
    with open(PAGE, "w", encoding="utf-8") as f:
      f.write(page)
    print(f"wrote {shown(PAGE)}")
  else:
    sys.stdout.write(page)
  return 0


def current(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except FileNotFoundError:
    return None


if __name__ == "__main__":
  sys.exit(main())
