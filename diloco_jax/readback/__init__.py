"""A finished run read back in one process: its config, params and evals (`trained`), and
text drawn from it (`sampling`); used by `python -m diloco_jax.sample` and `export`."""
