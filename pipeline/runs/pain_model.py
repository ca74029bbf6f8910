"""Old home of the MLflow pain model, kept so that models logged before the rename still load: their stored code
file imports `PainFrameModel` from here. New models are logged with `pipeline/runs/mlflow_model_code.py`."""

from pipeline.runs.mlflow_model import PainMlflowModel as PainFrameModel

__all__ = ["PainFrameModel"]
