"""One driver per mode (sync, delayed, eager, streaming, ddp) behind one protocol, and the
NaN-skip policy."""
