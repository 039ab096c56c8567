"""Who may join a job: the coordinator address check and the join token.

JAX's coordination service (gRPC) and gloo (TCP) neither authenticate nor encrypt: any
process that reaches host 0's coordinator port can register as a host. Two defences live
here, both run at start-up:

- `check_coordinator_address`: a coordinator on a public address is refused unless the
  user says so (`--allow_public_coordinator`); it runs before `jax.distributed` starts.
  `bind_address` keeps host 0's service off the machine's other interfaces.
- `JoinToken`: every host proves it holds the job's secret without sending it. Each host
  publishes a fresh random nonce in the coordination service's key-value store; once all
  are there, each publishes HMAC-SHA256(token, host id | hosts | every nonce) and checks
  every other host's proof. Proofs are bound to this job's nonces, so one read from an
  earlier job cannot be replayed, and the token never leaves the process. A host with
  another token (or none) is refused by every host, by host id, without the token's text.

Neither encrypts what crosses the network: for that, the hosts talk over a VPN
(docs/security.md).
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import re
import secrets
import socket
from typing import Callable

from diloco_jax import errors

MIN_TOKEN_CHARS = 16
MIN_TOKEN_BITS = 64  # by `token_bits`' estimate: secrets.token_urlsafe(32) has about 200
TOKEN_ENV, TOKEN_FILE_ENV = "DILOCO_JOIN_TOKEN", "DILOCO_JOIN_TOKEN_FILE"
_KEY = "diloco_jax/join/"
_NO_TOKEN = "none"  # a host's proof when it was given no token

# Addresses reachable only from this machine, its own network or a VPN overlay. Every
# other address counts as public, the documentation ranges (RFC 5737, RFC 3849) included.
_PRIVATE = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
    "100.64.0.0/10",  # carrier-grade NAT: Tailscale's addresses
    "169.254.0.0/16", "::1/128", "fc00::/7", "fe80::/10"))


class SecurityError(errors.DilocoError, RuntimeError):
  """A start-up refused for a security reason (a public coordinator, a token mismatch)."""
  prefix = "Start-up failed"


def split_address(address: str, where: str = "--coordinator_address") -> tuple[str, int]:
  """'host:port' or '[v6]:port' -> (host, port); an error naming `where` otherwise."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise SecurityError(f"{where}={address!r}: expected host:port, e.g. 10.0.0.1:61000")
  return host.strip("[]"), int(port)


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def address_error(address: str, where: str) -> str | None:
  """What is wrong with `address` as a place to connect to ('host:port', the host an IP
  address or a DNS name); None if nothing."""
  try:
    host, _ = split_address(address, where)
  except SecurityError as e:
    return str(e)
  try:
    ipaddress.ip_address(host)
    return None
  except ValueError:
    pass
  if len(host) <= 253 and _HOST_NAME.fullmatch(host):
    return None
  return f"{where}={str(address)[:80]!r}: {host[:40]!r} is neither an IP address nor a host name"


INSECURE_ENV = "DILOCO_INSECURE"  # "1": as --insecure


def insecure(flag: bool) -> bool:
  """--insecure, or $DILOCO_INSECURE=1."""
  return flag or os.environ.get(INSECURE_ENV, "") == "1"


