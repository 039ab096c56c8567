"""The modes' one protocol (`modes.base.Driver`), their registry and the pseudo-gradient hook."""

import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax import config as config_lib
from diloco_jax.algo import diloco
from diloco_jax.device import inner
from diloco_jax.errors import ConfigError
from diloco_jax.modes import base
from diloco_jax.modes import ddp
from diloco_jax.modes import host
from diloco_jax.modes import names
from diloco_jax.modes import outer
from diloco_jax.modes import registry
from diloco_jax.modes import skips

# Every member the round loop, the rejoin and the model reader may use on a driver.
MEMBERS = sorted({name for name in vars(base.Driver) if not name.startswith("_")}
                 | set(base.Driver.__annotations__))


def test_every_mode_has_a_driver_and_the_config_accepts_every_mode():
  """The mode list is `names.DRIVER_PATHS`: the registry loads each driver, in its order,
  and the config accepts those modes and no other."""
  assert tuple(registry.DRIVERS) == names.MODES
  assert all(isinstance(d, type) for d in registry.DRIVERS.values())
  config = config_lib.get_default_config()
  for mode in names.MODES:
    config.mode = mode
    config_lib.validate(config)
  config.mode = "nope"
  with pytest.raises(ConfigError, match=re.escape(f"must be one of {names.MODES}")):
    config_lib.validate(config)
  with pytest.raises(KeyError, match="mode 'nope': one of"):
    registry.driver("nope")


@pytest.mark.parametrize("mode", names.MODES)
def test_every_driver_has_every_member_of_the_protocol(mode):
  driver = registry.driver(mode)
  assert {"init", "end_round", "join", "trained_params", "param_sets"} <= set(MEMBERS)
  missing = [name for name in MEMBERS if not hasattr(driver, name)]
  assert not missing, f"{driver.__name__} lacks {missing}"


def test_no_mode_is_named_outside_modes():
  """The mode list is `modes.names`: only modes/ and the config's schema (the default and
  its doc) name a mode; the rest asks a driver for its traits."""
  package = pathlib.Path(registry.__file__).parent.parent
  quoted = re.compile("[\"'](" + "|".join(registry.DRIVERS) + ")[\"']")
  named = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py"))
           if path.parent.name != "modes" and path != package / "config" / "schema.py"
           for n, line in enumerate(path.read_text().splitlines(), 1) if quoted.search(line)]
  assert named == []


def test_memory_profiles():
  config = config_lib.get_default_config()
  config.replicas_per_host, config.mesh.replicas = 4, 2
  assert registry.driver("sync").memory_profile(config) == (2, 1, 11)
  assert registry.driver("ddp").memory_profile(config) == (1, 5, 0)


def test_pseudo_gradient_hook_sees_every_send():
  """The hook gets Δ of every local replica with its round and fragment; what it returns
  is what the driver checks and sends."""
  calls = []

  def hook(deltas_R, *, round_, fragment):
    calls.append((round_, fragment))
    return jax.tree.map(lambda d: d.at[1].set(jnp.nan), deltas_R)

  exchange = types.SimpleNamespace(replicas_per_host=2, num_replicas=2,
                                   host_device=jax.devices("cpu")[0])
  side = host.HostSide(diloco.Sync(optax.sgd(1.0), 2), mesh=inner.local_mesh(),
                       exchange=exchange, max_skipped_rounds=3, pseudo_gradient_hook=hook)
  anchor = {"w": jnp.ones(3)}
  deltas_R = side.pseudo_gradients(anchor, {"w": jnp.zeros((2, 3))}, round_=7, fragment=1)
  assert calls == [(7, 1)]
  np.testing.assert_array_equal(deltas_R["w"][0], np.ones(3))
  assert np.isnan(deltas_R["w"][1]).all()


def test_ddp_refuses_a_pseudo_gradient_hook():
  with pytest.raises(ValueError, match="mode 'ddp' has no pseudo-gradients"):
    ddp.DDPRound.from_config(config_lib.get_default_config(), mesh=None, exchange=None,
                             params=None, pseudo_gradient_hook=lambda d, **_: d)


def test_outer_step_gives_the_rule_the_arrived_k():
  """The K a mean was divided by (`Arrived.replicas`; fewer after a host left) is what
  the outer step is given, as an int32 array; None (the static K, a constant of the
  program) when it is the static K, no mean arrived or the wire did not count."""
  exchange = types.SimpleNamespace(replicas_per_host=2, num_replicas=4,
                                   host_device=jax.devices("cpu")[0])
  step = outer.EagerStep(diloco.Eager(optax.sgd(1.0), 4), mesh=inner.local_mesh(),
                         exchange=exchange, max_skipped_rounds=3)
  synced = lambda k: (skips.Synced(types.SimpleNamespace(replicas=k), True, 0, ""),)
  for given in ((), synced(4), synced(0)):
    assert step._replicas(given) is None
  got = step._replicas(synced(3))
  assert (got, got.dtype) == (3, np.int32)
