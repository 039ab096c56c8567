"""One host of a multi-host test: trains, then saves what the test compares.

  python tests/host_main.py OUT_DIR HOST_ID NUM_HOSTS PORT CONFIG_JSON

CONFIG_JSON holds overrides of `tests.multihost.small_config()`, and optionally
"_poison": {"host": h, "replica": m, "value": "nan" or a scale, "calls": [...]}: that
replica's pseudo-gradient NaN or scaled (`multihost.poisoned`), and "_corrupt":
{"host": h, "round": r}: that host's anchor changed in one entry after round r's outer
step (sync mode), as a flipped bit in its memory would (`multihost.corrupted`); and
"_pace": {"seconds": [per host], "jitter": j}: the seconds per inner step balance 'speed'
measures on each host (`multihost.paced`); and "_slow": {"host": h, "from_round": r,
"seconds": s}: that host sleeps s seconds after each round from round r on (a window for a
test's signal to land in mid-run). Writes
OUT_DIR/host{HOST_ID}.npz with the final anchor's leaves and the per-round records; the
hosts share the workdir OUT_DIR/work.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir, host_id, num_hosts, port, overrides):
  import jax
  import numpy as np

  from diloco_jax.loop import trainer
  from diloco_jax.membership import start as start_lib
  from diloco_jax.runtime import cluster
  from tests import multihost
  overrides = json.loads(overrides)
  bad = overrides.pop("_poison", None)
  hook = None
  if bad is not None and bad["host"] == int(host_id):
    hook = multihost.poisoned(bad["replica"], bad["value"], bad.get("calls"))
  corrupt = overrides.pop("_corrupt", None)
  if corrupt is not None and corrupt["host"] == int(host_id):
    from diloco_jax.modes import outer
    outer.OuterStep.end_round = multihost.corrupted(outer.OuterStep.end_round, corrupt["round"])
  pace = overrides.pop("_pace", None)
  if pace is not None:  # balance 'speed' with hosts of these speeds (multihost.paced)
    from diloco_jax.loop import pacing
    pacing.Pacer.measured = multihost.paced(pace["seconds"], pace.get("jitter", 0.0))
  slow = overrides.pop("_slow", None)
  if slow is not None and slow["host"] == int(host_id):
    import time

    from diloco_jax.loop import rounds
    run_round = rounds.run_round

    def slowed(parts, state, r):
      state = run_round(parts, state, r)
      if r >= slow["from_round"]:
        time.sleep(slow["seconds"])
      return state
    rounds.run_round = slowed
  config = multihost.small_config(**overrides)
  # The start of train.py's command: host 0 serves the membership coordinator (ddp:
  # jax.distributed's coordination service) at the port.
  world = start_lib.start(config, cluster.Cluster(
      coordinator_address=f"127.0.0.1:{port}", num_hosts=int(num_hosts), host_id=int(host_id),
      initialization_timeout=60, heartbeat_timeout=30,
      # host 0's coordinator goes with host 0: the tests that kill it resume every host
      coordinator_grace=5))
  # One workdir for all hosts, as on a shared filesystem (under live membership each
  # host keeps its own in it, work/host<i>).
  result = trainer.train_and_evaluate(config, os.path.join(out_dir, "work"), world=world,
                                      pseudo_gradient_hook=hook)
  leaves = {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(result.params))}
  np.savez(os.path.join(out_dir, f"host{host_id}.npz"), **leaves,
           records=json.dumps(result.records))
  start_lib.finish(world)


if __name__ == "__main__":
  main(*sys.argv[1:])
