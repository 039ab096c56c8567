"""One host of a join test: live membership and the epoch wire alone, without training.

  python tests/join_main.py HOST PORT NUM_HOSTS ROUNDS PAYLOAD_BYTES [FAULT]

Registers as host HOST with the membership coordinator at 127.0.0.1:PORT (membership/lease.py;
a member waits for an epoch of NUM_HOSTS hosts) and sums over the epoch wire
(membership/collective.py), as loop/join.py does in the trainer:
- a member runs rounds 1..ROUNDS: each an all-gather of the round (every row must be it: no
  host is a round apart), an all-gather of whether it has seen a host waiting to join (so
  every member decides alike), and if one has, a round boundary and, if it admitted hosts,
  the transfer of a message to them: a JSON header (the round, the body's sha256) and a
  body of PAYLOAD_BYTES bytes drawn from the round; then a short sleep (the training);
- a host that found the job running (`lease.joining`) waits to be admitted, receives the
  message, checks the body against the header and goes on from the round after it.
Lines on stdout: `host H: started with hosts [..]`, `host H: admitted [..] at round r, sent
by host S`, `host H: joined at round r from host S, N bytes, sha ok`, `host H: done at round r with
hosts [..]` (r: the last round it ran, ROUNDS unless it stopped early); a failed check
prints its line and exits 1.

FAULT, a test hook that patches the wire (`peers.Peers`) in this process only:
- die_receiving: a joiner exits (status 3) once the header came, before the body;
- die_sending: the first time this host is a transfer's source, it exits (status 3) once it
  sent the header, before the body;
- rejoin: when this host finds itself dropped (a MembershipError, e.g. after a freeze), it
  registers again as a new incarnation and joins like a host started late (else: exit 1).
Environment (test hooks too): JOIN_ROUND_S, the sleep per round (default 0.1);
JOIN_ADMIT_AT=N, members run a round boundary once one of them sees N hosts waiting (default
1); JOIN_BARRIER=DIR:N, a joiner registers ready only once N joiners have found the job
running (a file each in DIR). Together they admit N joiners at one boundary for certain;
JOIN_WIRE_TIMEOUT_S, how long the wire waits for a silent peer still in the epoch (60);
JOIN_READY_DELAY_S, how long a host that found the job running waits before it registers
ready (it is in no list of the coordinator's until then: no boundary may admit it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from diloco_jax.membership import lease as lease_lib
from diloco_jax.membership import collective as epochs
from diloco_jax.wire import peers as peers_lib

FAULTS = ("", "die_receiving", "die_sending", "rejoin")
ROUND_S = float(os.environ.get("JOIN_ROUND_S", "0.1"))
ADMIT_AT = int(os.environ.get("JOIN_ADMIT_AT", "1"))
BARRIER = os.environ.get("JOIN_BARRIER", "")
WIRE_TIMEOUT_S = float(os.environ.get("JOIN_WIRE_TIMEOUT_S", "60"))
READY_DELAY_S = float(os.environ.get("JOIN_READY_DELAY_S", "0"))


def say(line: str) -> None:
  print(line, flush=True)


def body_of(r: int, size: int) -> bytes:
  return np.random.default_rng(r).bytes(size)


def message(host: int, r: int, size: int) -> tuple[bytes, bytes]:
  body = body_of(r, size)
  header = {"round": r, "sha256": hashlib.sha256(body).hexdigest(), "sender": host}
  return json.dumps(header).encode(), body


def install(fault: str, host: int) -> None:
  """The FAULT's patch of `peers.Peers` (module docstring)."""
  if fault == "die_receiving":
    recv = peers_lib.Peers.recv

    def dying_recv(self, src):
      got = recv(self, src)
      say(f"host {host}: got a header of {len(got)} bytes from host {src}; dying before the "
          "body")
      os._exit(3)  # pylint: disable=protected-access
    peers_lib.Peers.recv = dying_recv
  elif fault == "die_sending":
    send, sent = peers_lib.Peers.send, []

    def dying_send(self, dst, data):
      if sent:  # the header went out: this is the body
        say(f"host {host}: sent the header to host {dst}; dying before the body")
        os._exit(3)  # pylint: disable=protected-access
      send(self, dst, data)
      sent.append(dst)
    peers_lib.Peers.send = dying_send


