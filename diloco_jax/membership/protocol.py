"""The coordinator's messages: how a request or an answer is signed, checked and read.

A message is two zmq frames, [body, mac]: body is canonical JSON, mac =
HMAC-SHA256(key, direction | body), the key derived from the join token (without a token: a
fixed, public key, which checks integrity only). Everything a message says is checked
before anything acts on it, in this order, so that no input, authenticated or not, can
cost more than its bytes or raise anything but `BadRequest`:

- its size (`MAX_REQUEST` bytes for a request, `MAX_ANSWER` for an answer), before the MAC;
- the MAC;
- the JSON: an object, nested at most `MAX_DEPTH` deep, with no float and no NaN or
  Infinity (every number the protocol carries is an integer);
- each field read (`integer`, `text`, `flag`, `optional_integer`): of its type (a bool is
  not an integer), within its bounds (`MAX_INT`; strings `MAX_TEXT` characters).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from diloco_jax import errors
from diloco_jax.runtime import security

C2S, S2C = b"diloco_jax coordinator request|", b"diloco_jax coordinator answer|"
NOT_THIS_KEY = "not authenticated with this job's key"
MAX_REQUEST = 16 << 10  # bytes: a register with a 255-character address is under 1 KiB
MAX_ANSWER = 4 << 20  # bytes: an epoch of thousands of members
MAX_DEPTH = 4  # an answer's epoch: {members: [{...}]}
MAX_INT = (1 << 62) - 1  # every counter and number: far from any overflow, in JSON or C
MAX_TEXT = 512  # characters of a string field (an address, a nonce, a reason)
MAX_HOSTS = 1 << 16  # host ids in a list
_NO_TOKEN_KEY = b"diloco_jax coordinator: no join token"
_MISSING = object()


class BadRequest(errors.DilocoError):
  """A request that is not authenticated, a replay, or malformed: dropped and named."""
  prefix = "Dropped"


class Malformed(BadRequest):
  """A field missing, of another type, or out of its bounds."""


def key_for(token: security.JoinToken | None) -> bytes:
  return _NO_TOKEN_KEY if token is None else token.derive_key("coordinator")


def keyed(key: bytes) -> bool:
  """Whether `key` comes from a join token (else every process knows it)."""
  return key != _NO_TOKEN_KEY


def sign(key: bytes, direction: bytes, body: dict) -> list[bytes]:
  data = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
  return [data, hmac.new(key, direction + data, "sha256").digest()]


def verify(key: bytes, direction: bytes, frames: list[bytes], limit: int | None = None) -> dict:
  """The body of a message signed with `key` in `direction`, or BadRequest naming why.
  `limit`: the body's most bytes (default: a coordinator request's or answer's)."""
  if len(frames) != 2:
    raise BadRequest(f"{len(frames)} parts, expected 2 (body, mac)")
  data, mac = frames
  if limit is None:
    limit = MAX_REQUEST if direction == C2S else MAX_ANSWER
  if len(data) > limit:
    raise BadRequest(f"{len(data)} bytes, more than the {limit} a message may have")
  if not hmac.compare_digest(mac, hmac.new(key, direction + data, "sha256").digest()):
    raise BadRequest(f"{NOT_THIS_KEY} (another join token, or none?)")
  body = loads(data)
  if not isinstance(body.get("op"), str):
    raise BadRequest("authenticated but has no 'op'")
  return body


def _no_float(text: str):
  raise BadRequest(f"a number that is not an integer ({text[:24]})")


def loads(data: bytes) -> dict:
  """A JSON object of integers, strings, booleans, nulls, lists and objects, nested at most
  MAX_DEPTH deep; BadRequest otherwise (the parser's own recursion limit stops a deeper
  text first: a RecursionError, caught)."""
  try:
    body = json.loads(data, parse_float=_no_float, parse_constant=_no_float)
  except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
    raise BadRequest(f"not JSON ({type(e).__name__})") from None
  if not isinstance(body, dict):
    raise BadRequest(f"a JSON {type(body).__name__}, not an object")
  if _depth(body) > MAX_DEPTH:
    raise BadRequest(f"JSON nested more than {MAX_DEPTH} deep")
  return body


def _depth(value: Any, limit: int = MAX_DEPTH + 1) -> int:
  """How deep lists and objects nest in `value`, counted up to `limit`."""
  if not isinstance(value, (dict, list)) or limit == 0:
    return 0
  items = value.values() if isinstance(value, dict) else value
  return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def integer(body: dict, name: str, lo: int = 0, hi: int = MAX_INT,
            default: Any = _MISSING) -> int:
  value = body.get(name, default)
  if value is _MISSING:
    raise Malformed(f"no {name!r}")
  if type(value) is not int or not lo <= value <= hi:  # noqa: E721 -- a bool is not one
    raise Malformed(f"{name}={_short(value)}: expected an integer in [{lo}, {hi}]")
  return value


def optional_integer(body: dict, name: str, lo: int = 0, hi: int = MAX_INT) -> int | None:
  return None if body.get(name) is None else integer(body, name, lo, hi)


def text(body: dict, name: str, default: Any = _MISSING) -> str:
  value = body.get(name, default)
  if value is _MISSING:
    raise Malformed(f"no {name!r}")
  if not isinstance(value, str) or len(value) > MAX_TEXT:
    raise Malformed(f"{name}={_short(value)}: expected a string of at most {MAX_TEXT} "
                     "characters")
  return value


def hosts(body: dict, name: str) -> list[int]:
  """A list of host ids (missing: empty)."""
  value = body.get(name, [])
  if not isinstance(value, list) or len(value) > MAX_HOSTS:
    raise Malformed(f"{name}={_short(value)}: expected a list of at most {MAX_HOSTS} host ids")
  return [integer({"host": h}, "host", 0, MAX_HOSTS) for h in value]


def flag(body: dict, name: str, default: Any = _MISSING) -> bool:
  value = body.get(name, default)
  if not isinstance(value, bool):
    raise Malformed(f"{name}={_short(value)}: expected true or false")
  return value


def _short(value: Any) -> str:
  shown = repr(value)
  return shown if len(shown) <= 40 else shown[:37] + "..."
