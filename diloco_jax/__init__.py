"""diloco_jax: DiLoCo and Async DiLoCo training in JAX across badly connected hosts."""

__version__ = "0.1.0"

from diloco_jax import hostmem  # noqa: E402  (imports nothing heavy)

# `python -m diloco_jax.train` may start its process again for huge pages: here, before
# jax is imported, that costs next to nothing (train.py's main asks again for other ways in).
hostmem.restart_with_huge_pages(only_module="diloco_jax.train")

from diloco_jax.simulate import SimulateResult, simulate  # noqa: E402

__all__ = ["simulate", "SimulateResult", "__version__"]
