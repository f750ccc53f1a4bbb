"""Training: run configuration, DeepSpeed engine, the loop, metrics, and the `grt-train` command."""
