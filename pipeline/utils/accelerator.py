"""Which device a run trains on, said out loud, and a GPU request that cannot be met refused before any training.

pip resolves torch to its newest CUDA build, which needs a recent NVIDIA driver. With an older driver (or none, or
a CPU-only torch) `torch.cuda.is_available()` is False and Lightning's `accelerator=auto` quietly trains on the CPU,
for days. So every command that trains prints one line naming the device, and with it, on a CPU, the reason torch
gives for not using a GPU; `trainer.accelerator=gpu` (or `cuda`) without a usable GPU is a `GpuUnavailable` error
that says why and which torch build to install.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.utils.devices import cpu_description

GPU_ACCELERATORS = ("gpu", "cuda")
# CUDA versions pytorch.org has published wheel indexes for (https://download.pytorch.org/whl/cuXYZ); which of them
# carry a given torch release is listed on pytorch.org/get-started.
PYTORCH_CUDA_INDEXES = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))


class GpuUnavailable(RuntimeError):
    """trainer.accelerator asks for a GPU that torch cannot use; the message says why and what to install."""


@dataclass(frozen=True)
class TrainingDevice:
    """Where Lightning trains for a `trainer.accelerator` setting: `line` for the terminal, the facts for the run
    (`pipeline.runs.store.tracking.training_device_tags`)."""

    kind: str  # cuda | mps | cpu | another Lightning accelerator name
    name: str
    line: str
    gpu: str | None = None  # its name; on a CPU run: the GPU left unused, or why there is none
    cpu: str | None = None  # the CPU (cpus.cpu_description) of a CPU run
    gpu_driver: str | None = None  # the NVIDIA driver (or "unknown") of a CUDA or CPU run
    cuda_runtime: str | None = None  # the CUDA runtime torch was built for (or "none")


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (e.g. 550.54.15), read without CUDA: it is there even when torch
    cannot use the GPU, which is when it matters."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        match = re.search(r"\s(\d{2,}\.\d+(?:\.\d+)?)\s", first)
        if match:
            return match.group(1)
    except (OSError, IndexError):
        pass
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=True)
        return result.stdout.splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed driver supports (cuDriverGetVersion), or None without a driver."""
    library = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(library)
        version = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, (version.value % 1000) // 10


def torch_build() -> str:
    """`torch 2.14.1+cu130 built for CUDA 13.0`, or `... CPU-only build`."""
    cuda = torch.version.cuda
    return f"torch {torch.__version__} " + (f"built for CUDA {cuda}" if cuda else "CPU-only build")


