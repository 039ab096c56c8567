"""The round loop and what it writes: checkpoints, the round log, metrics writers, profiles,
and the trained model read back from a workdir."""
