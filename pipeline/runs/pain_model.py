"""Old name and path of the MLflow pain model (`pipeline.runs.serving.mlflow_model.PainMlflowModel`), kept only for
MLflow models logged before the rename: the code file `pain_model_code.py` such a model carries imports
`PainFrameModel` from here (`pipeline.runs.serving.model_trust.FORMER_CODE_FILES`). OpenCV's own pixel cap is set
here first, as the current code file sets it, before OpenCV loads. The project never imports this module."""

from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels

cap_opencv_pixels(ServingLimits.from_env().max_frame_pixels)

from pipeline.runs.serving.mlflow_model import PainMlflowModel as PainFrameModel  # noqa: E402  (after the cap)

__all__ = ["PainFrameModel"]
