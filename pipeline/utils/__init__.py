"""The bottom floor: paths, config loading and logging set-up, atomic file writes, CPU shares, processes, devices,
keyed seeds.

Nothing here imports another part of the pipeline."""
