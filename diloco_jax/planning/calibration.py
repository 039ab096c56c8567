"""The planner's constants, fitted to runs measured in network namespaces on this project's
2-core CPU machine: `sudo python bench/plan.py` reruns them and writes
bench/results/plan_fit.json, whose "constants" these must equal (a test checks). How well
they predict runs left out of the fit: docs/plan.md."""

from diloco_jax.planning.model import Constants

CONSTANTS = Constants(round_overhead_s=0.0, overhead_s=0.1, link_efficiency=0.9, codec_s_per_entry=1e-8,
                      async_slowdown=0.1, outer_s_per_param=7e-9)
