"""Planning a cross-validation or a study and launching its jobs: `cross_validation` (plan, launch, aggregate),
`tuning` (`make tune`: Optuna studies per fold, trials as fold jobs, then the tuned CV), `launchers` (where jobs run:
local, parallel, SLURM)."""
