"""Runs of training, tracked in MLflow, by concern: the store's rules (`store/`: tags, queries, registry, server,
leases), what one process trains (`jobs/`: a fold job's training path and its head modes, the second stage,
pretraining, `make embed`), planning a CV or a study and launching its jobs (`orchestration/`: the
cross-validation's plan, launch and aggregate, the search's studies, the launchers: local, parallel, SLURM), and the
MLflow model that fold jobs and final models log and that predict and serve load (`serving/`). The three modules
here (`mlflow_model`, `serving_input`, `pain_model`) are old paths that MLflow models logged before the split import;
they only import from `serving/` what those models' code files name, and the project never imports them."""
