"""Precision chosen at run time from what the CPU really runs natively; checked on both branches in real processes.

The non-AMX branch is reached on any machine by capping the kernels the way an AVX2-only CPU is capped
(ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), so both branches run here whatever the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.models.backbone_adapter import family_traits
from pipeline.runs.store import tracking
from pipeline.utils.devices import cpu_description, cpu_runs_bf16_natively, precision_for
from tests.conftest import planned

# the traits each family's adapter registers (pipeline.models.backbone_families)
VIT, CVT, TIMM = family_traits("vit"), family_traits("cvt"), family_traits("timm")

PROBE = """
import json, torch
from pipeline.models.backbone_adapter import family_traits
from pipeline.models.backbones import model_family
from pipeline.utils.devices import cpu_runs_bf16_natively, precision_for
torch.set_num_threads(1)
print(json.dumps({"native": cpu_runs_bf16_natively(),
                  "vit": precision_for("auto", "cpu", family_traits(model_family("vit_b16"))),
                  "cvt": precision_for("auto", "cpu", family_traits(model_family("cvt_13"))),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def probe(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                            env={**os.environ, **env})
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_cpu_without_native_bf16_gets_float32_even_for_a_vit() -> None:
    capped = probe(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert capped["capability"] == "AVX2"
    assert not capped["native"] and capped["vit"] == "32-true" and capped["cvt"] == "32-true"
    # capping oneDNN alone (the library that runs bf16 matmuls on AMX) is enough
    assert probe(ONEDNN_MAX_CPU_ISA="AVX512_CORE")["vit"] == "32-true"


def test_a_cpu_with_amx_gets_bf16_for_a_vit_only() -> None:
    free = probe()
    amx = torch.cpu._is_amx_tile_supported() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert free["native"] == amx
    assert free["vit"] == ("bf16-mixed" if amx else "32-true")
    assert free["cvt"] == "32-true"  # the hybrids ran slower in bf16 even with AMX


def test_explicit_precision_wins_and_the_cpu_is_described() -> None:
    assert precision_for("bf16-mixed", "cpu", CVT) == "bf16-mixed"
    assert precision_for("32-true", "auto", VIT) == "32-true"
    description = cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in description
    assert ("bf16 native" in description) == cpu_runs_bf16_natively()


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core_vnni"])
def test_isa_caps_below_amx_turn_bf16_off(cap: str, monkeypatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert not cpu_runs_bf16_natively()
    assert precision_for("auto", "cpu", VIT) == "32-true"


def test_auto_precision_is_left_to_the_fold_job_and_resolved_from_its_device(tiny_config) -> None:
    from pipeline.runs.jobs.fold_decisions import settings_on_device
    from pipeline.runs.jobs.fold_run import FoldJob
    from pipeline.utils.devices import device_settings

    cfg = tiny_config("model=mobilevit_xxs", "model.img_size=32", "trainer.precision=auto")
    decisions = planned(cfg)
    assert decisions.precision == "auto"  # the planning machine decides nothing that depends on the device
    job = FoldJob({}, 0, "parent", "sqlite:///x.db", "/tmp/fold", decisions)
    assert FoldJob.read(job.write(Path(cfg.cv.work_dir) / "job.json")).decisions.precision == "auto"
    # a GPU node with bf16 resolves it to bf16 for every backbone family; one without, and a CPU, to float32
    gpu = settings_on_device(decisions, cfg.trainer.channels_last, "cuda")
    assert gpu.device == "cuda" and gpu.precision == ("bf16-mixed" if torch.cuda.is_available()
                                                      and torch.cuda.is_bf16_supported() else "32-true")
    for family in (TIMM, CVT, VIT):
        assert device_settings("auto", "auto", family, "cuda", gpu_bf16=True).precision == "bf16-mixed"
        assert device_settings("auto", "auto", family, "cuda", gpu_bf16=False).precision == "32-true"
        assert device_settings("auto", "auto", family, "cpu", cpu_bf16=False).precision == "32-true"
    assert device_settings("auto", "auto", VIT, "cpu", cpu_bf16=True).precision == "bf16-mixed"
    assert device_settings("auto", "auto", CVT, "cpu", cpu_bf16=True).precision == "32-true"
    # channels_last: on a GPU for convolutional families, never on a CPU by default
    assert device_settings("auto", "auto", TIMM, "cuda", gpu_bf16=True).channels_last
    assert not device_settings("auto", "auto", TIMM, "cpu").channels_last
    # an explicit precision is honoured on any device, and recorded as asked
    explicit = device_settings("32-true", "auto", CVT, "cuda", gpu_bf16=True)
    assert (explicit.precision, explicit.precision_asked) == ("32-true", "32-true")
    assert tracking.device_settings_tags(explicit) == {"precision": "32-true", "precision_asked": "32-true",
                                                        "channels_last": "true"}
