"""The round loop and what it writes: checkpoints, the round log, metrics writers, profiles,
the trained model read back from a workdir, and sampling from it."""
