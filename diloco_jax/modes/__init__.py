"""One driver per mode (sync, delayed, eager, streaming, ddp) behind one protocol
(`base.Driver`), found by name in `registry`, and the NaN-skip policy."""
