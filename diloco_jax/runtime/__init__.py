"""The process among its peers: cluster start-up, the coordination service, the link
watchdog, preemption, elasticity, security, host memory and the workdir lock."""
