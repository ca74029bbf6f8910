"""What one process trains: `fold_job` (`train`, the one training path a fold, the final model and a tuning trial call,
and `train_fold`, a fold's), `fold_decisions` (what the plan decides for every fold, what the device decides),
`fold_fit` (the fit and its epoch checkpoints), `step_times`, `fold_run` (a fold job under
a child run of its own, anywhere), `sealing` (a fold run's files checked in the store before FINISHED), `head_modes`
(how a head mode trains and what it keeps), `two_stage` (a two-stage head's second stage), `pretrain` (`make
pretrain`), `embed` (`make embed`). Nothing here imports `orchestration`: a job does not plan or launch
(pyproject.toml's contract "a job does not plan or launch")."""
