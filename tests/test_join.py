"""A failure during a live join (issue 46): none ends or corrupts the run.

Each test starts a membership coordinator (membership/coordinator.py) and host processes
(tests/join_main.py: the lease, the epoch wire, the round boundary and the state transfer as
loop/join.py runs them, without training), then asserts exact outcomes from their lines:
- the joiner dies mid-transfer: the members redo the transfer without it and finish;
- the source dies mid-transfer: the joiner takes the state from the next lowest member;
- two joiners at once: both are admitted and every host finishes with all four (also with
  one of them below every member: an expected failure, a bug of the transfer's source);
- a joiner admitted before it is ready (a race of `Lease.start`, made certain here): the
  members do the transfer without it and admit it again once it is;
- a member frozen for many leases: the others drop it and go on, nothing of it reaches a
  later epoch, and it registers again as a new incarnation and joins.
In each, every member checks at every round that all rows of an all-gather of the round
equal it (no host is a round apart).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench.harness import free_port

pytestmark = pytest.mark.multihost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "tests", "join_main.py")
LEASE_S = 1.0
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("DILOCO_JOIN_TOKEN")},
       "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


class Proc:
  """A process started by a test; a thread keeps its output (stdout and stderr) by line."""

  def __init__(self, name: str, cmd: list[str], env: dict | None = None):
    self.name, self.lines = name, []
    self._seen = threading.Condition()
    self.popen = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.popen.stdout:
      with self._seen:
        self.lines.append(line.rstrip("\n"))
        self._seen.notify_all()
    with self._seen:
      self._seen.notify_all()

  @property
  def text(self) -> str:
    with self._seen:
      return "\n".join(self.lines)

  def wait_for(self, pattern: str, deadline: float) -> re.Match:
    """The first line that matches `pattern`, waiting until `deadline` (monotonic)."""
    regex, checked = re.compile(pattern), 0
    with self._seen:
      while True:
        for line in self.lines[checked:]:
          if m := regex.search(line):
            return m
        checked = len(self.lines)
        left = deadline - time.monotonic()
        if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
          raise AssertionError(f"{self.name}: no line matching {pattern!r}")
        self._seen.wait(min(left, 0.1))

  def finish(self, deadline: float) -> int:
    try:
      rc = self.popen.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      raise AssertionError(f"{self.name}: still running at the deadline") from None
    self._reader.join(5)
    return rc

  def stop(self, sig: int = signal.SIGKILL) -> None:
    if self.popen.poll() is None:
      os.kill(self.popen.pid, signal.SIGCONT)  # a frozen one, too
      os.kill(self.popen.pid, sig)
      try:
        self.popen.wait(5)
      except subprocess.TimeoutExpired:
        self.popen.kill()
    self.popen.wait(5)
    self._reader.join(5)


class Job:
  """A coordinator and the hosts a test starts; their output, on failure."""

  def __init__(self, max_hosts: int, rounds: int, size: int, round_s: float = 0.1,
               **hooks: str):
    self.rounds, self.size = rounds, size
    self.env = {**ENV, "JOIN_ROUND_S": str(round_s), **hooks}  # tests/join_main.py's
    self.hosts: dict[int, Proc] = {}
    for _ in range(3):  # a port free a moment ago may be taken by the time it listens
      self.port = free_port()
      self.coordinator = Proc("coordinator", [
          sys.executable, "-m", "diloco_jax.membership.coordinator", f"--port={self.port}",
          f"--max_hosts={max_hosts}", f"--lease_s={LEASE_S}"])
      try:
        self.coordinator.wait_for("listening on", time.monotonic() + 30)
        return
      except AssertionError:
        self.coordinator.stop()
    raise AssertionError(f"no coordinator listening:\n{self.coordinator.text}")

  def start(self, host: int, num_hosts: int, fault: str = "") -> Proc:
    cmd = [sys.executable, MAIN, str(host), str(self.port), str(num_hosts), str(self.rounds),
           str(self.size)] + ([fault] if fault else [])
    self.hosts[host] = Proc(f"host {host}", cmd, self.env)
    return self.hosts[host]

  def started(self, hosts, timeout: float = 30) -> None:
    """Waits until each of `hosts` ran its first op (the job runs: a host registering now
    is a joiner)."""
    deadline = time.monotonic() + timeout
    for h in hosts:
      self.hosts[h].wait_for(rf"^host {h}: started with hosts", deadline)

  def finish(self, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    return {h: p.finish(deadline) for h, p in self.hosts.items()}

  def report(self) -> str:
    return "\n".join(f"--- {p.name}:\n{p.text}"
                     for p in [self.coordinator, *self.hosts.values()])

  def close(self) -> None:
    for p in self.hosts.values():
      p.stop()
    self.coordinator.stop(signal.SIGTERM)


@contextlib.contextmanager
def job(*args, **kwargs):
  j = Job(*args, **kwargs)
  try:
    yield j
  except AssertionError as e:
    j.close()
    raise AssertionError(f"{e}\n{j.report()}") from None
  except BaseException:
    j.close()
    raise
  j.close()
  if os.environ.get("JOIN_TEST_VERBOSE"):  # every process's lines, with -s
    print(j.report())


def lines(proc: Proc, pattern: str) -> list[re.Match]:
  return [m for line in proc.lines if (m := re.search(pattern, line))]


def admitted(proc: Proc) -> list[tuple[list[int], int, int]]:
  """([hosts], round, source) of each `admitted` line of a member."""
  return [([int(h) for h in m[1].split(", ")], int(m[2]), int(m[3])) for m in
          lines(proc, r"^host \d+: admitted \[([\d, ]+)\] at round (\d+), sent by host (\d+)$")]


def joined(proc: Proc, size: int) -> list[tuple[int, int]]:
  """(round, source) of each `joined` line of a joiner; its body had `size` bytes."""
  return [(int(m[1]), int(m[2])) for m in
          lines(proc, rf"^host \d+: joined at round (\d+) from host (\d+), {size} bytes, "
                      r"sha ok")]


def early(j: Job, host: int) -> int:
  """How often `host` was admitted before it was ready, as the coordinator saw it: an
  admission that its own ready registration (`host H pending`) did not precede, after which
  it leaves as a member (`epoch E: hosts .. (host H left)`). Must be 0: a host that finds
  the job running only probes (registers not ready: no lease, in no list) until it is
  built, so no boundary can admit it early."""
  log = j.coordinator.lines
  ready = max((i for i, line in enumerate(log) if f": host {host} pending:" in line), default=-1)
  return sum(bool(re.search(rf": epoch \d+: hosts [\d,]+ \(host {host} left\)$", line))
             for line in log[:ready])


def assert_admissions(j: Job, members, joiners: dict[int, int], size: int) -> list:
  """The members' `admitted` lines agree, and each joiner that joined (`joiners`: host ->
  the member expected to send it the state) has one line at the round it joined, from that
  sender; any earlier line naming it is an early admission (`early`); no later one. A host
  that joined says the same from the round it joined on. Returns the members' lines."""
  seen = admitted(j.hosts[members[0]])
  for m in members:
    assert admitted(j.hosts[m]) == seen, f"hosts {members[0]} and {m} admitted differently"
  for host, source in joiners.items():
    (r, s), = joined(j.hosts[host], size)
    assert s == source, f"host {host} got the state from host {s}, not host {source}"
    naming = [(rr, ss) for hosts, rr, ss in seen if host in hosts]
    assert naming and naming[-1] == (r, s), (host, naming, r, s)
    assert len(naming) == 1 and early(j, host) == 0, (host, naming)
    assert admitted(j.hosts[host]) == [a for a in seen if a[1] > r], host
  return seen


