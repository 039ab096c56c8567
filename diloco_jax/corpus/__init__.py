"""A corpus to prepare: its sources, tokenizers and on-disk format, and the body of
`python -m diloco_jax.prepare`."""
