"""Runs of training, tracked in MLflow: the store's rules (`store/`: tags, queries, registry, server, leases), what
one process trains (`fold_job`'s training path and its head modes, the second stage, pretraining, `make embed`),
where jobs run (local, parallel, SLURM) and the drivers (the cross-validation's plan, launch and aggregate; the
search's studies)."""