def why_no_gpu(full: bool = False) -> str:
    """torch's own reason for not using a GPU: a CPU-only build, the driver's complaint (too old, none), or no
    visible device; its first sentence unless `full`. Only called where `torch.cuda.is_available()` is False, so
    it never starts CUDA on a working GPU."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = torch.cuda.device_count()
    messages = [str(w.message).removeprefix("CUDA initialization: ") for w in caught]
    if not messages:
        try:  # initialising CUDA raises with the driver's reason; device_count() warns it only once per process
            torch.cuda.init()
        except Exception as error:  # noqa: BLE001 - torch raises RuntimeError or AssertionError, any text will do
            messages.append(str(error))
    reason = (messages[0] if messages else f"torch sees {count} CUDA device(s)").strip()
    if not full:
        reason = reason.split(". ")[0].rstrip(".")
    return f"{reason} ({torch_build()})"


def _version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def install_advice(driver_cuda: tuple[int, int] | None, torch_cuda: str | None = None) -> str:
    """What to do: for a driver older than torch's CUDA build, the pytorch.org index of the newest CUDA build the
    driver runs; otherwise where to look for the GPU."""
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    command = (".venv/bin/pip uninstall -y torch torchvision && .venv/bin/pip install -c requirements/constraints.txt "
               "torch torchvision --index-url https://download.pytorch.org/whl/{index}")
    built_for = _version(torch_cuda)
    if driver_cuda is not None and built_for is not None and driver_cuda >= built_for:
        return (f"The driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}, enough for this torch: check that "
                "`nvidia-smi` lists a GPU and that CUDA_VISIBLE_DEVICES does not hide it. Or train on the CPU: "
                "trainer.accelerator=auto or cpu.")
    if driver_cuda is None:
        return ("If this machine has an NVIDIA GPU, check that `nvidia-smi` lists it and that CUDA_VISIBLE_DEVICES "
                "does not hide it. A driver that supports CUDA X.Y (`nvidia-smi` shows it) runs a torch built for "
                f"CUDA X.Y or older: {command.format(index='cuXY')}, e.g. cu126 for CUDA 12.6 (pytorch.org/get-started "
                "lists the CUDA builds of each torch version). Or train on the CPU: trainer.accelerator=auto or cpu.")
    usable = [v for v in PYTORCH_CUDA_INDEXES if v <= driver_cuda]
    driver = f"The NVIDIA driver supports CUDA up to {driver_cuda[0]}.{driver_cuda[1]}"
    if not usable:
        return f"{driver}, older than any CUDA build of torch: update the NVIDIA driver."
    index = "cu{}{}".format(*usable[-1])
    return (f"{driver}, this torch needs {torch_cuda}: update the driver, or install a torch built for CUDA "
            f"{usable[-1][0]}.{usable[-1][1]}: {command.format(index=index)} (pytorch.org/get-started lists the "
            "CUDA builds of each torch version).")


def _driver_and_runtime() -> dict[str, str]:
    return {"gpu_driver": driver_version() or "unknown", "cuda_runtime": torch.version.cuda or "none"}


def training_device(accelerator: str = "auto") -> TrainingDevice:
    """The device Lightning picks for `accelerator` (auto: a CUDA GPU, else Apple's MPS, else the CPU).

    Raises GpuUnavailable for `gpu`/`cuda` when torch cannot use a GPU, with the reason and an install command.
    """
    accelerator = str(accelerator).lower()
    cuda = torch.cuda.is_available()
    if accelerator in GPU_ACCELERATORS and not cuda:
        raise GpuUnavailable(f"trainer.accelerator={accelerator} asks for a GPU, but torch cannot use one: "
                             f"{why_no_gpu(full=True)}.\n{install_advice(driver_cuda_version())}")
    if accelerator in (*GPU_ACCELERATORS, "auto") and cuda:
        properties = torch.cuda.get_device_properties(0)
        versions = _driver_and_runtime()
        line = (f"device: GPU {properties.name} ({properties.total_memory / 2**30:.0f} GiB; "
                f"{torch.cuda.device_count()} visible; driver {versions['gpu_driver']}, CUDA runtime "
                f"{versions['cuda_runtime']} of torch {torch.__version__})")
        return TrainingDevice("cuda", properties.name, line, gpu=properties.name, **versions)
    mps = torch.backends.mps.is_available()
    if accelerator == "mps" or (accelerator == "auto" and mps):
        return TrainingDevice("mps", "Apple GPU (MPS)", "device: Apple GPU (MPS)", gpu="mps")
    if accelerator not in ("auto", "cpu"):  # tpu, hpu, ...: Lightning checks those itself
        return TrainingDevice(accelerator, accelerator, f"device: {accelerator} (trainer.accelerator)")
    cpu = cpu_description()
    if cuda:  # accelerator=cpu on a GPU machine: said, so nobody wonders why it is slow
        gpu = f"{torch.cuda.get_device_name(0)} (not used: trainer.accelerator=cpu)"
        return TrainingDevice("cpu", cpu, f"device: CPU {cpu}; GPU {gpu}", gpu=gpu, cpu=cpu, **_driver_and_runtime())
    reason = why_no_gpu()
    note = " (trainer.accelerator=cpu)" if accelerator == "cpu" else ""
    return TrainingDevice("cpu", cpu, f"device: CPU {cpu}; no GPU visible: {reason}{note}", gpu=f"none: {reason}",
                          cpu=cpu, **_driver_and_runtime())


def announce_device(accelerator: str = "auto") -> TrainingDevice:
    """Print the device line, as every command that trains does first (`make cv`, `make bench`, ...); raises
    GpuUnavailable before anything is trained when a GPU is asked for and cannot be used."""
    device = training_device(accelerator)
    print(device.line, flush=True)
    return device


def announce_device_or_exit(accelerator: str = "auto") -> TrainingDevice:
    """`announce_device` for scripts (scripts/bench_*.py): an unusable GPU ends the script with the message, not a
    traceback."""
    try:
        return announce_device(accelerator)
    except GpuUnavailable as error:
        raise SystemExit(f"error: {error}") from None
