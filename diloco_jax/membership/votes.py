"""The coordinator's record of a job's cross-host ops: the votes on the ops still undecided in
the current epoch, and the verdict on each op once decided (the rules: membership/coordinator.py).

Without sockets, clocks or members: the Ledger (membership/ledger.py) says who the members
are, opens the epochs and asks this record what is decided.
"""

from __future__ import annotations

import collections

from diloco_jax.membership.protocol import BadRequest

VERDICTS_KEPT = 256  # a member further behind than this many ops is told nothing
MAX_REDOS = 32  # tries of one op, in as many epochs, before the job is given up
Vote = tuple[bool, "int | None", bool]  # ok, suspect, boundary


class Votes:
  """Attributes: next_step, the op after the last one committed; open, the current epoch's
  undecided ops (step -> host -> its vote, in the order voted); accused, step -> when its
  first not-ok vote came. A vote for an ended epoch is never open."""

  def __init__(self):
    self.next_step = 0
    self.open: dict[int, dict[int, Vote]] = {}
    self.accused: dict[int, float] = {}
    # (epoch, step) -> (commit, the epoch current when decided, the hosts it admitted), in
    # the order decided; and the highest (epoch, step) whose verdict was let go
    self._verdicts: collections.OrderedDict[
        tuple[int, int], tuple[bool, dict, tuple[int, ...]]] = collections.OrderedDict()
    self._forgotten = (-1, -1)
    self.tries: dict[int, int] = {}  # step -> epochs it was redone in (since its last commit)

  def first_open(self) -> int:
    """The op an epoch opened now continues at: the undecided one, redone, else the next."""
    return min(self.open, default=self.next_step)

  def decide(self, key: tuple[int, int], commit: bool, epoch: dict,
             admitted: tuple[int, ...] = ()) -> None:
    self._verdicts[key] = (commit, epoch, admitted)
    while len(self._verdicts) > VERDICTS_KEPT:
      self._forgotten = max(self._forgotten, self._verdicts.popitem(last=False)[0])

  def redo_open(self, ended: int, epoch: dict) -> None:
    """Epoch `ended` ended: each of its undecided ops is redone in `epoch` (rule 2)."""
    for step in self.open:
      self.decide((ended, step), False, epoch)
      self.tries[step] = self.tries.get(step, 0) + 1
    self.open, self.accused = {}, {}

  def check(self, host: int, key: tuple[int, int], current: int, member_since: int | None,
            resumed_from: int) -> None:
    """BadRequest for a vote on `key` that no verdict may answer: of an epoch above the
    current, of one `host` was not a member of (`member_since`: the first it was in; a host
    that came back to a restarted coordinator may vote on the lost one's epochs, up to
    `resumed_from`: redone), or too old to be decided again without contradicting itself."""
    e, step = key
    if e > current:
      raise BadRequest(f"commit vote of host {host} for epoch {e}, above the current {current}")
    if e > resumed_from and (member_since is None or member_since > e):
      raise BadRequest(f"commit vote of host {host} for op {step} of epoch {e}, which it is "
                       "not a member of, and which has no verdict")
    if key <= self._forgotten:
      raise BadRequest(f"commit vote of host {host} for op {step} of epoch {e}: more than "
                       f"{VERDICTS_KEPT} ops ago, its verdict is no longer kept")

  def cast(self, host: int, step: int, vote: Vote, now: float) -> dict[int, Vote]:
    """`host`'s vote on op `step` of the current epoch (counted once: a poll repeats it);
    every vote on it so far."""
    votes = self.open.setdefault(step, {})
    if not votes.setdefault(host, vote)[0]:
      self.accused.setdefault(step, now)
    return votes

  def committed(self, step: int) -> None:
    del self.open[step]
    self.accused.pop(step, None)
    self.tries.pop(step, None)
    self.next_step = step + 1

  def due(self, now: float, accuse_s: float) -> int | None:
    """The op whose first not-ok vote is `accuse_s` old (the oldest such), if any."""
    due = [(t, step) for step, t in self.accused.items() if t + accuse_s <= now]
    return min(due)[1] if due else None

  def answer(self, key: tuple[int, int]) -> dict:
    """The verdict on `key` as a member is told it, or a wait."""
    if key not in self._verdicts:
      return {"op": "wait"}
    commit, after, admitted = self._verdicts[key]
    return {"op": "verdict", "epoch": key[0], "step": key[1], "commit": commit, "next": after,
            "admitted": list(admitted)}

  def decided(self, key: tuple[int, int]) -> bool:
    return key in self._verdicts


def judge(members: list[int], named: dict[int, int | None]) -> tuple[set[int], str]:
  """Who leaves when an op failed: `named` maps each member whose vote was not ok to the
  member it named (None: none). By evidence, not by the first timer:
  - a member that names itself leaves (its op failed again and again with no peer to blame);
  - a member named by a strict majority of the other members leaves;
  - when that would leave no one (two hosts naming each other, an even split), the side of
    the lowest host id stays: it and the members it does not name and that do not name it;
  - an accusation no majority backs, between two members that stay, makes the accuser leave:
    it cannot work with a member the others can (a bad link of its own, or a liar); of two
    that name each other, the higher id.
  Returns the members that leave and why, in words."""
  n, everyone = len(members), set(members)
  edges = sorted(((a, s) for a, s in named.items() if s in everyone and s != a), reverse=True)
  counts = collections.Counter(s for _, s in edges)
  itself = {a for a, s in named.items() if s == a}
  backed = {x for x, c in counts.items() if 2 * c > n - 1}
  leave, why = itself | backed, []
  if itself:
    why.append(f"host(s) {_ids(itself)} named itself")
  if backed:
    why.append("; ".join(f"host {x} named by {counts[x]} of the {n - 1} others"
                          for x in sorted(backed)))
  if leave >= everyone:  # nobody would stay: keep the lowest host's side
    low = min(members)
    leave = {h for h in members if h != low and ((low, h) in edges or (h, low) in edges
                                                  or h in itself)}
    why = [f"hosts {_ids(everyone)} named each other and no majority tells them apart: "
           f"host {low}'s side stays"]
  for a, s in edges:
    if a not in leave and s not in leave:
      leave.add(a)
      why.append(f"host {a} named host {s}, which no majority of the others did")
  return leave, "; ".join(why)


def unanimous(votes: dict[int, Vote], members) -> bool:
  """Whether op's `votes` can be judged before the last member's vote: every member but
  one voted not ok naming that one, and they are at least two. `judge` then makes it leave
  whatever it votes (named by every other member; its own accusation backed by one of
  them at most, which is no majority of two or more)."""
  silent = [h for h in members if h not in votes]
  return (len(silent) == 1 and len(votes) >= 2
          and all(not ok and suspect == silent[0] for ok, suspect, _ in votes.values()))


def _ids(hosts) -> str:
  return ",".join(map(str, sorted(hosts)))
