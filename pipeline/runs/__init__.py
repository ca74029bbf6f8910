"""Runs of training, tracked in MLflow: the store's rules, one fold as a job, where jobs run (local, parallel, SLURM),
and the cross-validation driver (plan, launch, aggregate)."""
