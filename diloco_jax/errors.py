"""Exceptions that several layers raise, defined below all of them."""


class ConfigError(ValueError):
  """A config value is invalid; the message names each bad field (e.g. config.outer.lr)."""
