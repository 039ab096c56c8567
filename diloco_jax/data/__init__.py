"""Input pipelines for training: synthetic text with a known floor, files, and prepared
corpora."""
