"""The planner's constants, fitted to runs measured in network namespaces on this project's
2-core CPU machine: `sudo python -m bench.plan --measure` reruns them and writes
bench/results/plan_fit.json, whose "constants" these must equal (a test checks). How well
they predict runs left out of the fit: docs/performance.md ("Predicting a run")."""

from diloco_jax.planning.model import Constants

CONSTANTS = Constants(round_overhead_s=0.303, overhead_s=0.0964,
                      link_efficiency=0.703, codec_s_per_entry=0.0,
                      async_overhead_s=0.423, outer_s_per_param=6.98e-09)
