"""Hosts with their own disks agree where to resume, and a host without a checkpoint heals.

At start every host lists the complete checkpoints on its own disk (checkpoints/per_host.py)
and the hosts all-gather what each holds: per checkpoint its round, the host that wrote
it, the sha256 of its shared state (the outer state, the same on every host) and the id
of the run that wrote it. From that table every host computes the same `Plan`:

  - checkpoints of another run beside this run's, or two hosts whose shared state differs
    at the same round, stop the job with one line naming the hosts and rounds: one is
    never picked silently, and nothing is deleted;
  - the round is the newest that every host holding any checkpoint holds (then the run
    continues bit for bit as if never stopped) if it is the newest round any host holds or
    the one before (a job stops as one, with at most the last save unfinished on some
    host); else the newest any host holds: a host whose checkpoints are older (its disk
    from before the host count changed) heals rather than roll every other host back;
  - a host that does not hold that round (a new machine, a wiped or unreadable disk, or a
    host id the checkpoint's world did not have) heals: the lowest host that holds it
    sends the bytes of its meta.json and shared.safetensors, as on its disk, over the
    job's own collective (`Collective.broadcast`: point to point on the epoch wire), and
    the receiver checks them before using them: meta.json's own sha256, the shared file's
    sha256 against the one meta.json records, and the shared state's hash recorded there
    against the table's.

A checkpoint a host cannot read (its meta.json, or a file of the chosen round when read)
counts as not held: it is named in one line on that host, the table is gathered again,
and the plan is made again without it.

A healed host has no replica state of its own: its replicas start from the anchor
(`loop.state.restore`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from diloco_jax import units
from diloco_jax.checkpoints import files
from diloco_jax.checkpoints import store

# Per checkpoint: round, writer, sha256 (8 words), run id (4 words). int32: the collective
# carries what jax does, and jax without x64 would cut int64 words in half.
WORDS = 14
PATH_BYTES = 512  # of each host's checkpoint directory, for the messages



@dataclasses.dataclass(frozen=True)
class Held:
  """One complete checkpoint on a host's disk: its round, the host id that wrote it, the
  sha256 (hex) of its shared state and its run's id (32 hex digits; "" if unknown)."""
  round: int
  writer: int
  sha: str
  run_id: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every host does (the same on every host). round 0: start from scratch."""
  round: int
  source: int = -1  # the host whose shared state the others take (-1: none needed)
  sha: str = ""
  run_id: str = ""
  heal: tuple[int, ...] = ()  # hosts that do not hold `round`


def _words(hex_digits: str) -> np.ndarray:
  return np.frombuffer(bytes.fromhex(hex_digits), ">i4").astype(np.int32)


def _hex(words: np.ndarray) -> str:
  return np.asarray(words).astype(">i4").tobytes().hex()


def encode(held: list[Held], unreadable: list[int], rows: int | None = None) -> np.ndarray:
  """int32 [1 + rows, WORDS]: row 0 the counts of held and unreadable checkpoints, then a
  row per held checkpoint, then a row per unreadable one (its round), then empty rows
  (-1). `rows` (at least the two counts' sum): the same on every host, so that the tables
  can be gathered; no limit on how many checkpoints a host keeps."""
  rows = len(held) + len(unreadable) if rows is None else rows
  assert rows >= len(held) + len(unreadable), (rows, len(held), len(unreadable))
  out = np.full((1 + rows, WORDS), -1, np.int32)
  out[0, :2] = len(held), len(unreadable)
  for row, h in zip(out[1:], held):
    row[0], row[1] = h.round, h.writer
    row[2:10] = _words(h.sha)
    row[10:14] = _words(h.run_id.ljust(32, "0"))
  out[1 + len(held):1 + len(held) + len(unreadable), 0] = sorted(unreadable, reverse=True)
  return out


def decode(table: np.ndarray) -> tuple[list[Held], list[int]]:
  table = np.asarray(table, np.int32)
  n_held, n_bad = int(table[0, 0]), int(table[0, 1])
  held = [Held(int(row[0]), int(row[1]), _hex(row[2:10]), _hex(row[10:14]))
          for row in table[1:1 + n_held]]
  return held, [int(r) for r in table[1 + n_held:1 + n_held + n_bad, 0]]


def _hosts(hosts) -> str:
  hosts = sorted(hosts)
  return f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {', '.join(map(str, hosts))}"


def _where(hosts, paths: list[str] | None) -> str:
  """Which hosts, with their checkpoint directories when known."""
  return _hosts(hosts) + (f" ({', '.join(paths[h] for h in sorted(hosts))})" if paths else "")


def plan(tables: list[tuple[list[Held], list[int]]], paths: list[str] | None = None) -> Plan:
  """The plan from every host's (held, unreadable rounds), in host order (module
  docstring); `paths`, each host's checkpoint directory, for the messages. Raises
  store.CheckpointError, the same on every host, when no plan is safe."""
  held = {h: [c for c in cs if c.writer == h] for h, (cs, _) in enumerate(tables)}
  runs: dict[str, list[int]] = {}
  for h, cs in held.items():
    for rid in sorted({c.run_id for c in cs}):
      runs.setdefault(rid, []).append(h)
  if len(runs) > 1:
    ours = max(runs, key=lambda rid: (len(runs[rid]), -min(runs[rid])))
    other = {rid: hs for rid, hs in runs.items() if rid != ours}
    rid, hs = next(iter(other.items()))
    rounds = sorted({c.round for h in hs for c in held[h] if c.run_id == rid})
    raise store.CheckpointError(
        f"{_where(hs, paths)}: checkpoints of another run (run {rid[:8]}, rounds {rounds}) "
        f"than {_hosts(runs[ours])} (run {ours[:8]}): each host's --workdir must "
        f"hold this run's checkpoints or none. Nothing was deleted: move the other run's "
        f"aside on {_hosts(hs)}, or give it a new --workdir")
  by_round: dict[int, dict[int, str]] = {}
  for h, cs in held.items():
    for c in cs:
      by_round.setdefault(c.round, {})[h] = c.sha
  for r in sorted(by_round, reverse=True):
    if len(set(by_round[r].values())) > 1:
      shas = by_round[r]
      first = shas[min(shas)]
      odd = [h for h, s in shas.items() if s != first]
      raise store.CheckpointError(
          f"hosts disagree on the shared state of round {r}: "
          f"{_where(shas.keys() - set(odd), paths)}: sha256 {first[:12]}; "
          f"{_where(odd, paths)}: sha256 {shas[odd[0]][:12]}. Neither is "
          f"chosen and nothing was deleted: move the wrong host's checkpoints aside (its "
          f"replicas then heal from the others)")
  holders = [h for h, cs in held.items() if cs]
  if not holders:
    bad = {h: b for h, (_, b) in enumerate(tables) if b}
    if bad:
      raise store.CheckpointError(
          f"no host in this job holds a usable checkpoint to resume or heal from: "
          f"{'; '.join(f'{_where([h], paths)} cannot read rounds {b}' for h, b in bad.items())}. "
          f"Nothing was deleted: if a disk was missing for a moment, run the same command "
          f"again; to start over, add --restart_from_scratch (the old run is moved aside)")
    return Plan(0)
  common = set.intersection(*({c.round for c in held[h]} for h in holders))
  newest = sorted(by_round, reverse=True)[:2]  # the newest round anyone holds, the one before
  r = max(common) if common and max(common) in newest else newest[0]
  source = min(by_round[r])
  heal = tuple(h for h in range(len(tables)) if h not in by_round[r])
  return Plan(r, source, by_round[r][source], next(iter(runs)), heal)


def resume(checkpointer, like: Callable[[dict], store.Snapshot],
           check_meta: Callable[[dict], None]
           ) -> tuple[store.Snapshot | None, store.Recovered | None]:
  """The snapshot this host resumes from (`own` None: it heals) and what was done; (None,
  None) when no host holds a checkpoint. Every host calls it at the same time."""
  c = checkpointer
  run = c.dispatcher.run
  mine = np.frombuffer(c.directory.encode()[:PATH_BYTES].ljust(PATH_BYTES, b"\0"), np.uint8)
  paths = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in
           run(c.collective.allgather, mine, what="comparing the hosts' checkpoints")]
  shared_file = files.filename("shared")
  while True:
    held, bad = c.held(), c.unreadable()
    rows = run(c.collective.allgather, np.array([len(held) + len(bad)], np.int32),
               what="comparing the hosts' checkpoints").max()
    tables = run(c.collective.allgather, encode(held, bad, int(rows)),
                 what="comparing the hosts' checkpoints")
    p = plan([decode(t) for t in tables], paths)
    if p.round == 0:
      return None, None
    # The plan numbers hosts by their rows; a live job's rows are its live hosts, in order.
    ids = list(c.collective.live)
    p = dataclasses.replace(p, source=ids[p.source], heal=tuple(ids[h] for h in p.heal))
    snap, error, sent = None, None, None
    if c.host not in p.heal:
      try:
        snap = c.read(p.round, like)
        if p.heal and c.host == p.source:  # the bytes a heal sends, as on disk, checked
          sent = c.file_bytes(p.round, files.META), c.file_bytes(p.round, shared_file)
          files.check(sent[1], snap.meta["files"][shared_file], c.path(p.round, shared_file))
      except Exception as e:  # noqa: BLE001 -- any read failure: the plan is made without it
        error = e
        c.mark_unreadable(p.round, e)
    refused = None
    if snap is not None:
      try:
        check_meta(snap.meta)  # the config and world: agreed on before anyone goes on
      except store.CheckpointError as e:
        refused = e
    flags = run(c.collective.allgather, np.array([error is None, refused is None], np.int32),
                what="agreeing on a readable checkpoint")
    if refused is not None:
      raise refused
    if not flags[:, 1].all():
      bad = [h for h in range(len(flags)) if not flags[h, 1]]
      raise store.CheckpointError(f"checkpoint {p.round} does not fit this run on host(s) {bad} "
                            f"(their log says why)")
    if flags[:, 0].all():
      break
  if not p.heal:
    return snap, store.Recovered(p.round, p.source, ())
  if snap is not None:
    snap = dataclasses.replace(snap, missing=p.heal)
  t = time.perf_counter()
  raw_meta, payload = run(c.collective.broadcast, list(sent) if c.host == p.source else None,
                          p.source, what="healing a host")
  seconds = time.perf_counter() - t
  if c.host in p.heal:
    where = f"checkpoint {p.round} received from host {p.source}"
    meta = files.load_meta(raw_meta, f"{where} ({files.META})")
    if meta["shared_sha256"] != p.sha:
      raise store.CheckpointError(f"host {c.host}: {where}: its shared state's hash is not "
                                  f"the one the hosts agreed on: not used")
    files.check(payload, meta["files"][shared_file], f"host {c.host}: {where} ({shared_file})")
    check_meta(meta)
    shared = files.to_tree(payload, like(meta).shared, meta["files"][shared_file],
                           f"{where} ({shared_file})")
    snap = store.Snapshot(p.round, shared, None, meta, p.heal)
    print(f"host {c.host} healed from host {p.source}: outer state "
          f"{units.format_bytes(len(payload))} in {seconds:.1f} s at round {p.round}",
          flush=True)
  return snap, store.Recovered(p.round, p.source, p.heal, len(payload), seconds)

