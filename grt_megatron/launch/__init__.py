"""Launching runs on clusters: `grt-submit` (SLURM)."""