def assert_in_step(j: Job) -> None:
  """No host saw another a round apart, and none stopped on a failed check."""
  for p in j.hosts.values():
    assert not lines(p, r"a round apart|is not the one its header hashed|Traceback"), p.name


def assert_done(j: Job, hosts, live) -> None:
  for h in hosts:
    assert lines(j.hosts[h], rf"^host {h}: done at round {j.rounds} with hosts "
                             rf"{re.escape(str(live))}$"), f"host {h} did not finish with {live}"


def test_the_joiner_dies_mid_transfer_and_the_members_finish_without_it():
  rounds, size = 60, 8 << 20
  with job(max_hosts=3, rounds=rounds, size=size) as j:
    j.start(0, 2), j.start(1, 2)
    j.started([0, 1])
    joiner = j.start(2, 2, "die_receiving")
    rc = j.finish(timeout=60)
    assert rc == {0: 0, 1: 0, 2: 3}
    # It died with the header in hand, the body on its way.
    assert lines(joiner, r"^host 2: got a header of \d+ bytes from host 0; dying before the "
                         r"body$")
    assert not joined(joiner, size)
    # The members admitted it at the same round, the transfer failed with it and they did
    # it again without it (host 0 says so), then went on to the end without it.
    seen = assert_admissions(j, [0, 1], {}, size)
    assert len(seen) == 1 and early(j, 2) == 0
    assert all(hosts == [2] and 0 < r < rounds and s == 0 for hosts, r, s in seen), seen
    assert lines(j.hosts[0], r"^WARNING: host\(s\) \[2\] left \(epoch \d+\); continuing with "
                             r"hosts \[0, 1\]; the state transfer is done again without them")
    assert lines(j.coordinator, r"epoch \d+: hosts 0,1 \(lease of host 2 ran out\)")
    assert_done(j, [0, 1], [0, 1])
    assert_in_step(j)


