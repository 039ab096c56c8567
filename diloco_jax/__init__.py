"""diloco_jax: DiLoCo and Async DiLoCo training in JAX across badly connected hosts."""

__version__ = "0.1.0"

from diloco_jax.simulate import SimulateResult, simulate  # noqa: E402

__all__ = ["simulate", "SimulateResult", "__version__"]
