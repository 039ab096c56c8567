"""A corpus to prepare: its sources, tokenizers and on-disk format, and the body of
`python -m diloco_jax.prepare`."""

from diloco_jax import _moved

__getattr__ = _moved.package_getattr("corpus")
