"""The coordination service of `jax.distributed` (key-value store, barriers, live hosts),
reached through the one private JAX handle on it. Every protocol of this package that
talks through the store (join token, config agreement, integrity) starts here.
"""

def jax_distributed_state():
  """`jax.distributed`'s state in this process: the coordination service's client
  (key-value store, barriers, live hosts), on host 0 the service itself, the coordinator
  address, this process's id and the number of processes. Private: JAX has no public
  handle on its client or service; a public key-value/barrier API in `jax.distributed`
  would replace this."""
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state


def coordination_client():
  """The coordination service's client of this process (`jax_distributed_state`)."""
  return jax_distributed_state().client


