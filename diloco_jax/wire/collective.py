"""Cross-host reductions of pytrees that live in host memory.

`HostCollective` runs over `jax.distributed`: a global mesh with one CPU device per host
(the accelerators keep computing while gloo moves the bytes over TCP). A pytree is packed
into one flat buffer per dtype, so a round costs one collective however many leaves the
model has. `LocalCollective` is the single-host version: no network, same interface.

Call these only from the dispatch thread (`dispatch.py`): every host must issue the same
collectives in the same order, and two threads issuing collectives at once crash gloo.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any
from typing import Callable
from typing import Protocol
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.algo import compress

HOSTS_AXIS = "hosts"
BROADCAST_BYTES = 64 << 20  # one sum of HostCollective.broadcast
PyTree = Any
T = TypeVar("T")


class Collective(Protocol):
  """Sums and gathers across the hosts of a job, issued from the dispatch thread only.

  Attributes:
    num_hosts: the job's host count (replicas keep their places in [K] vectors).
    host_index: this host's index among them.
    live: the hosts that take part in the next op, in order (every host, unless live
      membership has lost some).
    bytes_sent: what this host has put on the wire over the run.
    device: the CPU device the sums start from and end on, where the collective has one
      (jax.distributed's: this host's device of the hosts' mesh); None: any.
  """
  num_hosts: int
  host_index: int
  live: list[int]
  bytes_sent: int
  device: jax.Device | None

  def connect(self, quiet: bool = True) -> None:
    """Opens the connections between hosts (not counted in `bytes_sent`)."""

  def sum(self, tree: PyTree) -> PyTree:
    """Σ over the hosts of each leaf; every host gets the same bytes."""

  def mean(self, tree: PyTree) -> PyTree:
    """`sum` divided by the number of hosts that took part."""

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[hosts that took part, *x.shape], in host order."""

  def reduce_encoded(self, x_R: np.ndarray, fmt: str, reduce=None,
                     **options) -> tuple[np.ndarray, np.ndarray]:
    """`reduce` over every host's rows, sent encoded (module `reduce_encoded`). Returns
    the result and this host's rows as carried."""

  def atomic(self, what: str, op: Callable[[Any], T]) -> T:
    """`op(c)`, where `c` has this interface, as one unit: every host sees all of its
    collectives over the same hosts (live membership redoes the whole of `op` among the
    hosts left if one is lost in it, so that a sum and the words summed beside it count
    the same hosts)."""

  def broadcast(self, parts: list[bytes] | None, source: int) -> list[bytes]:
    """Host `source`'s `parts` (None on every other host), on every host (a heal)."""


def _pack(tree: PyTree) -> tuple[dict[np.dtype, np.ndarray], Any]:
  """One flat host buffer per dtype, plus what `_unpack` needs to rebuild the tree."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [np.asarray(x) for x in leaves]
  by_dtype: dict[np.dtype, list[np.ndarray]] = {}
  for a in arrays:
    by_dtype.setdefault(a.dtype, []).append(a.ravel())
  flat = {dt: np.concatenate(parts) for dt, parts in by_dtype.items()}
  return flat, (treedef, [(a.dtype, a.shape) for a in arrays])


def _unpack(flat: dict[np.dtype, np.ndarray], layout) -> PyTree:
  treedef, specs = layout
  offsets = {dt: 0 for dt in flat}
  leaves = []
  for dt, shape in specs:
    size = int(np.prod(shape))
    leaves.append(flat[dt][offsets[dt]:offsets[dt] + size].reshape(shape))
    offsets[dt] += size
  return jax.tree.unflatten(treedef, leaves)


def reduce_encoded(x_R: np.ndarray, fmt: str, reduce, *, num_hosts: int, all_to_all,
                   allgather, **options) -> tuple[np.ndarray, int, np.ndarray]:
  """`reduce` over the rows of every host's [R, N] float32 array, which cross the network
  encoded (algo/compress.py); returns the [N] result, the same bytes on every host, the bytes
  this host sent, and its rows as the other hosts decoded them ([R, N]: what error
  feedback subtracts).

  Each host cuts its rows into one chunk per host and sends chunk i, encoded, to host i
  (all-to-all); host i decodes what it received, reduces those n·R rows chunk-wise in
  float32 (`reduce`: [n·R, chunk] -> [chunk], rows in host-major order), encodes the
  result, and every host gathers all reduced chunks (all-gather). With R = 1 and a sum,
  this is a ring all-reduce's traffic at the encoded size: (n−1)/n of the encoded vector
  plus (n−1) reduced chunks.
  """
  n = num_hosts
  x_R = np.asarray(x_R, np.float32)
  if fmt in compress.GATHERED:
    return _gather_encoded(x_R, fmt, reduce, num_hosts=n, allgather=allgather, **options)
  r, size = x_R.shape
  chunk = -(-size // n)
  chunk = -(-chunk // compress.BLOCK) * compress.BLOCK
  rows = np.pad(x_R, ((0, 0), (0, n * chunk - size))).reshape(r, n, chunk)
  encoded = [[compress.encode(rows[m, i], fmt, **options) for i in range(n)] for m in range(r)]
  parts = {k: np.stack([np.stack([e[i].parts[k] for e in encoded]) for i in range(n)])
           for k in encoded[0][0].parts}  # [n (destination), R, ...]
  received = {k: all_to_all(v) for k, v in parts.items()}  # [n (source), R, ...]
  decoded = np.stack([compress.decode(compress.Encoded(fmt, chunk, {k: v[h, m] for k, v in
                                                                    received.items()}))
                      for h in range(n) for m in range(r)])
  mine = compress.encode(np.asarray(reduce(decoded), np.float32), fmt, **options)
  gathered = {k: allgather(v) for k, v in mine.parts.items()}  # [n, ...]
  out = np.concatenate([compress.decode(compress.Encoded(fmt, chunk, {k: v[i] for k, v in
                                                                      gathered.items()}))
                        for i in range(n)])
  sent = sum(int(v.nbytes) for v in parts.values()) * (n - 1) // n + (n - 1) * mine.nbytes
  carried = np.stack([np.concatenate([compress.decode(e) for e in row]) for row in encoded])
  return out[:size], sent, carried[:, :size]


def _gather_encoded(x_R: np.ndarray, fmt: str, reduce, *, num_hosts: int, allgather,
                    **options) -> tuple[np.ndarray, int, np.ndarray]:
  """`reduce_encoded` for sparse formats (compress.GATHERED): every host all-gathers every
  host's encoded rows whole, decodes all n·R of them and reduces. A sum of sparse rows is
  not sparse, so nothing is re-encoded on the way; a ring all-gather sends (n − 1) x this
  host's message."""
  size = x_R.shape[1]
  encoded = [compress.encode(row, fmt, **options) for row in x_R]
  parts = {k: np.stack([e.parts[k] for e in encoded]) for k in encoded[0].parts}  # [R, ...]
  gathered = {k: allgather(v) for k, v in parts.items()}  # [n, R, ...]
  decoded = np.stack([compress.decode(compress.Encoded(fmt, size, {k: v[h, m] for k, v in
                                                                   gathered.items()}),
                                      **options)
                      for h in range(num_hosts) for m in range(len(encoded))])
  sent = (num_hosts - 1) * sum(e.nbytes for e in encoded)
  carried = np.stack([compress.decode(e, **options) for e in encoded])
  return np.asarray(reduce(decoded), np.float32), sent, carried


def sum_rows(rows: np.ndarray) -> np.ndarray:
  total = np.zeros(rows.shape[1], np.float32)
  for row in rows:  # in host order: the same rounding wherever it runs
    total += row
  return total


def payload_bytes(tree: PyTree) -> int:
  return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


class LocalCollective:
  """One host: the sum over hosts is the host's own tree; nothing crosses a network."""

  num_hosts = 1
  host_index = 0
  live = [0]
  bytes_sent = 0  # Over the whole run.
  device = None

  def atomic(self, what: str, op: Callable[[Any], T]) -> T:
    del what
    return op(self)

  @staticmethod
  def broadcast(parts: list[bytes] | None, source: int) -> list[bytes]:
    del source
    return parts

  def sum(self, tree: PyTree) -> PyTree:
    return tree

  def mean(self, tree: PyTree) -> PyTree:
    return self.sum(tree)

  def allgather(self, x: np.ndarray) -> np.ndarray:
    return np.asarray(x)[None]

  def connect(self, quiet: bool = True) -> None:
    pass

  def reduce_encoded(self, x_R: np.ndarray, fmt: str, reduce=sum_rows,
                     **options) -> tuple[np.ndarray, np.ndarray]:
    """The same protocol with one host (each row's round trip through `fmt`, reduced,
    and the result's round trip). Returns the result and the rows as carried."""
    out, _, carried = reduce_encoded(x_R, fmt, reduce, num_hosts=1, all_to_all=lambda v: v,
                                     allgather=self.allgather, **options)
    return out, carried


def host_mesh() -> Mesh:
  """A mesh of one CPU device per host (axis "hosts"): where cross-host sums run and
  where checkpointed host state lives."""
  num_hosts = jax.process_count()
  first_cpu: dict[int, jax.Device] = {}
  for d in sorted(jax.devices("cpu"), key=lambda d: d.id):
    first_cpu.setdefault(d.process_index, d)
  if sorted(first_cpu) != list(range(num_hosts)):
    raise RuntimeError(f"diloco_jax needs a CPU device on every host; found CPU devices "
                       f"on hosts {sorted(first_cpu)} of {num_hosts}")
  return Mesh(np.array([first_cpu[h] for h in range(num_hosts)]), (HOSTS_AXIS,))


class HostCollective:
  """Sums and gathers across hosts with XLA collectives on a mesh of one CPU device per host.

  `bytes_sent` counts what this host puts on the wire, computed for ring algorithms (gloo's
  own counters are not exposed): an all-reduce of N bytes over n hosts sends 2(n−1)/n·N
  from each host, an all-gather of N bytes per host (n−1)·N.
  """

  def __init__(self):
    self.num_hosts = jax.process_count()
    self.host_index = jax.process_index()
    self.live = list(range(self.num_hosts))
    mesh = host_mesh()
    self.device = mesh.devices[self.host_index]
    self.bytes_sent = 0
    self._use(mesh)

  def _use(self, mesh: Mesh) -> None:
    """Collectives over `mesh`'s hosts (all of them, or the live ones: `live.LiveCollective`)."""
    self.mesh = mesh
    self._rows = NamedSharding(mesh, P(HOSTS_AXIS))  # [hosts, N]: one row per host
    replicated = NamedSharding(mesh, P())  # the result: a full copy on every host
    self._sum = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=replicated)
    self._gather = jax.jit(lambda x: x, out_shardings=replicated)
    self._all_to_all = jax.jit(jax.shard_map(
        lambda x: jax.lax.all_to_all(x, HOSTS_AXIS, split_axis=1, concat_axis=0),
        mesh=mesh, in_specs=P(HOSTS_AXIS), out_specs=P(HOSTS_AXIS)))

  def atomic(self, what: str, op: Callable[[Any], T]) -> T:
    del what  # the hosts are fixed: every op is over all of them
    return op(self)

  def broadcast(self, parts: list[bytes] | None, source: int) -> list[bytes]:
    """XLA's collectives have no point to point: each part's bytes cross in int32 sums of
    BROADCAST_BYTES in which every other host adds zeros (x + 0 is x, bit for bit)."""
    count = self.allgather(np.array([len(parts) if parts else 0], np.int32))[source, 0]
    out = []
    for i in range(int(count)):
      payload = parts[i] if self.host_index == source else b""
      length = len(payload)
      high, low = self.allgather(np.array([length >> 31, length & (2**31 - 1)],
                                          np.int32))[source]
      n = (int(high) << 31) | int(low)
      got = bytearray()
      for start in range(0, n, BROADCAST_BYTES):
        size = min(BROADCAST_BYTES, n - start)
        words = np.zeros((size + 3) // 4, np.int32)
        if self.host_index == source:
          words.view(np.uint8)[:size] = np.frombuffer(payload, np.uint8, size, start)
        got += np.asarray(self.sum({"bytes": words})["bytes"]).view(np.uint8)[:size].tobytes()
      out.append(bytes(got))
    return out

  def connect(self, quiet: bool = True) -> None:
    """Opens the connections between hosts with a one-byte all-gather (not counted in
    `bytes_sent`). gloo prints `[Gloo] Rank i is connected to ...` to stdout from C++ as
    it connects; `quiet` sends that line, and whatever else writes to fd 1 meanwhile, to
    /dev/null."""
    with _native_stdout_silenced() if quiet else contextlib.nullcontext():
      self._gather_rows(np.zeros(1, np.uint8))

  def _global(self, row: np.ndarray) -> jax.Array:
    local = jax.device_put(np.asarray(row)[None], self.device)
    return jax.make_array_from_single_device_arrays((self.mesh.size, *np.shape(row)),
                                                    self._rows, [local])

  def sum(self, tree: PyTree) -> PyTree:
    """Σ over hosts of each leaf; every host gets the same bytes."""
    flat, layout = _pack(tree)
    n, out = self.mesh.size, {}
    for dt, buf in flat.items():
      total = self._sum(self._global(buf))
      out[dt] = np.asarray(total.addressable_data(0))
      self.bytes_sent += 2 * (n - 1) * buf.nbytes // n
    return _unpack(out, layout)

  def mean(self, tree: PyTree) -> PyTree:
    """Σ over hosts divided by the number of hosts (the trainer divides by K itself)."""
    return jax.tree.map(lambda s: s / np.asarray(self.mesh.size, s.dtype), self.sum(tree))

  def all_to_all(self, x: np.ndarray) -> np.ndarray:
    """x: [hosts, ...], row i for host i. Returns [hosts, ...]: row j from host j."""
    x = np.asarray(x)
    return np.asarray(self._all_to_all(self._global(x)).addressable_data(0)).reshape(x.shape)

  def reduce_encoded(self, x_R: np.ndarray, fmt: str, reduce=sum_rows,
                     **options) -> tuple[np.ndarray, np.ndarray]:
    """`reduce` over every host's rows [R, N], sent encoded (module `reduce_encoded`); by
    default their sum. Returns the result and this host's rows as carried."""
    out, sent, carried = reduce_encoded(x_R, fmt, reduce, num_hosts=self.mesh.size,
                               all_to_all=self.all_to_all, allgather=self._gather_rows,
                               **options)
    self.bytes_sent += sent
    return out, carried

  def _gather_rows(self, x: np.ndarray) -> np.ndarray:
    return np.asarray(self._gather(self._global(x)).addressable_data(0))

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[hosts, *x.shape]: every host's `x`, in host order."""
    self.bytes_sent += (self.mesh.size - 1) * np.asarray(x).nbytes
    return self._gather_rows(x)


@contextlib.contextmanager
def _native_stdout_silenced():
  """File descriptor 1 on /dev/null meanwhile (Python's own buffer flushed first)."""
  sys.stdout.flush()
  saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, 1)
    yield
  finally:
    os.dup2(saved, 1)
    os.close(saved)
    os.close(devnull)


def make_collective() -> LocalCollective | HostCollective:
  return HostCollective() if jax.process_count() > 1 else LocalCollective()
