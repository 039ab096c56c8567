"""Membership kept by a process that is not a training host: leases, and epochs that only grow.

Run it beside the hosts, e.g. on a small always-on machine beside a fleet of spot hosts:

  python -m diloco_jax.membership.coordinator --port=61100 --max_hosts=8 --bind=0.0.0.0

Each host registers (`coordinator_client.Client`) and gets a lease; it heartbeats within the
lease and each answer carries the current epoch: a number, the members in host order with
their incarnation and address, and the op they continue at; and the pending hosts. Any change
of members opens a new epoch: a host registering before the job runs, or admitted once it runs
(a host that registers again is a new incarnation: its old one leaves at once), leaving, or
letting its lease run out. The number only grows, across a restart of the coordinator too: it
keeps nothing on disk, a host it does not know is told so and registers again with the highest
number it has seen, and the next epoch is numbered above every number reported.

Why our own and not JAX's coordination service, torchft's Lighthouse or etcd (each run and
measured for issue 45): JAX's service takes an exact host count at start and its loss aborts
every host; the Lighthouse restarts its number at 1 and authenticates nothing; etcd needs a
system binary and a data dir, and the epoch logic would still be ours.

Messages (membership/protocol.py): [body, mac], each checked for size, MAC, JSON and every
field's type and bounds before anything acts on it. A register answers a fresh single-use
challenge; a heartbeat, commit or leave carries a counter that must grow; every answer echoes
what it answers. So a frame without the key, a replayed frame and a replayed answer are
dropped. Whatever arrives, the coordinator goes on: each request is handled inside one `try`,
and one that fails any check, or raises anything while handled, is dropped and named in a
line per sender address and reason (wire/droplog.py: bounded, with counts of the rest).

Commit: the hosts run each cross-host op (a sum of pseudo-gradients, an all-gather) over the
members of an epoch, and one may die mid-op; if one survivor then applied the result that
included the dead host and another redid the op without it, they would be an op apart for
good. So an op is two-phase, with the coordinator the single decider: each member votes on op
k of epoch e (ok: it holds the result; not ok: a peer went silent, which it may name) and polls
until the ledger decides (e, k) once: commit when every member of e voted ok while e was
current, else redo, in the epoch the verdict names. The verdict is kept, so every member,
however late, gets the same one. It costs one round trip per op plus waiting for the slowest
member. An op that failed is judged once every member has voted, or `accuse_s` (a lease,
unless set) after the first not-ok vote, by evidence (membership/votes.py's `judge`): a host
named by a majority of the others leaves, an accusation no majority backs makes the accuser
leave; an op tried in 33 epochs gives the job up. When every member but one has voted, each
naming that one (its port refuses them: wire/departed.py; or it has renewed no lease for half
of one: lease.interrupt), and they are at least two, it is judged at once: whatever the last
one voted, it would leave. Heartbeat answers say how long ago each member last renewed.

Stopping the job: the first SIGTERM (or Ctrl-C) to the coordinator stops the whole job, every
host after the same round with a checkpoint (`Ledger.stop`); the coordinator ends once every
host has left or its lease has run out. A second ends it at once. A SIGTERM to one host makes
that host alone leave.

Admission at a round boundary: once a vote has been cast, a host that registers is pending
(leased, but in no epoch: it has no state, and the members' next op would wait for it). The
commit of an op that every member voted `boundary` (it ends a round) opens the next epoch with
the pending hosts, numbered from the op after it (`first_step`), and names them (`admitted`);
a joiner learns it from its heartbeat. A redo never admits. The ledger (membership/ledger.py)
holds the state and these rules, without sockets or clocks; this module serves it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable

import zmq

from diloco_jax import errors
from diloco_jax.membership.ledger import CoordinatorError
from diloco_jax.membership.ledger import Ledger
from diloco_jax.membership.protocol import C2S  # noqa: F401 -- re-exported for callers
from diloco_jax.membership.protocol import MAX_REQUEST
from diloco_jax.membership.protocol import NOT_THIS_KEY
from diloco_jax.membership.protocol import S2C
from diloco_jax.membership.protocol import BadRequest
from diloco_jax.membership.protocol import key_for
from diloco_jax.membership.protocol import keyed
from diloco_jax.membership.protocol import sign
from diloco_jax.membership.protocol import verify
from diloco_jax.runtime import security
from diloco_jax.wire import sealed
from diloco_jax.wire.droplog import DropLog
from diloco_jax.wire.epoch import Epoch  # noqa: F401 -- the client's, and a host's epoch
from diloco_jax.wire.epoch import Member  # noqa: F401 -- an epoch's member

CLAIM_BYTES = 4096  # the most of an unauthenticated request read for the host it claims
REFUSALS_KEPT = 16  # of the requests and handshakes that failed the key, for the lines
TICKS = 16  # checks of the leases' and accusations' ends per lease
QUEUE = 1024  # requests queued in zmq, at most, each at most MAX_REQUEST bytes a part


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _claimed_host(frames: list[bytes]) -> int | None:
  """The host id an unauthenticated request claims to be, for a line that names it (never
  for a decision): None unless it is small JSON with a small integer "host"."""
  try:
    body = json.loads(frames[0]) if frames and len(frames[0]) <= CLAIM_BYTES else None
    host = body.get("host") if isinstance(body, dict) else None
  except (ValueError, RecursionError):
    return None
  ok = isinstance(host, int) and not isinstance(host, bool) and 0 <= host < 1 << 20
  return host if ok else None


class Serving:
  """A coordinator in a thread of this process: host 0's, for a job started with
  --coordinator_address (it ends with host 0's process, as a jax.distributed job's
  coordination service does). `refused` lists (peer, claimed host, why) of the first
  requests or handshakes that failed this job's key: a host with another join token (or a
  stranger: the first REFUSALS_KEPT are kept)."""

  def __init__(self, port: int, max_hosts: int, lease_s: float, key: bytes, bind: str,
               log: Callable[[str], None] = _log):
    self._stop, self._finish, ready = threading.Event(), threading.Event(), threading.Event()
    self._drain = threading.Event()
    self.refused: list[tuple[str | None, int | None, str]] = []
    self._failed: list[BaseException] = []

    def run():
      try:
        serve(port, max_hosts, lease_s, key, bind, self._stop, log, drain=self._drain,
              finish=self._finish, ready=ready, refused=self._refuse)
      except BaseException as e:  # noqa: BLE001 -- raised in the starting thread
        self._failed.append(e)
        ready.set()

    self._thread = threading.Thread(target=run, name="coordinator", daemon=True)
    self._thread.start()
    ready.wait()
    if self._failed:
      raise self._failed[0]

  def _refuse(self, *refusal) -> None:
    if len(self.refused) < REFUSALS_KEPT:
      self.refused.append(refusal)

  def stop_job(self) -> None:
    """Every host stops after the same round with a checkpoint (as a SIGTERM to a
    coordinator of its own does); the coordinator then ends once they have left."""
    self._drain.set()

  def finish(self, timeout_s: float) -> bool:
    """Serves until every host has left (the others finishing their last round and
    checkpoint), at most `timeout_s`; True if they all left in time."""
    self._finish.set()
    self._thread.join(timeout_s)
    self._stop.set()
    return not self._thread.is_alive()


def serve(port: int, max_hosts: int, lease_s: float, key: bytes, bind: str = "127.0.0.1",
          stop: threading.Event | None = None, log: Callable[[str], None] = _log,
          accuse_s: float | None = None, drain: threading.Event | None = None,
          finish: threading.Event | None = None, ready: threading.Event | None = None,
          refused: Callable[[str, int | None, str], None] | None = None) -> None:
  """Answers hosts on tcp://bind:port until `stop` is set; or, once `drain` is set, until
  the job it stops (every host after the same round) has no host left; or, once `finish`
  is set, until no host is left (the job ran to its end). Sets `ready` once it listens.
  `refused(peer, claimed host, why)` hears of each request whose key is not this job's, and
  of each connection whose handshake failed (with a token, nothing unkeyed gets further)."""
  stop, drain = stop or threading.Event(), drain or threading.Event()
  finish = finish or threading.Event()
  ledger = Ledger(max_hosts, lease_s, log, time.monotonic(), accuse_s)
  ctx = zmq.Context()
  sock = ctx.socket(zmq.ROUTER)
  sock.setsockopt(zmq.LINGER, 0)
  # zmq cuts the connection of a part over this size, before it is buffered whole; and
  # keeps at most QUEUE whole requests waiting (then it stops reading from the sockets)
  sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST + 64)
  sock.setsockopt(zmq.RCVHWM, QUEUE)
  sock.setsockopt(zmq.SNDHWM, QUEUE)
  # with a join token, only its holders finish a handshake: zmq would hold an unfinished
  # multipart message of anyone else's without bound (wire/sealed.py)
  sealed.listen(sock, key if keyed(key) else None)
  handshakes = sealed.Handshakes(sock)
  try:
    sock.bind(f"tcp://{bind}:{port}")
  except zmq.ZMQError as e:
    handshakes.close()
    ctx.destroy(linger=0)
    raise CoordinatorError(f"cannot listen on tcp://{bind}:{port}: {e}") from None
  log(f"coordinator: listening on tcp://{bind}:{port} for up to {max_hosts} hosts, "
      f"lease {lease_s:g} s")
  if ready is not None:
    ready.set()
  # Leases and accusations end at most a sixteenth of theirs late: the members wait for a
  # frozen host until its lease ends, and each tick of this loop is a poll of its socket.
  period_s = min(lease_s, ledger.accuse_s)
  tick_ms = max(10, int(period_s * 1000 / TICKS))
  drops = DropLog(log, "coordinator")
  try:
    last = time.monotonic()
    while not stop.is_set():
      if sock.poll(tick_ms):
        for _ in range(QUEUE):  # all that waits (after a pause, every host's heartbeat)
          _answer(sock, key, ledger, drops, refused)
          if not sock.poll(0):
            break
      if handshakes.read():  # nothing of it reached the sockets: no address, no claim
        why = f"its handshake failed ({sealed.STRANGER})"
        drops(None, why)
        if refused is not None:
          refused(None, None, why)
      now = time.monotonic()
      if now - last > period_s:  # this process was paused (SIGSTOP, a swap
        ledger.pardon(now - last)  # storm): the hosts' leases did not run while it slept
      last = now
      ledger.expire(now)
      if finish.is_set() and ledger.idle:
        break
      if drain.is_set():
        ledger.stop("the coordinator was asked to stop it")
        if ledger.idle:
          break
  finally:
    handshakes.close()
    ctx.destroy(linger=0)


def _answer(sock: zmq.Socket, key: bytes, ledger: Ledger, drops: DropLog,
            refused: Callable[[str, int | None, str], None] | None) -> None:
  """Takes one request off `sock` and answers it. Nothing a request holds can raise out of
  here: whatever fails is a dropped request, said in `drops`' bounded lines."""
  try:
    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
  except zmq.ZMQError:
    return
  peer = _peer_address(msg)
  # a REQ's request through a ROUTER: [routing id, empty delimiter, body, mac]
  route, frames = [f.bytes for f in msg[:2]], [f.bytes for f in msg[2:]]
  try:
    answer = sign(key, S2C, ledger.handle(verify(key, C2S, frames), time.monotonic()))
  except Exception as e:  # noqa: BLE001 -- one bad request must not end the coordinator
    why = str(e) if isinstance(e, BadRequest) else f"{type(e).__name__} while handling it"
    drops(peer, why)
    if refused is not None and why.startswith(NOT_THIS_KEY):
      refused(peer, _claimed_host(frames), why)
    answer = [json.dumps({"op": "dropped", "why": why[:200]}).encode(), b""]
  try:
    sock.send_multipart(route + answer, zmq.NOBLOCK)
  except zmq.ZMQError:
    pass  # its sender is gone, or reads nothing: it gets no answer


