"""Test set-up: one CPU device per process, unless a test starts its own processes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
