"""The benchmark scripts run end to end in their --quick mode and write a complete, sane JSON report.

They run as subprocesses, exactly as `make bench-data` / `make bench` start them, on a tiny generated subset in
tmp_path (never the project's data/ or reports/).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import PROJECT_ROOT

SCRIPTS = PROJECT_ROOT / "scripts"


def run_script(name: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(SCRIPTS / name),
        "--out",
        str(tmp_path / "out"),
        "--work-dir",
        str(tmp_path / "work"),
        "--no-progress",
        *extra,
    ]
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)


def assert_ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )


def assert_positive(section: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        value = section.get(key)
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, f"{where}.{key} = {value!r}"


def test_bench_data_quick(tmp_path: Path) -> None:
    result = run_script("bench_data.py", tmp_path, "--quick", "--loader-data", "subset")
    assert_ran(result)
    report = json.loads((tmp_path / "out" / "bench_data.json").read_text())
    assert (tmp_path / "out" / "bench_data.png").stat().st_size > 0
    assert report["environment"]["cpu_cores"] >= 1

    preprocess = report["preprocess"]["tiny"]
    assert_positive(
        preprocess,
        (
            "videos",
            "generate_s_per_video",
            "generate_core_s_per_video",
            "videos_per_s_per_core",
            "videos_per_s_all_cores",
            "parallel_efficiency",
            "crops",
        ),
        "preprocess.tiny",
    )
    assert preprocess["videos"] == 5 and preprocess["failed_videos"] == 0
    assert (preprocess["width"], preprocess["height"]) == (160, 120)

    detection = report["detection"]["tiny"]
    assert set(detection["per_class"]) == {"BL1", "PA1", "PA2", "PA3", "PA4"}
    assert 0 < detection["overall"] <= 1 and all(0 <= rate <= 1 for rate in detection["per_class"].values())
    assert detection["n_frames"] == 5 * 8 and 0 < detection["n_detected"] <= detection["n_frames"]

    loader = report["loader"]["32"]
    assert_positive(loader, ("images_per_s", "training_images_per_s", "ratio", "images", "workers"), "loader.32")
    assert loader["ratio"] == pytest.approx(loader["images_per_s"] / loader["training_images_per_s"])
    assert loader["images"] >= 4 * 8  # --loader-batches 4 of batch 8 in the quick run's one pass
    assert report["loader_dataset"]["kind"] == "subset:tiny"
    assert report["loader_dataset"]["train_frames"] >= 32

    assert "Preprocessing" in result.stdout and "loader img/s" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench_data.json", "bench_data.png"]


def test_bench_train_quick(tmp_path: Path) -> None:
    result = run_script("bench_train.py", tmp_path, "--quick", "--data", "subset")
    assert_ran(result)
    report = json.loads((tmp_path / "out" / "bench_train.json").read_text())
    assert (tmp_path / "out" / "bench_train.png").stat().st_size > 0
    assert list(report["models"]) == ["mobilevit_xxs"]
    entry = report["models"]["mobilevit_xxs"]
    assert_positive(
        entry,
        ("lightning_images_per_s", "bare_images_per_s", "ratio", "bare_seconds_per_step", "parameters_M"),
        "models.mobilevit_xxs",
    )
    assert entry["ratio"] == pytest.approx(entry["lightning_images_per_s"] / entry["bare_images_per_s"])
    settings = report["settings"]
    assert settings["img_size"] == 32 and settings["batch_size"] == 8 and settings["steps"] == 3
    assert settings["torch_threads"] >= 1 and settings["num_workers"] >= 0
    assert report["dataset"]["train_frames"] >= 8 * (1 + 3 + 1)  # one epoch covers warm-up and timed steps
    assert "mobilevit_xxs" in result.stdout and "bare PyTorch img/s" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench_train.json", "bench_train.png"]


def test_bench_train_rejects_unknown_model(tmp_path: Path) -> None:
    result = run_script("bench_train.py", tmp_path, "--quick", "--models", "no_such_net")
    assert result.returncode != 0
    assert "unknown backbone(s) no_such_net" in result.stderr
    assert not (tmp_path / "work").exists()  # failed before generating anything
