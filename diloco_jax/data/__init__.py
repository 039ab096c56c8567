"""Input pipelines for training: synthetic text with a known floor, files, and prepared
corpora."""

from diloco_jax import _moved

__getattr__ = _moved.package_getattr("data")
