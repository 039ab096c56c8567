"""Byte, count and time formatting for what a run prints."""


def format_duration(seconds: float) -> str:
  """1h05m, 3m07s, 42s."""
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_count(x: float) -> str:
  """1.5M, 320.0k: three significant figures and an SI suffix."""
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}"


def format_bytes(n: float) -> str:
  """Binary units: 512 bytes, 1.5 KiB, 3.2 GiB."""
  for unit in ("bytes", "KiB", "MiB", "GiB"):
    if n < 1024:
      return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:,.1f} TiB"
