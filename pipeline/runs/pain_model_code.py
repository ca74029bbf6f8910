"""The code file of the MLflow pain model ("models from code"): MLflow stores this file with the model and runs it
when the model is loaded; everything it needs comes from the installed `pipeline` package."""

import mlflow

from pipeline.runs.pain_model import PainFrameModel

mlflow.models.set_model(PainFrameModel())
