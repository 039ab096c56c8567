"""The math of every mode, pure and host-free: DiLoCo rules, fragments, state, optimizers,
the wire's encodings and robust aggregation, and `simulate`."""
