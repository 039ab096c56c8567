"""This host's membership in a live job: its lease at the coordinator (membership/coordinator.py).

`Lease.start` registers with the coordinator under the host id the launcher gave, and waits
until the job's first epoch holds every host it was started with. From then on a thread
heartbeats well within the lease and keeps the newest epoch the coordinator announced; the
collectives (`membership/collective.py`) ask it two things: whether the op they wait on can still
complete (`interrupt`: a member of its epoch has been dropped or is frozen, or the
coordinator is lost)
and, after each op, the coordinator's verdict on it (`commit`).

A coordinator that stops answering does not end the run: this host keeps its state and waits
for it, up to `grace_s` (--coordinator_grace), its ops waiting for their verdicts (a host
that trained on without them could commit an op its peers redo). When a coordinator answers
again at the same address (restarted by the launcher, systemd or a person) it does not know
this host: the host registers again under its id, saying how many ops it committed and with
whom (`resume`), and takes the verdict on the op it waited on from the epoch the new
coordinator opens (`_resumed`). Only a coordinator away for longer than the grace ends the
run here, with one line; checkpoints already written are untouched.

A host whose lease ran out while the job went on (frozen, cut off) is `Dropped` when it
wakes: the trainer then makes it a joiner again in the same process (`rejoin`, then `join`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import zmq

from diloco_jax import errors
from diloco_jax.membership import client as coordinator_client
from diloco_jax.runtime import security


class MembershipError(errors.DilocoError, RuntimeError):
  """This host is no longer in the job: the coordinator was lost, or dropped this host."""
  prefix = "Membership"


class Dropped(MembershipError):
  """This host is out of the job, which goes on without it (its lease ran out while it was
  frozen or cut off, or its peers found it silent): it can join again (`Lease.rejoin`)."""


class JobEnded(MembershipError):
  """A host that was to join found no member left: the job ended (or every member failed,
  and says so in its own log) before it was admitted. Nothing of this host's is lost."""
  exit_code = 0


GRACE_S = 600.0  # how long a host waits for a coordinator that stopped answering


