"""What a run ran with, on record: the key libraries' versions as tags and `pip freeze` as an artifact.

A number in MLflow is only worth what can be traced back: the same code on another torch, timm or albumentations
can give another score, so every parent run carries the versions it was trained with.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from importlib import metadata

from mlflow import MlflowClient

# tag name -> distribution name
KEY_LIBRARIES = {
    "torch": "torch",
    "lightning": "pytorch-lightning",
    "timm": "timm",
    "transformers": "transformers",
    "mlflow": "mlflow",
    "albumentations": "albumentations",
    "numpy": "numpy",
    "opencv": "opencv-python-headless",
}
FREEZE_ARTIFACT = "environment/pip_freeze.txt"


def library_versions() -> dict[str, str]:
    """`version.<library>` tags: Python and the libraries whose version changes what a run computes."""
    versions = {"version.python": platform.python_version()}
    for tag, distribution in KEY_LIBRARIES.items():
        try:
            versions[f"version.{tag}"] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            versions[f"version.{tag}"] = "not installed"
    import torch

    versions["version.torch"] = torch.__version__  # with its build: 2.14.1+cu130, 2.14.1+cpu
    return versions


@functools.lru_cache(maxsize=1)
def pip_freeze() -> str:
    """`pip freeze` of this interpreter's environment; where pip is missing (a uv-made venv), the installed
    distributions as `name==version`, which says the same minus the editable installs' locations. Asked once per
    process (half a second): `make table`'s CVs share one answer."""
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True,
                                timeout=120, check=True)
        if result.stdout.strip():
            return result.stdout
    except (OSError, subprocess.SubprocessError):
        pass
    lines = {f"{dist.metadata['Name']}=={dist.version}" for dist in metadata.distributions()}
    return "\n".join(sorted(lines, key=str.lower)) + "\n"


def log_environment(client: MlflowClient, run_id: str) -> None:
    """`pip freeze` of this environment as the run's environment/pip_freeze.txt."""
    client.log_text(run_id, pip_freeze(), FREEZE_ARTIFACT)
