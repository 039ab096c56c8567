"""A membership epoch: who takes part in the sums, where they listen, and the key of their frames.

An `Epoch` is a value: a number that only grows, the member host ids in the order every sum
is reduced in, and each member's address (host:port, where it listens for this epoch's
frames). The membership layer (a later part of issue 45) agrees on one and hands it to every
member; `wire/peers.py` opens connections for it. Connections belong to one epoch: opening the
next closes every socket of this one, nothing is cached across epochs, and a frame that names
another epoch is dropped.

Keys. With a join token, every frame carries a MAC (`wire/frames.py`: HMAC-SHA256 over the
header and the payload's NH hash) under keys that belong to this epoch alone, derived from
HMAC(token, "diloco_jax wire v1|epoch <number>")
(`runtime.security.JoinToken.derive_key`). A frame recorded in one epoch therefore fails the
MAC in every other, on top of naming the wrong epoch in its header. The token itself never
crosses the network.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from diloco_jax import errors

if TYPE_CHECKING:
  from diloco_jax.runtime import security


class WireError(errors.DilocoError, RuntimeError):
  """The wire between an epoch's members failed (a peer died or went silent, a peer broke
  the protocol, bad input): the message names the epoch and, where there is one, the peer."""
  prefix = "Wire failed"


class PeerError(WireError):
  """A peer died or went silent mid-collective: a membership layer can drop `host` and open
  the next epoch without it."""

  def __init__(self, message: str, *, epoch: int, host: int):
    super().__init__(message)
    self.epoch, self.host = epoch, host


@dataclasses.dataclass(frozen=True)
class Epoch:
  """One membership: `number` (only grows), `hosts` (member host ids, in reduction order),
  `addresses` (each member's "host:port", in the order of `hosts`)."""
  number: int
  hosts: tuple[int, ...]
  addresses: tuple[str, ...]

  def __post_init__(self):
    object.__setattr__(self, "hosts", tuple(int(h) for h in self.hosts))
    object.__setattr__(self, "addresses", tuple(str(a) for a in self.addresses))
    if self.number < 0:
      raise WireError(f"epoch number {self.number}: must be >= 0")
    if not self.hosts:
      raise WireError(f"epoch {self.number}: no member hosts")
    if len(set(self.hosts)) != len(self.hosts) or min(self.hosts) < 0:
      raise WireError(f"epoch {self.number}: member host ids {list(self.hosts)} must be "
                      "distinct and >= 0")
    if len(self.addresses) != len(self.hosts):
      raise WireError(f"epoch {self.number}: {len(self.hosts)} hosts but "
                      f"{len(self.addresses)} addresses")
    for host, address in zip(self.hosts, self.addresses):
      split_address(address, f"epoch {self.number}, host {host}")

  @property
  def size(self) -> int:
    return len(self.hosts)

  def rank(self, host: int) -> int:
    """`host`'s position in the reduction order."""
    try:
      return self.hosts.index(host)
    except ValueError:
      raise WireError(f"host {host} is not a member of epoch {self.number} (members "
                      f"{list(self.hosts)})") from None

  def address(self, host: int) -> str:
    return self.addresses[self.rank(host)]

  def without(self, *dropped: int) -> Epoch:
    """The next epoch: these members dropped, the others in the same order and places."""
    keep = [(h, a) for h, a in zip(self.hosts, self.addresses) if h not in dropped]
    return Epoch(self.number + 1, tuple(h for h, _ in keep), tuple(a for _, a in keep))


def split_address(address: str, where: str) -> tuple[str, int]:
  """'host:port' or '[v6]:port' -> (host, port); a clear error naming `where` otherwise."""
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise WireError(f"{where}: address {address!r}: expected host:port, e.g. 10.0.0.1:61000")
  return host.strip("[]"), int(port)


def endpoint(address: str) -> str:
  """A zmq TCP endpoint for "host:port" (IPv6 in brackets, as zmq wants it)."""
  host, port = split_address(address, "endpoint")
  return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def epoch_key(token: security.JoinToken | None, number: int) -> bytes | None:
  """The key of epoch `number`'s frames; None without a token (frames then carry no MAC)."""
  if token is None:
    return None
  return token.derive_key(f"wire v1|epoch {number}")
