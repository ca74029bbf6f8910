"""What the hardware runs fast, decided at run time: numeric precision and memory layout.

A default that is fast on one machine must not be 50x slower on another. bf16 autocast is about 1.5x faster than
float32 on a CPU with AMX, and emulated (a 512 x 512 matmul about 70x slower than float32) on one without native
bf16 matrix units, such as an AVX2-only AMD EPYC or most laptops. So `precision: auto` picks bf16 on a CPU only
where the CPU runs it natively, and says which CPU it saw.
"""

from __future__ import annotations

import os
import platform

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


def precision_for(setting: str, accelerator: str = "auto", family: str = "") -> str:
    """Lightning precision for `setting`. `auto`: bf16-mixed on a GPU that has bf16; on a CPU, bf16-mixed only for
    a plain ViT (`family` "vit", as the backbone adapter reports it) on a CPU that runs bf16 natively, else 32-true.

    Measured on a 2-core Xeon with AMX (one training step, batch 16-32): bf16 autocast made ViT-B/16 at 64 px 3x
    faster (0.84 s against 2.5 s) but CvT-13 2.3x slower (1.54 s against 0.66 s) and MobileViT-S no faster
    (2.15 s against 2.29 s): the convolutions and reshapes of the hybrids lose more to bf16 conversions than their
    matrix products gain.
    """
    if setting != "auto":
        return setting
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if family == "vit" and cpu_runs_bf16_natively() else "32-true"


def use_channels_last(setting: bool | str, family: str) -> bool:
    """channels_last helps convolutions on GPUs; a plain ViT gains nothing from it."""
    if setting != "auto":
        return bool(setting)
    return torch.cuda.is_available() and family != "vit"
