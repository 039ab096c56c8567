"""Predicting a run before it runs (`python -m diloco_jax.plan`): model.py's formula,
calibration.py's constants."""