def _peer_address(msg: list) -> str | None:
  """The address a message's connection came from (None where zmq cannot say)."""
  try:
    return msg[-1].get("Peer-Address")
  except (zmq.ZMQError, IndexError, AttributeError):
    return None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m diloco_jax.membership.coordinator",
      description="Keeps which hosts train together: leases, and epochs that only grow.")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--max_hosts", type=int, required=True)
  parser.add_argument("--bind", default="127.0.0.1",
                      help="the address to listen on (0.0.0.0: every interface)")
  parser.add_argument("--lease_s", type=float, default=10.0,
                      help="a host that has not heartbeaten for this long is dropped")
  parser.add_argument("--accuse_s", type=float, default=None,
                      help="how long a failed op waits for every member's vote before it "
                           "is judged with the votes in (default: --lease_s)")
  parser.add_argument("--insecure", action="store_true",
                      help="serve without a join token on an address other machines reach "
                           "(refused without this; also DILOCO_INSECURE=1)")
  parser.add_argument("--join_token_file", default=None,
                      help="the job's join token (else $DILOCO_JOIN_TOKEN_FILE, "
                           "$DILOCO_JOIN_TOKEN); frames are authenticated with a key from it")
  args = parser.parse_args(argv)
  stop, drain = threading.Event(), threading.Event()

  def on_signal(*_):  # the first stops the job, every host after the same round
    (stop if drain.is_set() else drain).set()
    if not stop.is_set():
      _log("coordinator: asked to stop: every host stops after the same round, with a "
           "checkpoint; the coordinator ends when they have left (signal it again to end "
           "it now)")

  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, on_signal)
  try:
    token = security.JoinToken.from_environment(args.join_token_file)
    warning = security.require_token(token, {"the coordinator": f"{args.bind}:{args.port}"},
                                     security.insecure(args.insecure))
    if warning:
      _log(f"coordinator: {warning}")
    elif token is None:
      _log("coordinator: no join token: any process on this machine can register")
    serve(args.port, args.max_hosts, args.lease_s, key_for(token), args.bind, stop,
          accuse_s=args.accuse_s, drain=drain)
  except errors.DilocoError as e:
    print(errors.describe(e), file=sys.stderr)
    return e.exit_code
  _log("coordinator: stopped")
  return 0


if __name__ == "__main__":
  sys.exit(main())
