"""What the hardware runs fast, decided at run time: numeric precision and memory layout.

A default that is fast on one machine must not be 50x slower on another. bf16 autocast is about 1.5x faster than
float32 on a CPU with AMX, and emulated (a 512 x 512 matmul about 70x slower than float32) on one without native
bf16 matrix units, such as an AVX2-only AMD EPYC or most laptops. So `precision: auto` picks bf16 on a CPU only
where the CPU runs it natively, and says which CPU it saw.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

# oneDNN runs bf16 matmuls on AMX tiles; these variables cap the instruction sets it and ATen may use (and are how
# the non-AMX path is forced on an AMX machine, e.g. to measure what an AVX2-only CPU does).
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_name() -> str:
    """The CPU's model name (for timings: a figure means little without the CPU it came from)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_description() -> str:
    """`<model name>, torch CPU capability <AVX2|AVX512|...>, bf16 native|emulated`."""
    native = "native" if cpu_runs_bf16_natively() else "emulated"
    return f"{cpu_name()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 {native}"


def cpu_runs_bf16_natively() -> bool:
    """True where bf16 matrix products run on AMX tiles: the CPU has them and nothing caps the kernels below them.

    `torch.backends.cpu.get_cpu_capability()` follows ATEN_CPU_CAPABILITY; oneDNN follows ONEDNN_MAX_CPU_ISA. A CPU
    with AVX512-BF16 but no AMX gets float32: its bf16 gain is small and not worth a precision change.
    """
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    for variable in _ISA_CAPS:
        cap = os.environ.get(variable, "").strip().upper()
        if cap and "AMX" not in cap and cap != "ALL":
            return False
    return bool(torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class FamilyTraits:
    """What a device decides by a backbone's family (the adapter's, `pipeline.models.backbone_adapter`): whether bf16
    autocast pays on a CPU that runs bf16 natively (a plain ViT's matrix products gain; the hybrids' convolutions and
    reshapes lose more to conversions), and whether channels-last memory helps it on a GPU (convolutions)."""

    bf16_on_cpu: bool
    channels_last_on_gpu: bool


# What `trainer.precision=auto` may become on some device; an explicit setting allows only itself.
AUTO_PRECISIONS = ("bf16-mixed", "32-true")


def precision_for(setting: str, device_kind: str, traits: FamilyTraits, gpu_bf16: bool | None = None,
                  cpu_bf16: bool | None = None) -> str:
    """Lightning precision for `setting` on a device of `device_kind` (cuda | mps | cpu, as
    `pipeline.utils.accelerator.training_device` reports it). `auto`: bf16-mixed on a CUDA GPU that has bf16
    (`gpu_bf16`, read from this machine's GPU when None), 32-true on one without; on a CPU, bf16-mixed only for a
    family whose `traits` say bf16 pays there (a plain ViT, as its backbone adapter reports) on a CPU that runs bf16
    natively (`cpu_bf16`, read from this CPU when None), else 32-true. The facts are the training device's, so the
    fold job decides this on the node it trains on (a GPU node of a CPU-only login node gets bf16).

    Measured on a 2-core Xeon with AMX (one training step, batch 16-32): bf16 autocast made ViT-B/16 at 64 px 3x
    faster (0.84 s against 2.5 s) but CvT-13 2.3x slower (1.54 s against 0.66 s) and MobileViT-S no faster
    (2.15 s against 2.29 s): the convolutions and reshapes of the hybrids lose more to bf16 conversions than their
    matrix products gain. On a GPU, bf16 autocast runs every backbone's matrix products on tensor cores.
    """
    if setting != "auto":
        return setting
    if device_kind == "cuda":
        if gpu_bf16 is None:
            gpu_bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return "bf16-mixed" if gpu_bf16 else "32-true"
    if device_kind == "cpu":
        native = cpu_runs_bf16_natively() if cpu_bf16 is None else cpu_bf16
        return "bf16-mixed" if traits.bf16_on_cpu and native else "32-true"
    return "32-true"  # Apple's MPS and other accelerators: float32, which every one of them runs


def allowed_precisions(setting: str) -> tuple[str, ...]:
    """What a fold may train in for a planned `trainer.precision`: itself, or for `auto` one of AUTO_PRECISIONS."""
    return AUTO_PRECISIONS if setting == "auto" else (setting,)


def use_channels_last(setting: bool | str, traits: FamilyTraits, device_kind: str) -> bool:
    """channels_last helps convolutions on GPUs; a plain ViT gains nothing from it (`traits`)."""
    if setting != "auto":
        return bool(setting)
    return device_kind == "cuda" and traits.channels_last_on_gpu


@dataclass(frozen=True)
class DeviceSettings:
    """The settings that depend on the device a fold trains on, resolved there (never on the planning machine)."""

    device: str  # cuda | mps | cpu | ...
    precision: str  # what Lightning trains in
    precision_asked: str  # trainer.precision as planned (auto, or an explicit value honoured as it is)
    channels_last: bool

    @property
    def line(self) -> str:
        asked = "" if self.precision_asked == self.precision else f" (trainer.precision={self.precision_asked})"
        return (f"settings on this {self.device}: precision {self.precision}{asked}, "
                f"channels_last {'on' if self.channels_last else 'off'}")


def device_settings(precision: str, channels_last: bool | str, traits: FamilyTraits, device_kind: str,
                    gpu_bf16: bool | None = None, cpu_bf16: bool | None = None) -> DeviceSettings:
    """Resolve `trainer.precision` and `trainer.channels_last` for a backbone of a family with `traits` on a
    `device_kind` device; an explicit value is honoured everywhere. Raises ValueError if the result is not one the
    plan allows."""
    resolved = precision_for(precision, device_kind, traits, gpu_bf16, cpu_bf16)
    if resolved not in allowed_precisions(precision):
        raise ValueError(f"trainer.precision={precision} resolved to {resolved} on this {device_kind}, which the "
                         f"plan does not allow ({', '.join(allowed_precisions(precision))})")
    return DeviceSettings(device_kind, resolved, str(precision), use_channels_last(channels_last, traits, device_kind))
