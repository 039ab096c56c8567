"""The host's devices: the local mesh, the inner step jitted over it, and whether a run
fits in their memory."""