def test_the_source_dies_mid_transfer_and_the_next_lowest_member_serves_the_joiner():
  rounds, size = 60, 4 << 20
  with job(max_hosts=4, rounds=rounds, size=size) as j:
    j.start(0, 3, "die_sending"), j.start(1, 3), j.start(2, 3)
    j.started([0, 1, 2])
    j.start(3, 3)
    rc = j.finish(timeout=60)
    assert rc == {0: 3, 1: 0, 2: 0, 3: 0}
    assert lines(j.hosts[0], r"^host 0: sent the header to host 3; dying before the body$")
    # Host 1 sent it again, from the same round's state: the joiner took that one whole.
    assert_admissions(j, [1, 2], {3: 1}, size)
    assert lines(j.coordinator, r"epoch \d+: hosts 1,2,3 \((lease of )?host 0 ")
    assert_done(j, [1, 2, 3], [1, 2, 3])
    assert_in_step(j)


@pytest.mark.parametrize("together", [True, False], ids=["one_boundary", "as_they_come"])
def test_two_joiners_at_once_are_both_admitted_and_every_host_finishes_with_all(
    together, tmp_path):
  """`together`: both are admitted at one boundary, for certain (the members wait for two
  hosts waiting, the joiners register ready at once); else each when the members see it."""
  rounds, size = 50, 1 << 20
  hooks = {"JOIN_ADMIT_AT": "2", "JOIN_BARRIER": f"{tmp_path}:2"} if together else {}
  with job(max_hosts=4, rounds=rounds, size=size, **hooks) as j:
    j.start(0, 2), j.start(1, 2)
    j.started([0, 1])
    j.start(2, 2), j.start(3, 2)
    rc = j.finish(timeout=60)
    assert rc == {0: 0, 1: 0, 2: 0, 3: 0}
    assert_admissions(j, [0, 1], {2: 0, 3: 0}, size)
    (r2, _), = joined(j.hosts[2], size)
    (r3, _), = joined(j.hosts[3], size)
    if together:
      assert r2 == r3
    assert_done(j, [0, 1, 2, 3], [0, 1, 2, 3])
    assert_in_step(j)


