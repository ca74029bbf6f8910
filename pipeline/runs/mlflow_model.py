"""Old path of `pipeline.runs.serving.mlflow_model`, kept only for MLflow models logged before `runs/` was split: the
code file such a model carries imports `PainMlflowModel` from here (`pipeline.runs.serving.model_trust.
FORMER_CODE_FILES`). The project imports the new path; nothing new goes here."""

from pipeline.runs.serving.mlflow_model import PainMlflowModel

__all__ = ["PainMlflowModel"]
