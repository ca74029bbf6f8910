"""The code file of the MLflow pain model ("models from code"): MLflow stores this file with the model and runs it
when the model is loaded; everything it needs comes from the installed `pipeline` package."""

import mlflow

from pipeline.runs.mlflow_model import PainMlflowModel

mlflow.models.set_model(PainMlflowModel())
