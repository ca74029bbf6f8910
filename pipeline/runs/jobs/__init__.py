"""What one process trains: `fold_job` (one fold anywhere, and `train`, the one training path a fold, the final model
and a tuning trial call), `head_modes` (how a head mode trains and what it keeps), `two_stage` (a two-stage head's
second stage), `pretrain` (`make pretrain`), `embed` (`make embed`). Nothing here imports `orchestration`: a job does
not plan or launch (pyproject.toml's contract "a job does not plan or launch")."""
