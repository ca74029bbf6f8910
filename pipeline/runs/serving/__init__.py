"""The MLflow pain model: what fold jobs and final models log and what `make predict`, `make export` and `make serve`
load. `mlflow_model` (`PainMlflowModel`, `build_scorer` / `load_scorer`, logging), `mlflow_model_code` (the code
file MLflow stores with each model), `model_trust` (a model folder is the project's before anything of it runs),
`serving_input` (what one request may ask, frames read from their header first). It lives in `runs/`, not
`deployment/`, because fold jobs log it and `runs` may not import `deployment` (the layers contract). Nothing here
imports at package level: the code file sets OpenCV's pixel cap before OpenCV loads."""