def rounds(host: int, lease, coll, first: int, last: int, size: int) -> int:
  """Rounds first..last, as a member (module docstring); returns the last one it ran."""
  done = first - 1
  for r in range(first, last + 1):
    rows = coll.allgather(np.array([r], np.int64)).reshape(-1)
    if not (rows == r).all():
      say(f"host {host}: round {r}: hosts {coll.live} are at rounds {rows.tolist()}: a host "
          "is a round apart")
      sys.exit(1)
    seen = len(lease.client.pending) if ADMIT_AT > 1 else int(lease.pending)
    waiting = coll.allgather(np.array([seen], np.int64))
    if waiting.max() >= ADMIT_AT:
      admitted = coll.boundary()
      if admitted:
        source, _, _ = coll.transfer(admitted, lambda r=r: message(host, r, size))
        say(f"host {host}: admitted {list(admitted)} at round {r}, sent by host {source}")
    time.sleep(ROUND_S)
    done = r
  return done


def join(host: int, lease, coll) -> int:
  """A host that found the job running: admitted, then the members' message. Returns the
  round it joins after."""
  if BARRIER:
    where, n = BARRIER.rsplit(":", 1)
    open(os.path.join(where, str(host)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(where)) < int(n):
      if time.monotonic() > deadline:
        say(f"host {host}: not {n} joiners in {where} within 60 s")
        sys.exit(1)
      time.sleep(0.01)
  time.sleep(READY_DELAY_S)
  lease.join()
  coll.admitted()
  source, got, _ = coll.transfer((host,), None)
  raw_header, body = bytes(got[0]), bytes(got[1])
  header = json.loads(raw_header)
  r = int(header["round"])
  if hashlib.sha256(body).hexdigest() != header["sha256"]:
    say(f"host {host}: the body from host {source} ({len(body)} bytes) is not the one its "
        f"header hashed (round {r})")
    sys.exit(1)
  if body != body_of(r, len(body)):
    say(f"host {host}: the body from host {source} is not round {r}'s")
    sys.exit(1)
  say(f"host {host}: joined at round {r} from host {source}, {len(body)} bytes, sha ok "
      f"(hosts {coll.live})")
  return r


def start(host: int, port: int, num_hosts: int):
  lease = lease_lib.Lease.start(f"127.0.0.1:{port}", host=host, num_hosts=num_hosts,
                                token=None, timeout_s=60)
  return lease, epochs.EpochCollective(lease, timeout_s=WIRE_TIMEOUT_S)


def main(host, port, num_hosts, num_rounds, size, fault="") -> int:
  host, port, num_hosts = int(host), int(port), int(num_hosts)
  num_rounds, size = int(num_rounds), int(size)
  if fault not in FAULTS:
    raise SystemExit(f"FAULT {fault!r}: one of {FAULTS}")
  install(fault, host)
  lease, coll = start(host, port, num_hosts)
  while True:
    try:
      if lease.joining:
        r = join(host, lease, coll)
      else:
        coll.connect()
        say(f"host {host}: started with hosts {coll.live}")
        r = 0
      r = rounds(host, lease, coll, r + 1, num_rounds, size)
      say(f"host {host}: done at round {r} with hosts {coll.live}")
      coll.close()
      return 0
    except lease_lib.JobEnded as e:
      say(f"host {host}: job ended: {e}")
      coll.close(leave=False)
      return 0
    except lease_lib.MembershipError as e:
      say(f"host {host}: dropped: {e}")
      coll.close(leave=False)
      if fault != "rejoin":
        return 1
    lease, coll = start(host, port, num_hosts)  # a new incarnation
    if not lease.joining:
      say(f"host {host}: registered again but not as a joiner (epoch {lease.epoch.number}, "
          f"hosts {list(lease.epoch.hosts)})")
      coll.close()
      return 1
    say(f"host {host}: registered again, as a joiner")


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
