"""What one process trains: `training_settings` (what one training reads of its config, once), `what_trains`
(what it trains: strategy, head and its mode), `head_modes` (the head modes' registry: how a mode trains and what it
keeps), `fold_job` (`build_fold` and `train`, the one training path a fold, the final model and a tuning trial call,
and `train_fold`, a fold's), `fold_decisions` (what the plan decides for every fold, what the device decides),
`fold_fit` (the Lightning fit and its epoch checkpoints), `two_stage` (a two-stage head's second stage), `step_times`,
`fold_run` (a `FoldJob` under a child run of its own, anywhere), `sealing` (a fold run's files checked in the store
before FINISHED), `pretrain` (`make pretrain`), `embed` (`make embed`). Nothing here imports `orchestration`: a job
does not plan or launch (pyproject.toml's contract "a job does not plan or launch")."""
