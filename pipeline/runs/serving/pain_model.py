"""Old name of the MLflow pain model, kept so that models logged before the rename still load: their stored code
file imports `PainFrameModel` from `pipeline.runs.pain_model`, which re-exports it from here
(`pipeline.runs.serving.model_trust.FORMER_CODE_FILES` knows that file). New models are logged with
`pipeline/runs/serving/mlflow_model_code.py`. OpenCV's own pixel cap is set here as there, before OpenCV loads."""

from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels

cap_opencv_pixels(ServingLimits.from_env().max_frame_pixels)

from pipeline.runs.serving.mlflow_model import PainMlflowModel as PainFrameModel  # noqa: E402  (after the cap)

__all__ = ["PainFrameModel"]
