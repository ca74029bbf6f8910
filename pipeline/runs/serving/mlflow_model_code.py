"""The code file of the MLflow pain model ("models from code"): MLflow stores this file with the model and runs it
when the model is loaded; everything it needs comes from the installed `pipeline` package. It is also where a scoring
process that MLflow starts (`mlflow models serve`) first touches the project, before OpenCV loads: OpenCV's own pixel
cap is set to the frame cap there (`pipeline.runs.serving.serving_input`). `pipeline.runs.serving.model_trust` refuses a
model whose copy of this file differs from the installed one."""

import mlflow

from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels

cap_opencv_pixels(ServingLimits.from_env().max_frame_pixels)

from pipeline.runs.serving.mlflow_model import PainMlflowModel  # noqa: E402  (after the cap: it loads OpenCV)

mlflow.models.set_model(PainMlflowModel())
