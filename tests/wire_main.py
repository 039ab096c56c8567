"""One host of a wire test: the exchange of pseudo-gradients alone, on known inputs.

  python tests/wire_main.py OUT_DIR HOST_ID NUM_HOSTS PORT CONFIG_JSON

CONFIG_JSON: {"outer": {overrides of the default config's outer}, "replicas_per_host": R,
"size": N, "rounds": T}. Each round, replica m of this host sends Δ = `wire_deltas(host, m,
round, N)`; the script runs `exchange.Exchange` (submit, wait, the residual carried) over
the epoch wire of a live job (host 0 serves its coordinator at PORT) and writes
OUT_DIR/wire{HOST_ID}.npz: the mean and the residual after every round, and the bytes this
host sent. NUM_HOSTS = 1 runs in one process with no coordinator.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wire_deltas(host: int, replica: int, round_: int, size: int):
  import numpy as np
  rng = np.random.default_rng([host, replica, round_])
  # Magnitudes that differ by entry, as a model's do; no two entries tie.
  return (rng.standard_normal(size) * np.exp(rng.uniform(-2, 2, size))).astype(np.float32)


def main(out_dir, host_id, num_hosts, port, spec):
  import numpy as np

  from diloco_jax import config as config_lib
  from diloco_jax.membership import start as start_lib
  from diloco_jax.runtime import cluster
  from diloco_jax.wire import collective
  from diloco_jax.wire import dispatch
  from diloco_jax.wire import exchange
  spec = json.loads(spec)
  config = config_lib.get_default_config()
  config.outer.update(spec["outer"])
  outer = config.outer
  # The hosts of a DiLoCo job: live membership, host 0 serving its coordinator.
  world = start_lib.start(config, cluster.Cluster(
      coordinator_address=f"127.0.0.1:{port}", num_hosts=int(num_hosts), host_id=int(host_id),
      initialization_timeout=60, heartbeat_timeout=30))
  r, n = spec["replicas_per_host"], spec["size"]
  means, residuals, sent = [], [], []
  with dispatch.Dispatcher() as d:
    coll = world.collective or collective.LocalCollective()
    ex = exchange.Exchange(outer, collective=coll, dispatcher=d, replicas_per_host=r)
    residual = ex.init_residuals({0: n}).get(0)
    for t in range(1, spec["rounds"] + 1):
      deltas = {"w": np.stack([wire_deltas(coll.host_index, m, t, n) for m in range(r)])}
      pending = ex.submit(deltas, np.float32(0), np.ones(r, bool), round_=t, residual=residual)
      arrived = ex.wait(pending, diagnostics=False)
      residual = arrived.residual
      means.append(np.asarray(arrived.mean["w"]))
      residuals.append(residual)
      sent.append(arrived.bytes_sent)
  np.savez(os.path.join(out_dir, f"wire{host_id}.npz"), means=np.stack(means),
           residuals=np.stack(residuals), sent=np.array(sent))
  start_lib.finish(world)


if __name__ == "__main__":
  main(*sys.argv[1:])
