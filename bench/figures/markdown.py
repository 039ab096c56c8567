"""How figures are written on the page: the template's filters, table rows, and the
reflow that fills its prose paragraphs."""

from __future__ import annotations

import re
import textwrap

# --- the template's filters: `{{ x | pct }}`, `{{ x | fmt(".3f") }}` ---------------------


def fmt(x: float, spec: str) -> str:
  """Python's format spec: `{{ x | fmt(".3f") }}`."""
  return format(x, spec)


def num(x: float, digits: int = 0) -> str:
  return f"{x:,.{digits}f}"


def pct(share: float, digits: int = 1) -> str:
  return f"{100 * share:,.0f}%" if share >= 10 else f"{100 * share:.{digits}f}%"


def dec(x: float) -> str:
  """An lr as the configs write it: 1.0, 0.7."""
  return f"{x:.1f}" if x == round(x, 1) else f"{x:g}"


def plural(n: int, word: str) -> str:
  return f"{n} {word}" + ("" if n == 1 else "s")


def change(ratio: float, digits: int = 1) -> str:
  """A ratio as a signed change: 1.089 -> +8.9%."""
  return f"{100 * (ratio - 1):+.{digits}f}%"


def above(a: float, b: float, digits: int = 1) -> str:
  """How a compares with b in words: '8.9% above', '0.2% below'."""
  return f"{abs(100 * (a / b - 1)):.{digits}f}% {'above' if a > b else 'below'}"


def mb(n: float) -> str:
  return f"{n / 1e6:.{2 if n >= 1e6 else 3}f}"


def verdict(ok: bool) -> str:
  return "met" if ok else "missed"


def bold(text: str, on: bool = True) -> str:
  return f"**{text}**" if on else text


def span(x, fmt) -> str:
  """One value, or a list's range 'lo–hi' (one value when they print alike)."""
  if not isinstance(x, list):
    return fmt(x)
  lo, hi = fmt(min(x)), fmt(max(x))
  return lo if lo == hi else f"{lo}–{hi}"


def rows(cells: list[list]) -> str:
  """A table's body, one Markdown row per list of cells (its header is the template's)."""
  return "\n".join("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |"
                   for row in cells)


def runnable(command: str) -> str:
  """A results file's command as it runs today: a bench recorded by its path (`python
  bench/NAME.py`, before bench/ was a package) runs as `python -m bench.NAME` from the
  repository's root, with the same arguments. The file keeps what was run."""
  return re.sub(r"(?<![\w/])python bench/(\w+)\.py(?=\s|$)", r"python -m bench.\1", command)


FILTERS = {f.__name__: f for f in (fmt, num, pct, dec, plural, change, above, mb, verdict,
                                    bold, rows, runnable)}

# --- the page's prose, filled -----------------------------------------------------------

# A line that starts like this is Markdown syntax (a list item, a heading, a quote).
MARKUP = re.compile(r"(\d+[.)]|[-+*>#]|=+)(\s|$)")


def reflow(page: str, width: int = 90) -> str:
  """Prose paragraphs filled to `width` (figures of any length land mid-sentence, so the
  template's lines are wrapped again rather than left ragged); tables, code and headings
  as they are."""
  page = re.sub(r"[ \t]+\n", "\n", page)  # a template line left blank but for spaces
  blocks = [b.strip("\n") for b in re.sub(r"\n{3,}", "\n\n", page).split("\n\n")]
  return "\n\n".join(b if b.startswith(("```", "|", "#")) else fill(" ".join(b.split()), width)
                     for b in blocks if b.strip())


def fill(text: str, width: int) -> str:
  for w in range(width, width // 2, -1):  # the widest fill whose lines start as prose
    lines = textwrap.wrap(text, w, break_long_words=False, break_on_hyphens=False)
    if not any(MARKUP.match(line) for line in lines):
      break
  return "\n".join(lines)
