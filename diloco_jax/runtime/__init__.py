"""The process among its peers: jax.distributed's start-up (ddp), the coordination service,
the link watchdog, preemption, security, host memory and the workdir lock."""
