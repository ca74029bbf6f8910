"""Precision chosen at run time from what the CPU really runs natively; checked on both branches in real processes.

The non-AMX branch is reached on any machine by capping the kernels the way an AVX2-only CPU is capped
(ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), so both branches run here whatever the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.utils.devices import cpu_description, cpu_runs_bf16_natively, precision_for

PROBE = """
import json, torch
from pipeline.utils.devices import cpu_runs_bf16_natively, precision_for
torch.set_num_threads(1)
print(json.dumps({"native": cpu_runs_bf16_natively(), "vit": precision_for("auto", "cpu", "vit"),
                  "cvt": precision_for("auto", "cpu", "cvt"),
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
    assert precision_for("bf16-mixed", "cpu", "cvt") == "bf16-mixed"
    assert precision_for("32-true", "auto", "vit") == "32-true"
    description = cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in description
    assert ("bf16 native" in description) == cpu_runs_bf16_natively()


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core_vnni"])
def test_isa_caps_below_amx_turn_bf16_off(cap: str, monkeypatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert not cpu_runs_bf16_natively()
    assert precision_for("auto", "cpu", "vit") == "32-true"
