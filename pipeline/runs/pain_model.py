"""Old path of `pipeline.runs.serving.pain_model`, kept only for MLflow models logged before `runs/` was split: the
code file `pain_model_code.py` such a model carries imports `PainFrameModel` from here
(`pipeline.runs.serving.model_trust.FORMER_CODE_FILES`). Importing it sets OpenCV's own pixel cap first, as the
module it re-exports does. The project imports the new path; nothing new goes here."""

from pipeline.runs.serving.pain_model import PainFrameModel

__all__ = ["PainFrameModel"]
