"""The run store's rules: every MLflow tag name and status, the run kinds and a run's lifecycle (`tracking`), opening
the store, CV identity and every run query (`cv_runs`), the model registry (`registry`), the tracking server
(`tracking_server`) and a run's private one (`private_server`, `make ui`), a fold's lease (`fold_lease`) and the
environment record (`environment`). Nothing here imports the rest of `pipeline.runs`: what trains and what plans
build on the store, never the other way (pyproject.toml's contract "the store is below what trains and plans")."""
