"""What a run reports: the round log, progress line, run.json and the final report
(`metrics`), the metrics file, TensorBoard and W&B (`writers`), and profiles (`profiling`)."""
