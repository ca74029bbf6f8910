"""`make gpu-check` (scripts/gpu_check.py): on this machine, without CUDA, one line and exit 0 through make; and every
step of it at test sizes on the CPU (`--device cpu --tiny`, the session's tiny twin), which proves the plumbing the GPU
run relies on (each step a bounded process, its figures read back) and the JSON's fields. No GPU figure comes from
here: those are measured where a GPU is."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.utils.paths import PROJECT_ROOT

MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed"]
STEPS = ["device", "data", "bench", "fold", "detection", "predict"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: make gpu-check would measure it")
def test_make_gpu_check_without_cuda_says_so_in_one_line_and_exits_0() -> None:
    before = set((PROJECT_ROOT / "reports" / "gpu_check").glob("*"))
    result = subprocess.run([*MAKE, "gpu-check"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert lines[0].startswith("gpu-check: no CUDA GPU here (") and "nothing measured" in lines[0], lines
    assert not result.stderr.strip(), result.stderr
    assert set((PROJECT_ROOT / "reports" / "gpu_check").glob("*")) == before  # nothing written


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_every_step_runs_on_the_cpu_at_test_sizes_and_writes_its_figures(tiny_base: Path, tmp_path: Path) -> None:
    """The tiny check on the CPU against the session's tiny twin (its data step finds the crops made): every step
    ok within its budget, and the JSON holds what the GPU run will report, step by step."""
    out = tmp_path / "check"
    data = [f"data.root={tiny_base / 'raw'}", f"data.processed_dir={tiny_base / 'processed'}",
            f"data.manifest_dir={tiny_base / 'manifests'}", "data.synthetic.workers=1", "preprocess.workers=1",
            "loader.num_workers=0"]
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--budget-scale",
                             "4", "--out", str(out), *data], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=1900)
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(steps) == STEPS and all(step["status"] == "ok" for step in steps.values()), steps
    assert report["device"] == "cpu" and report["tiny"] and report["seconds"] <= report["budget_s"]
    for name, step in steps.items():
        assert 0 < step["seconds"] <= step["budget_s"] and (out / f"{name}.log").is_file(), (name, step)

    device = steps["device"]["figures"]
    assert device["line"].startswith("device: CPU") and device["device"] == "cpu"
    assert set(device["backbones"]) == {"vit_b16", "cvt_13", "mobilevit_s"}
    assert all(entry["precision"] in ("32-true", "bf16-mixed") for entry in device["backbones"].values())
    assert steps["data"]["figures"]["crops"] > 0 and "videos" in steps["data"]["figures"]["summary"]
    bench = steps["bench"]["figures"]["mobilevit_xxs"]
    assert all(positive(bench[key]) for key in ("lightning_images_per_s", "bare_images_per_s", "ratio")), bench
    assert bench["img_size"] == 32 and bench["precision"] == "32-true"
    fold = steps["fold"]["figures"]
    assert fold["run_id"] and fold["precision"] == "32-true" and fold["device"] == "cpu", fold
    assert "test/video_auroc" in fold and positive(fold["train_seconds"])
    detection = steps["detection"]["figures"]
    assert detection["frames"] > 0 and detection["frame_size"] == "160 x 120", detection
    assert all(positive(detection[f"{stage}_ms_per_frame"]) for stage in ("detect", "align", "network")), detection
    predict = steps["predict"]["figures"]
    assert predict["model"] == "the fold's" and predict["frames"] == detection["frames"], predict
    assert f"--run={fold['run_id']}" in steps["predict"]["command"]


def test_a_step_over_its_budget_is_stopped_and_the_next_ones_still_run(tmp_path: Path) -> None:
    """A budget too short for the device step (imports alone take seconds): it is killed and recorded as timed out
    with its last line, the check goes on to the next step and exits 1."""
    out = tmp_path / "check"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--steps",
                             "device,fold", "--budget-scale", "0.05", "--out", str(out)], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert steps["device"]["status"] == "timed out" and "stopped after" in steps["device"]["note"], steps
    assert steps["fold"] == {**steps["fold"], "status": "skipped", "note": "needs data"}, steps
