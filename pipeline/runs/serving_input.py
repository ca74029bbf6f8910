"""Old path of `pipeline.runs.serving.serving_input`, kept only for MLflow models logged before `runs/` was split:
the code file such a model carries imports `ServingLimits` and `cap_opencv_pixels` from here to set OpenCV's own
pixel cap before OpenCV loads (`pipeline.runs.serving.model_trust.FORMER_CODE_FILES`). The project imports the new
path; nothing new goes here."""

from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels

__all__ = ["ServingLimits", "cap_opencv_pixels"]
