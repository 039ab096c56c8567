"""Cross-host reductions of pytrees that live in host memory.

`HostCollective` runs over `jax.distributed`: a global mesh with one CPU device per host
(the accelerators keep computing while gloo moves the bytes over TCP). A pytree is packed
into one flat buffer per dtype, so a round costs one collective however many leaves the
model has. `LocalCollective` is the single-host version: no network, same interface.

Call these only from the dispatch thread (DESIGN.md, rule 1).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

HOSTS_AXIS = "hosts"
PyTree = Any


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


def payload_bytes(tree: PyTree) -> int:
  return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


class LocalCollective:
  """One host: the sum over hosts is the host's own tree; nothing crosses a network."""

  num_hosts = 1
  host_index = 0
  bytes_sent = 0  # Over the whole run.

  def sum(self, tree: PyTree) -> PyTree:
    return tree

  def mean(self, tree: PyTree) -> PyTree:
    return self.sum(tree)

  def allgather(self, x: np.ndarray) -> np.ndarray:
    return np.asarray(x)[None]


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
    self.mesh = host_mesh()
    self.device = self.mesh.devices[self.host_index]
    self._rows = NamedSharding(self.mesh, P(HOSTS_AXIS))  # [hosts, N]: one row per host
    replicated = NamedSharding(self.mesh, P())  # the result: a full copy on every host
    self._sum = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=replicated)
    self._gather = jax.jit(lambda x: x, out_shardings=replicated)
    self.bytes_sent = 0

  def _global(self, row: np.ndarray) -> jax.Array:
    local = jax.device_put(row[None], self.device)
    return jax.make_array_from_single_device_arrays((self.num_hosts, *row.shape), self._rows,
                                                    [local])

  def sum(self, tree: PyTree) -> PyTree:
    """Σ over hosts of each leaf; every host gets the same bytes."""
    flat, layout = _pack(tree)
    out = {}
    for dt, buf in flat.items():
      total = self._sum(self._global(buf))
      out[dt] = np.asarray(total.addressable_data(0))
      self.bytes_sent += 2 * (self.num_hosts - 1) * buf.nbytes // self.num_hosts
    return _unpack(out, layout)

  def mean(self, tree: PyTree) -> PyTree:
    """Σ over hosts divided by the number of hosts (the trainer divides by K itself)."""
    return jax.tree.map(lambda s: s / np.asarray(self.num_hosts, s.dtype), self.sum(tree))

  def allgather(self, x: np.ndarray) -> np.ndarray:
    """[hosts, *x.shape]: every host's `x`, in host order."""
    x = np.asarray(x)
    out = np.asarray(self._gather(self._global(x)).addressable_data(0))
    self.bytes_sent += (self.num_hosts - 1) * x.nbytes
    return out


def make_collective() -> LocalCollective | HostCollective:
  return HostCollective() if jax.process_count() > 1 else LocalCollective()
