"""One host of a multi-host test: trains, then saves what the test compares.

  python tests/host_main.py OUT_DIR HOST_ID NUM_HOSTS PORT CONFIG_JSON

CONFIG_JSON holds overrides of `tests.multihost.small_config()`. Writes
OUT_DIR/host{HOST_ID}.npz with the final anchor's leaves and the per-round records.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir, host_id, num_hosts, port, overrides):
  from diloco_jax import distributed
  distributed.initialize(distributed.Cluster(
      coordinator_address=f"127.0.0.1:{port}", num_hosts=int(num_hosts), host_id=int(host_id),
      initialization_timeout=60, heartbeat_timeout=30))
  import jax
  import numpy as np
  from diloco_jax import trainer
  from tests import multihost
  config = multihost.small_config(**json.loads(overrides))
  result = trainer.train_and_evaluate(config, os.path.join(out_dir, f"work{host_id}"))
  leaves = {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(result.params))}
  np.savez(os.path.join(out_dir, f"host{host_id}.npz"), **leaves,
           records=json.dumps(result.records))


if __name__ == "__main__":
  main(*sys.argv[1:])
