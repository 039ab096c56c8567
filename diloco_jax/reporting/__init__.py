"""What a run reports: each round's record and line (`roundlog`), the bar of inner steps
(`progress`), run.json (`runjson`), the start-up lines and the final report (`lines`), the
metrics file, TensorBoard and W&B (`writers`), the loss plot (`plots`), and profiles
(`profiling`)."""