def is_loopback(host: str) -> bool:
  """Whether `host` (an IP or a name) is reachable from this machine only."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def require_token(token: JoinToken | None, listens: dict[str, str], allow: bool) -> str | None:
  """Refuses to listen on anything but loopback without a join token: `listens` maps what
  listens (e.g. "host 0's coordinator") to its address. `allow` (--insecure): runs anyway;
  returns the warning every host then prints. None when nothing needs saying."""
  exposed = {what: address for what, address in listens.items()
             if not is_loopback(split_address(address, what)[0])}
  if token is not None or not exposed:
    return None
  where = "; ".join(f"{what} at {address}" for what, address in exposed.items())
  if not allow:
    raise SecurityError(
        f"no join token, and {where} would listen where other machines can reach it: "
        "anyone who reaches that port could join the job, write into its sums or stop it. "
        f"Give every host the same token (${TOKEN_ENV}, ${TOKEN_FILE_ENV} or "
        "--join_token_file; make one with: python -c 'import secrets; "
        "print(secrets.token_urlsafe(32))'), or pass --insecure (or set "
        f"${INSECURE_ENV}=1) to run unauthenticated on a network you trust.")
  return (f"WARNING: --insecure: no join token, and {where} listens unauthenticated: any "
          "process that reaches the port can join this job, write into its sums or stop it")


def is_private(ip: str) -> bool:
  address = ipaddress.ip_address(ip)
  if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
    address = address.ipv4_mapped
  return any(address in net for net in _PRIVATE if net.version == address.version)


def _resolve(host: str) -> list[str]:
  return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})


def public_addresses(address: str, resolve: Callable[[str], list[str]] = _resolve) -> list[str]:
  """The public IPs `address`'s host stands for: itself if it is an IP (nothing is
  resolved then), else what `resolve` (DNS) returns for the name."""
  host, _ = split_address(address)
  try:
    ips = [str(ipaddress.ip_address(host))]
  except ValueError:  # a name
    try:
      ips = resolve(host)
    except OSError as e:
      raise SecurityError(f"--coordinator_address={address!r}: cannot resolve {host!r}: "
                          f"{e}") from None
  return [ip for ip in ips if not is_private(ip)]


def check_coordinator_address(address: str, allow_public: bool,
                              resolve: Callable[[str], list[str]] = _resolve) -> None:
  """Refuses a coordinator address that is public (reachable from the internet) unless
  `allow_public`: anyone who reaches it can join the job or disturb it."""
  public = public_addresses(address, resolve)
  if public and not allow_public:
    raise SecurityError(
        f"--coordinator_address={address} is a public address ({', '.join(public)}): anyone "
        "who can reach its port could join this job, read its pseudo-gradients or stop it, "
        "and nothing that crosses the network is encrypted. Put the hosts on a private "
        "network or a VPN and use that address (docs/security.md), or pass "
        "--allow_public_coordinator to run on it anyway (then use a join token and open the "
        "port only to the job's hosts).")


def bind_address(address: str) -> str | None:
  """Where host 0's coordination service listens: the coordinator address's own IP when
  it is one of this machine's (JAX's default is every interface, [::]:port), else None
  (JAX's default: the address is a name for several, or a NAT's public IP that no
  interface holds, and binding to it would fail)."""
  host, port = split_address(address)
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    return None
  family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as s:
      s.bind((str(ip), 0))  # succeeds only on an address this machine holds
  except OSError:
    return None
  return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def token_bits(secret: str) -> float:
  """A rough upper bound on a token's entropy: its length times log2 of the number of
  distinct characters in it. It cannot tell a random token from a memorable one, but it
  refuses the weakest (one character repeated, a short run of digits)."""
  distinct = len(set(secret))
  return len(secret) * math.log2(distinct) if distinct > 1 else 0.0


class JoinToken:
  """The job's shared secret. Its text is kept out of repr, logs and errors."""

  def __init__(self, secret: str, source: str):
    if len(secret) < MIN_TOKEN_CHARS:
      raise SecurityError(
          f"the join token from {source} is shorter than {MIN_TOKEN_CHARS} characters; "
          "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if token_bits(secret) < MIN_TOKEN_BITS:
      raise SecurityError(
          f"the join token from {source} is too easy to guess (about "
          f"{token_bits(secret):.0f} bits, from its length and the characters it repeats; "
          f"at least {MIN_TOKEN_BITS} are needed); make one with: python -c 'import "
          "secrets; print(secrets.token_urlsafe(32))'")
    self._key = secret.encode()
    self.source = source

  def __repr__(self) -> str:
    return f"JoinToken(from {self.source})"

  @classmethod
  def from_environment(cls, path: str | None = None) -> JoinToken | None:
    """The token in file `path` (--join_token_file), else in the file named by
    DILOCO_JOIN_TOKEN_FILE, else DILOCO_JOIN_TOKEN's value; None if none is given.
    A file holds the token on its first line."""
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if path:
      source = f"--join_token_file={path}"
      try:
        with open(path) as f:
          secret = f.readline().strip()
      except OSError as e:
        raise SecurityError(f"{source}: cannot read it: {e.strerror}") from None
      if not secret:
        raise SecurityError(f"{source}: the file is empty")
      return cls(secret, source)
    if os.environ.get(TOKEN_ENV):
      return cls(os.environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}")
    return None

  def derive_key(self, context: str) -> bytes:
    """A 32-byte key for one use (`context` names it, e.g. one epoch of the wire's frames):
    HMAC-SHA256(token, "diloco_jax key|" + context). Keys of different contexts are
    independent, and none reveals the token."""
    return hmac.new(self._key, f"diloco_jax key|{context}".encode(), "sha256").digest()

  def proof(self, host: int, num_hosts: int, nonces: list[str]) -> str:
    message = f"diloco_jax join v1|host {host}|{num_hosts} hosts|{','.join(nonces)}"
    return hmac.new(self._key, message.encode(), "sha256").hexdigest()


def mismatches(me: int, token: JoinToken | None, nonces: list[str],
               proofs: list[str]) -> list[str]:
  """What is wrong with the other hosts' proofs, seen from host `me` (empty: all agree)."""
  wrong = []
  for host, proof in enumerate(proofs):
    if host == me:
      continue
    if token is None and proof != _NO_TOKEN:
      wrong.append(f"host {host} was given a join token and this host was not")
    elif token is not None and proof == _NO_TOKEN:
      wrong.append(f"host {host} was given no join token and this host was")
    elif token is not None and not hmac.compare_digest(
        proof, token.proof(host, len(proofs), nonces)):
      wrong.append(f"host {host}'s join token differs from this host's")
  return wrong


def agree_on_token(client, me: int, num_hosts: int, token: JoinToken | None,
                   timeout_s: int) -> None:
  """Every host checks every other host's proof of the token (module docstring); raises
  SecurityError on every host if any host's token differs. `client`: the coordination
  service's client (key_value_set, blocking_key_value_get, wait_at_barrier)."""
  def gather(kind: str, mine: str) -> list[str]:
    client.key_value_set(f"{_KEY}{kind}/{me}", mine)
    return [client.blocking_key_value_get(f"{_KEY}{kind}/{h}", timeout_s * 1000)
            for h in range(num_hosts)]

  nonces = gather("nonce", secrets.token_hex(16))
  proofs = gather("proof", _NO_TOKEN if token is None else token.proof(me, num_hosts, nonces))
  client.wait_at_barrier(f"{_KEY}compared", timeout_s * 1000)  # all have read
  wrong = mismatches(me, token, nonces, proofs)
  if wrong:
    raise SecurityError(
        f"host {me}: join token mismatch: {'; '.join(wrong)}. Every host of a job must be "
        f"given the same token (${TOKEN_ENV}, ${TOKEN_FILE_ENV} or --join_token_file); "
        "the job is refused.")
