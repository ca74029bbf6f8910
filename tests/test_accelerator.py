"""The device a run trains on is said out loud, and a GPU that was asked for but cannot be used is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.runs.store import tracking
from pipeline.utils.accelerator import GpuUnavailable, install_advice, training_device, why_no_gpu
from pipeline.utils.devices import cpu_name
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import tiny_overrides


def test_the_device_line_names_the_device_and_why_no_gpu() -> None:
    device = training_device("auto")
    assert tracking.training_device_tags(device)["device"] == device.kind and device.line.startswith("device: ")
    if torch.cuda.is_available():
        assert device.kind == "cuda" and torch.cuda.get_device_name(0) in device.line
        assert f"CUDA runtime {torch.version.cuda}" in device.line
    else:
        assert device.kind == "cpu" and cpu_name() in device.line
        reason = why_no_gpu()
        assert f"no GPU visible: {reason}" in device.line and device.gpu == f"none: {reason}"
        # torch's reason, and which torch build it is
        assert torch.__version__ in reason
        if torch.version.cuda is None:
            assert "CPU-only build" in reason
        else:
            assert f"CUDA {torch.version.cuda}" in reason and len(reason) > len(f"({torch.__version__})") + 20


def test_accelerator_cpu_trains_on_the_cpu_and_says_so() -> None:
    device = training_device("cpu")
    assert device.kind == "cpu" and cpu_name() in device.line and "trainer.accelerator=cpu" in device.line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is usable here")
def test_a_gpu_asked_for_without_one_raises_with_the_reason() -> None:
    for accelerator in ("gpu", "cuda"):
        with pytest.raises(GpuUnavailable) as error:
            training_device(accelerator)
        assert f"trainer.accelerator={accelerator}" in str(error.value)
        assert why_no_gpu(full=True) in str(error.value)


def test_install_advice_follows_the_driver() -> None:
    old = install_advice((12, 2), "13.0")
    assert "update the driver" in old and "https://download.pytorch.org/whl/cu121" in old
    assert "CUDA_VISIBLE_DEVICES" in install_advice((13, 2), "13.0")  # new enough: the GPU is hidden or absent
    assert "update the NVIDIA driver" in install_advice((10, 2), "13.0")
    unknown = install_advice(None, "13.0")
    assert "nvidia-smi" in unknown and "download.pytorch.org/whl/" in unknown
    assert "https://download.pytorch.org/whl/cu126" in install_advice((12, 6), None)  # a CPU-only torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is usable here")
def test_make_cv_with_accelerator_gpu_and_no_gpu_stops_before_training(tiny_base: Path, tmp_path: Path) -> None:
    """`make cv ARGS=trainer.accelerator=gpu` on a machine without a usable GPU: the reason, no traceback."""
    overrides = tiny_overrides(tiny_base, "model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false",
                               f"cv.work_dir={tmp_path / 'runs'}", "trainer.accelerator=gpu")
    result = subprocess.run([sys.executable, "-m", "pipeline", "cv", *overrides], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "asks for a GPU, but torch cannot use one" in result.stderr
    assert why_no_gpu().split(" (torch")[0] in result.stderr  # torch's own reason
    assert "download.pytorch.org/whl/" in result.stderr  # and how to get a torch the driver runs
    assert "cross-validation:" not in result.stdout and not (tmp_path / "runs").exists()  # nothing was trained


def test_torch_cuda_warnings_are_not_silenced() -> None:
    code = ("import warnings\nfrom pipeline.cli import setup_logging\nsetup_logging(False)\n"
            "warnings.warn('CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).')\n"
            "warnings.warn('some dependency chatter')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "driver on your system is too old" in result.stderr and "chatter" not in result.stderr
