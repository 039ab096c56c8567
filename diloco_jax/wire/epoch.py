"""A membership epoch: who takes part in the sums, where they listen, and the key of their frames.

An `Epoch` is a value: a number that only grows, the members in the order every sum is
reduced in, and each member's address (host:port, where it listens for this epoch's
frames). The membership coordinator (`membership/ledger.py`) announces one and every member
gets it; `wire/peers.py` opens connections for it. Connections belong to one epoch: opening the
next closes every socket of this one, nothing is cached across epochs, and a frame that names
another epoch is dropped.

Keys. With a join token, every frame carries a MAC (`wire/frames.py`: HMAC-SHA256 over the
header and the payload's NH hash) under keys that belong to this epoch alone, derived from
HMAC(token, "diloco_jax wire v2|epoch <number>|<nonce>")
(`runtime.security.JoinToken.derive_key`), where the nonce is 128 random bits the
coordinator draws for each epoch it opens and announces inside its authenticated answers.
A frame recorded in one epoch therefore fails the MAC in every other, of this job or of any
other run with the same token (whose epochs count from 1 again), on top of naming the wrong
epoch in its header. The token itself never crosses the network.
"""

from __future__ import annotations

import dataclasses
from diloco_jax import errors
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
class Member:
  """A host in an epoch: its id, its incarnation (random, new at each registration: the
  coordinator's, "" where none), where its peers reach it ("host:port") and where it
  serves its compiled programs to joiners ("host:port", "" where it does not:
  membership/programs.py)."""
  host: int
  incarnation: str
  address: str
  programs: str = ""


@dataclasses.dataclass(frozen=True)
class Epoch:
  """Who trains together: `members` in host order, the order every sum is reduced in.
  `number` only grows; `boot` (random at each start of the coordinator) tells apart two
  epochs that got one number from coordinators before and after a restart; `first_step`:
  the op its members continue at (the op after the one whose commit admitted a host, the
  op redone, 0 at start-up), so that a host admitted into it numbers its ops like them;
  `nonce`: random for each epoch the coordinator opens, part of its frames' key."""
  number: int
  members: tuple[Member, ...]
  boot: str = ""
  first_step: int = 0
  nonce: str = ""

  @classmethod
  def of(cls, number: int, hosts, addresses) -> Epoch:
    """An epoch of these hosts at these addresses (no incarnations: the wire alone)."""
    return cls(number, tuple(Member(int(h), "", str(a)) for h, a in zip(hosts, addresses,
                                                                        strict=True)))

  @property
  def hosts(self) -> tuple[int, ...]:
    return tuple(m.host for m in self.members)

  @property
  def addresses(self) -> tuple[str, ...]:
    return tuple(m.address for m in self.members)

  @property
  def size(self) -> int:
    return len(self.members)

  def check(self) -> Epoch:
    """This epoch, if connections can be opened for it: members, distinct ids, addresses."""
    if self.number < 0:
      raise WireError(f"epoch number {self.number}: must be >= 0")
    if not self.members:
      raise WireError(f"epoch {self.number}: no member hosts")
    hosts = self.hosts
    if len(set(hosts)) != len(hosts) or min(hosts) < 0:
      raise WireError(f"epoch {self.number}: member host ids {list(hosts)} must be "
                      "distinct and >= 0")
    for m in self.members:
      wrong = security.address_error(m.address, f"epoch {self.number}, host {m.host}")
      if wrong:
        raise WireError(wrong)
    return self

  def rank(self, host: int) -> int:
    """`host`'s position in the reduction order."""
    try:
      return self.hosts.index(host)
    except ValueError:
      raise WireError(f"host {host} is not a member of epoch {self.number} (members "
                      f"{list(self.hosts)})") from None

  def address(self, host: int) -> str:
    return self.members[self.rank(host)].address

  def without(self, *dropped: int) -> Epoch:
    """The next epoch: these members dropped, the others in the same order and places."""
    return dataclasses.replace(self, number=self.number + 1,
                               members=tuple(m for m in self.members if m.host not in dropped))

  def to_json(self) -> dict:
    return {"number": self.number, "boot": self.boot, "first_step": self.first_step,
            "nonce": self.nonce, "members": [dataclasses.asdict(m) for m in self.members]}

  @classmethod
  def from_json(cls, body) -> Epoch:
    """The epoch `to_json` wrote; WireError naming what is missing or of another type."""
    def field(d, name, kind, default=None):
      value = d.get(name, default) if isinstance(d, dict) else None
      if type(value) is not kind or (kind is int and not 0 <= value < 1 << 62):  # noqa: E721
        raise WireError(f"an epoch whose {name!r} is {str(value)[:40]!r}, not a "
                        f"{'count' if kind is int else kind.__name__}")
      return value
    members = field(body, "members", list)
    return cls(field(body, "number", int),
               tuple(Member(field(m, "host", int), field(m, "incarnation", str),
                            field(m, "address", str), field(m, "programs", str, ""))
                     for m in members),
               field(body, "boot", str), field(body, "first_step", int, 0),
               field(body, "nonce", str, ""))


def endpoint(address: str) -> str:
  """A zmq TCP endpoint for "host:port" (IPv6 in brackets, as zmq wants it)."""
  host, port = security.split_address(address, "endpoint")
  return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def epoch_key(token: security.JoinToken | None, epoch: Epoch) -> bytes | None:
  """The key of `epoch`'s frames (module docstring); None without a token (frames then
  carry no MAC)."""
  if token is None:
    return None
  return token.derive_key(f"wire v2|epoch {epoch.number}|{epoch.nonce}")


def connection_key(token: security.JoinToken | None) -> bytes | None:
  """The key of the wire's connections (wire/sealed.py; None without a token): the job's,
  not an epoch's, so that a peer that opened the next epoch first still connects to this
  epoch's listener, whose reader drops its HELLO quietly (links.py). Replaying a recorded
  connection fails anyway: CURVE's session keys are fresh for each."""
  if token is None:
    return None
  return token.derive_key("wire connections v1")