class Lease:
  """The registration of host `host` and the thread that renews it."""

  def __init__(self, client: coordinator_client.Client, registration, num_hosts: int,
               address: str, grace_s: float = GRACE_S):
    self.client, self.num_hosts, self.address = client, num_hosts, address
    self.grace_s = grace_s
    self.away_since: float | None = None  # when the coordinator stopped answering
    self.position = 0  # the ops this host committed (said when it registers again)
    self.busy = False  # in a cross-host op now (said in each heartbeat, with `position`)
    self._boot = registration.epoch.boot  # the coordinator this host is registered with
    self._back = threading.Lock()  # one registration again at a time, from either thread
    # a heartbeat that takes longer than a lease is a coordinator away
    client.timeout_s = min(client.timeout_s, max(1.0, registration.lease_s))
    self.host = registration.host
    self.lease_s = registration.lease_s
    self.epoch = registration.epoch  # the newest the coordinator announced
    # The job was running when this host registered: it joins at a round boundary (`join`)
    # once it is ready to take the members' state, and is in no epoch until then.
    self.joining = registration.pending
    self.lost: str | None = None  # why this host is out of the job, once it is
    self.dropped = False  # out of a job that goes on (`Dropped`): it may join again
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  @classmethod
  def start(cls, coordinator: str, *, host: int, num_hosts: int,
            token: security.JoinToken | None, timeout_s: float,
            address: str | None = None, min_hosts: int | None = None,
            waiting: Callable[[], None] = lambda: None,
            last_epoch: int = 0, grace_s: float = GRACE_S, programs: str = "") -> Lease:
    """Registers, then waits up to `timeout_s` for an epoch of `min_hosts` hosts (None:
    `num_hosts`), calling `waiting()` meanwhile (it may raise to give up); a host that
    finds the job running returns at once, `joining`. `last_epoch`: the highest epoch number
    this host saw before (its newest checkpoint's), reported when it registers. `programs`:
    where this host serves its compiled programs (membership/programs.py; "": nowhere)."""
    client = coordinator_client.Client(coordinator, token, timeout_s=min(10.0, timeout_s),
                                       last_epoch=last_epoch, programs=programs)
    address = coordinator_client.wire_address(coordinator, address)
    try:
      # Not ready: if the job runs, the members would admit it at their next round
      # boundary and wait for it to take their state; it registers again once it can.
      registration = client.register(address, host, ready=False)
    except coordinator_client.JobStopping as e:
      client.close()
      raise JobEnded(f"host {host}: {e}") from None
    except coordinator_client.TokenMismatch:
      client.close()
      raise
    except coordinator_client.CoordinatorError as e:
      client.close()
      raise MembershipError(f"host {host}: {e}") from None
    lease = cls(client, registration, num_hosts, address, grace_s)
    if lease.joining:
      client.registration = None  # a probe's: it holds no lease
      return lease
    deadline = time.monotonic() + timeout_s
    wanted = num_hosts if min_hosts is None else min_hosts
    while len(lease.epoch.members) < wanted:
      try:
        waiting()
      except BaseException:
        lease.close()
        raise
      if client.stopping:
        lease._ended("the job was stopped before it started")
      if time.monotonic() > deadline:
        client.close()
        raise MembershipError(
            f"host {host}: not every host joined within --initialization_timeout="
            f"{timeout_s:g}s: only hosts {list(lease.epoch.hosts)} of {wanted} registered "
            f"with the coordinator at {coordinator} (did every host start, with the same "
            "coordinator address and join token?)")
      time.sleep(min(0.05, lease.lease_s / 8))
      lease._heartbeat()
      if host in client.pending and host not in lease.epoch.hosts:
        # This coordinator had just started, and the hosts of a running job came back to
        # it (host 0 restarted, serving it): this host, started afresh, joins their job.
        lease.joining, client.registration = True, None
        return lease
    lease._thread = threading.Thread(target=lease._renew, name="lease", daemon=True)
    lease._thread.start()
    return lease

  def join(self) -> None:
    """A host that found the job running (`joining`): registers again, now ready, and waits
    for the members to admit it at a round boundary (an epoch with it), as long as the job
    has members: however long their round is."""
    try:
      registration = self.client.register(self.address, self.host)
    except coordinator_client.JobStopping as e:
      raise JobEnded(f"host {self.host}: {e}") from None
    except coordinator_client.CoordinatorError as e:
      raise MembershipError(f"host {self.host}: {e}") from None
    self.epoch = registration.epoch
    if not registration.pending:
      self._ended()
    print(f"host {self.host}: the job is running (epoch {self.epoch.number}, hosts "
          f"{list(self.epoch.hosts)}); waiting to be admitted at a round boundary", flush=True)
    # No deadline: a round may be longer than any timeout, and the wait ends as soon as
    # nobody is left to admit this host (the members' leases run out, or they stop)
    while self.host not in self.epoch.hosts:
      if self.lost is not None:
        raise self._out()
      if self.stopping:
        self._ended("the job it was to join is stopping (every member after the same round, "
                    "with a checkpoint): nothing to join")
      time.sleep(min(0.05, self.lease_s / 8))
      self._heartbeat()
    if self.epoch.hosts == (self.host,):  # the last member left while this host waited
      self._ended()
    self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
    self._thread.start()

  def _ended(self, why: str = "the job it was to join has no members left (it ended, or "
             "its hosts stopped: their logs say why); nothing to join") -> None:
    try:
      self.client.leave()
    except coordinator_client.CoordinatorError:
      pass  # its lease runs out
    self.lost = (f"host {self.host}: {why}. To go on training, start the whole job again: "
                 "it resumes from the hosts' checkpoints")
    raise JobEnded(self.lost)

  @property
  def stopping(self) -> bool:
    """Whether the whole job stops (the coordinator was asked to): every host after the
    same round, which a word on the sums decides (runtime/preemption.py)."""
    return self.client.stopping

  @property
  def pending(self) -> bool:
    """Whether a host waits to join (as the coordinator last said)."""
    return bool(self.client.pending)

  def _heartbeat(self) -> None:
    if self.client.registration is None:  # unknown to the coordinator: its registering
      self._unknown(self.client.boot)  # again failed, or it was dropped; one or the other
      return
    try:
      epoch = self.client.heartbeat(self.position, self.busy)
    except coordinator_client.CoordinatorLost as e:
      self._away(e)
      return
    except coordinator_client.Unregistered:  # the other thread found it unknown just now
      self._unknown(self.client.boot)
      return
    except (coordinator_client.CoordinatorError, zmq.ZMQError) as e:
      if not self._stop.is_set():  # else `close` took the client away under it
        self.lost = str(e)
      return
    if epoch is None:
      self._unknown(self.client.boot)
      return
    self._present()
    if epoch.number > self.epoch.number:
      self.epoch = epoch

  def _drop(self, why: str) -> None:
    if self.lost is None:
      self.lost, self.dropped = why, True

  def _out(self) -> MembershipError:
    return (Dropped if self.dropped else MembershipError)(self.lost)

  def rejoin(self) -> None:
    """After `Dropped`: this process becomes a joiner (`join` registers it ready and waits
    for a round boundary; it then takes the members' state, as a host started late)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=self.client.timeout_s + 1.0)
    self._stop, self._thread = threading.Event(), None
    with self._back:
      self.lost, self.dropped, self.joining, self.position = None, False, True, 0
      self.client.registration = None

  def _say(self, line: str) -> None:
    print(f"host {self.host}: {line}", file=sys.stderr, flush=True)

  def _away(self, e: BaseException) -> None:
    """The coordinator did not answer: wait for it, up to the grace."""
    now = time.monotonic()
    if self.away_since is None:
      self.away_since = now
      self._say(f"{e}; this host keeps its state and waits up to {self.grace_s:g} s for it "
                "(--coordinator_grace)")
    elif now - self.away_since > self.grace_s and self.lost is None:
      self.lost = (f"host {self.host}: the coordinator at {self.client.address} did not answer "
                   f"for {self.grace_s:g} s (--coordinator_grace)")

  def _present(self) -> None:
    if self.away_since is not None:
      self._say(f"the coordinator answers again after {time.monotonic() - self.away_since:.1f} s")
      self.away_since = None

  def _unknown(self, boot: str) -> None:
    """The coordinator does not know this host: if it is the one this host registered with,
    this host's lease ran out and the others went on without it; if it is another (it
    restarted), this host registers again and comes back (module docstring)."""
    with self._back:
      if self.client.registration is not None and boot == self._boot:
        return  # the other thread has registered again already
      if self.host not in self.epoch.hosts:
        self.lost = self.lost or (
            f"host {self.host}: the coordinator at {self.client.address} no longer knows "
            "this host, which was not a member of the job")
        return
      # Registered again whatever the coordinator: one that dropped this host (its lease ran
      # out) refuses a comeback after its first leases, and says so; one that started since
      # takes it back.
      try:
        registration = self.client.register(
            self.address, self.host, resume=(self.position, tuple(self.epoch.hosts)))
      except coordinator_client.CoordinatorLost as e:
        self._away(e)
        return
      except coordinator_client.CoordinatorError as e:  # the job went on without it
        self._drop(f"host {self.host}: {e}")
        return
      self._boot, self.epoch = registration.epoch.boot, registration.epoch
      self._present()
      self._say(f"registered again with the coordinator at {self.client.address} (it "
                f"restarted), at op {self.position} (epoch {self.epoch.number})")

  def _resumed(self, step: int, ok: bool):
    """The verdict on op `step` (this host's vote `ok`) after the coordinator restarted:
    once every host is back, the new epoch continues at the highest op any committed."""
    while True:
      if self.lost is not None:
        raise self._out()
      self._heartbeat()
      if self.client.registration is not None and not self.client.rebuilding:
        break
      time.sleep(min(0.5, self.lease_s / 8))
    first = self.epoch.first_step
    if first == step + 1 and ok:  # the lost coordinator committed it: every member holds it
      return coordinator_client.Verdict(True, self.epoch)
    if first == step:
      return coordinator_client.Verdict(False, self.epoch)
    self._drop(f"host {self.host}: after the coordinator's restart the other hosts continue "
               f"at op {first}, and this host {'held' if ok else 'failed'} op {step}: it "
               "cannot go on with them (it joins them again)")
    raise self._out()

  def _renew(self) -> None:
    try:
      while not self._stop.wait(self.lease_s / 4) and self.lost is None:
        self._heartbeat()
    except Exception as e:  # noqa: BLE001 -- never a thread that dies unsaid
      self.lost = f"host {self.host}: its lease's heartbeat failed: {type(e).__name__}: {e}"

  def patience(self, peer: int, step: int) -> str | None:
    """Why to go on waiting for `peer`, silent in op `step` (None: stop waiting): its lease
    is alive and, as it last said, it has not reached that op (a slower host, one still
    compiling) or the coordinator is away and cannot say."""
    if self.lost is not None or peer not in self.epoch.hosts:
      return None
    if self.away_since is not None:
      return "the coordinator is away, and with it the word on that host"
    committed, busy = self.client.positions.get(peer, (step, True))
    if committed < step or (committed == step and not busy):
      return (f"it is alive (its lease) and has not reached this op: it has committed "
              f"{committed} ops{'' if busy else ' and is training'}")
    return None

  def interrupt(self, members: tuple[int, ...], peer: int | None = None,
                unreachable_s: float | None = None) -> str | None:
    """Why an op among `members` cannot complete (None: it may): the coordinator is lost, a
    newer epoch has dropped one of them, or `peer`, which the op waits on, is frozen: its
    zmq stopped answering (`unreachable_s`, wire/departed.py) and it has renewed no lease
    for half of one. Every member that waits on a frozen host names it, and the coordinator
    drops it at once (votes.unanimous), not at its lease's end. A host that is only busy
    (its heartbeat thread stalled behind the GIL) still answers zmq, and is waited for."""
    if self.lost is not None:
      return self.lost
    gone = sorted(set(members) - set(self.epoch.hosts))
    if gone:
      return f"the coordinator dropped host(s) {gone} (epoch {self.epoch.number})"
    if peer is None or unreachable_s is None:
      return None
    quiet = self.client.unheard_s(peer, self.lease_s / 2)
    if quiet is not None and quiet >= self.lease_s / 2:
      return (f"host {peer} is frozen or cut off: it has renewed no lease for {quiet:.1f} s "
              f"and its wire has not answered for {unreachable_s:.1f} s")
    return None

  def commit(self, epoch: int, step: int, ok: bool, suspect: int | None,
             boundary: bool = False):
    """The coordinator's verdict on op `step` of `epoch` (`coordinator_client.Verdict`);
    `boundary`: the op ends a round, and its commit admits the hosts waiting to join."""
    with self._back:
      self.position = step
    while True:
      if self.lost is not None:
        raise self._out()
      try:
        verdict = self.client.commit(epoch, step, ok, suspect, boundary=boundary)
        break
      except coordinator_client.CoordinatorLost as e:
        self._away(e)  # the verdict waits for the coordinator, up to the grace
        time.sleep(min(1.0, self.lease_s / 4))
      except coordinator_client.Unknown as e:
        self._unknown(e.boot)
        return self._resumed(step, ok)
      except coordinator_client.Unregistered:  # the heartbeat thread found it unknown
        self._unknown(self.client.boot)  # first: it registers again (or has)
        return self._resumed(step, ok)
      except coordinator_client.CoordinatorError as e:
        self.lost = self.lost or f"host {self.host}: {e}"
        raise MembershipError(self.lost) from None
    self._present()
    if verdict.commit:
      with self._back:
        self.position = step + 1
    if verdict.epoch.number > self.epoch.number:
      self.epoch = verdict.epoch
    if self.host not in verdict.epoch.hosts:
      self._drop(f"host {self.host}: dropped from the job at epoch {verdict.epoch.number} "
                 "(its peers found it silent)")
      raise self._out()
    return verdict

  def close(self, leave: bool = True) -> None:
    """Stops renewing; `leave`: tells the coordinator, so the others need not wait for the
    lease to run out."""
    self._stop.set()
    if leave and self.lost is None:
      try:
        self.client.leave()
      except coordinator_client.CoordinatorError:
        pass  # it drops this host when the lease runs out
    # an op still running (an async mode's sum in flight, on the dispatch thread) ends at
    # its next check instead of waiting for peers that have moved on without this host
    self.lost = self.lost or f"host {self.host} left the job"
    if self._thread is not None:  # (a request in flight ends within the client's timeout)
      self._thread.join(timeout=self.client.timeout_s + 1.0)
      if self._thread.is_alive():  # blocked on a coordinator that does not answer: the
        return  # socket stays its own until the process ends
    self.client.close()

