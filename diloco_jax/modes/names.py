"""The modes by name, and where each one's driver is: the one list of modes.

Apart from the drivers, and free of jax, so the config accepts or refuses `config.mode`
without importing them (jax, which `--help` and `--print_config` do not need);
`registry` imports each driver from here. Adding a mode: its driver in one module of this
folder, and one line here.
"""

# mode -> its driver, "module:Class" of this folder; the modes' order everywhere
DRIVER_PATHS: dict[str, str] = {
    "sync": "outer:SyncStep",
    "delayed": "outer:DelayedStep",
    "eager": "outer:EagerStep",
    "streaming": "streaming:StreamingOuterStep",
    "ddp": "ddp:DDPRound",
}
MODES = tuple(DRIVER_PATHS)  # the values config.mode accepts
PLAIN = "sync"  # plain DiLoCo: the reference every other mode departs from
