"""What a person sees in the terminal: the pipeline's own log lines and warnings, other libraries' kept quiet."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def is_verbose() -> bool:
    """VERBOSE=1 (any value but empty or 0): every library's messages, and a mistake's traceback beside its line."""
    return os.environ.get("VERBOSE", "") not in ("", "0")


def setup_logging(verbose: bool | None = None) -> None:
    """What a person sees: the pipeline's own lines, its warnings about the run, progress bars and results.

    Quiet by default: other libraries' info lines (Lightning's tips and device banners) and warnings (deprecations
    inside dependencies) are hidden. VERBOSE=1 (`make cv VERBOSE=1`) brings everything back.
    """
    verbose = is_verbose() if verbose is None else verbose
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    if verbose:
        logging.getLogger("pipeline").setLevel(logging.INFO)
        return
    for variable, value in (("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false"), ("MLFLOW_LOGGING_LEVEL", "WARNING"),
                            ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
        os.environ.setdefault(variable, value)  # read by MLflow when it is imported and when it prints
    # Lightning resets its package logger's level when it is imported, so the loggers it writes through are set too.
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning", "mlflow", "alembic",
                 "pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "lightning_fabric.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Python warnings come from dependencies; what concerns the user's run (training from scratch, skipped videos)
    # the pipeline also logs as a warning, and those log lines stay.
    warnings.filterwarnings("ignore")
    # ... except torch's word on the GPU (a driver too old for its CUDA build, no device): never hidden.
    warnings.filterwarnings("default", category=UserWarning, module=r"torch\.cuda")
    warnings.filterwarnings("default", message=r"(?s).*(CUDA initiali[sz]ation|NVIDIA driver)")