def test_a_joiner_is_admitted_only_once_it_registers_ready():
  """The joiner waits a second between finding the job running and registering ready: the
  members run on without admitting it (it is in no list), then admit it once, and one
  transfer serves it."""
  rounds, size = 50, 1 << 20
  with job(max_hosts=3, rounds=rounds, size=size, JOIN_READY_DELAY_S="1") as j:
    j.start(0, 2), j.start(1, 2)
    j.started([0, 1])
    j.start(2, 2)
    rc = j.finish(timeout=60)
    assert rc == {0: 0, 1: 0, 2: 0}
    assert early(j, 2) == 0
    assert len(assert_admissions(j, [0, 1], {2: 0}, size)) == 1
    assert not lines(j.hosts[0], r"the state transfer is done again")
    assert_done(j, [0, 1, 2], [0, 1, 2])
    assert_in_step(j)


@pytest.mark.slow
def test_two_joiners_at_one_boundary_one_below_every_member_take_the_state_from_a_member(
    tmp_path):
  rounds, size = 40, 1 << 20
  hooks = {"JOIN_ADMIT_AT": "2", "JOIN_BARRIER": f"{tmp_path}:2", "JOIN_WIRE_TIMEOUT_S": "5"}
  with job(max_hosts=4, rounds=rounds, size=size, **hooks) as j:
    j.start(1, 2), j.start(2, 2)
    j.started([1, 2])
    j.start(0, 2), j.start(3, 2)
    rc = j.finish(timeout=60)
    assert rc == {0: 0, 1: 0, 2: 0, 3: 0}
    assert_admissions(j, [1, 2], {0: 1, 3: 1}, size)
    assert_done(j, [0, 1, 2, 3], [0, 1, 2, 3])
    assert_in_step(j)


@pytest.mark.slow
def test_a_frozen_member_is_dropped_then_joins_again_as_a_new_incarnation():
  rounds, size, frozen_s = 130, 1 << 20, 10.0
  with job(max_hosts=3, rounds=rounds, size=size, round_s=0.12) as j:
    j.start(0, 3), j.start(1, 3, "rejoin"), j.start(2, 3)
    j.started([0, 1, 2])
    time.sleep(0.5)  # a few rounds
    late = j.hosts[1]
    os.kill(late.popen.pid, signal.SIGSTOP)
    time.sleep(frozen_s)
    # Meanwhile the others dropped it and went on: past many rounds, without it. Each named
    # it once it had renewed no lease for half of one (lease.interrupt): no wait for its end.
    assert lines(j.coordinator, r"epoch \d+: hosts 0,2 \(op \d+ of epoch \d+ failed on "
                                r"host\(s\) 0,2: host 1 named by 2 of the 2 others\)")
    assert lines(j.hosts[0], r"^WARNING: host\(s\) \[1\] left \(epoch \d+\); continuing "
                             r"with hosts \[0, 2\]")
    assert not admitted(j.hosts[0]) and not lines(late, "dropped")
    os.kill(late.popen.pid, signal.SIGCONT)
    rc = j.finish(timeout=60)
    assert rc == {0: 0, 1: 0, 2: 0}
    # It found itself dropped (nothing it sent counted: the others' rows stayed their
    # round), registered again and joined from host 0.
    said = [line for line in late.lines if line.startswith("host 1: ")]
    assert re.match(r"host 1: dropped: ", said[1]), said
    assert said[2] == "host 1: registered again, as a joiner", said
    assert_admissions(j, [0, 2], {1: 0}, size)
    assert lines(j.coordinator, r"epoch \d+: hosts 0,1,2 \(host\(s\) 1 admitted after op")
    assert_done(j, [0, 1, 2], [0, 1, 2])
    assert_in_step(j)
