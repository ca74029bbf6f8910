"""The benchmarks measure what `make cv` trains with, and the scripts run end to end in their --quick mode.

The scripts run as subprocesses, exactly as `make bench-data` / `make bench` start them, on a tiny generated subset in
tmp_path (never the project's data/ or reports/).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import albumentations as A
import pytest

from pipeline.analysis.throughput import build, load_configs, loader_dataset, training_settings
from pipeline.data.augment import build_train_transform
from pipeline.data.datamodule import SubjectRoles
from pipeline.models.lightning_module import OptimConfig
from pipeline.runs.jobs.fold_job import build_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.utils.accelerator import training_device
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT, resolve_path
from tests.conftest import planned, tiny_overrides, training_of

SCRIPTS = PROJECT_ROOT / "scripts"


@pytest.mark.parametrize(
    "extra",
    [
        # data_model/synthetic_vit_b16.yaml: its size, batch 16, one LR for every layer (which crops a video gives is
        # the dataset's setting, checked above against cfg.loader, never the backbone's)
        ("model=vit_b16",),
        # a model without its own file, as the Makefile picks it, and command-line overrides on top
        ("model=timm", "model.name=resnet10t", "augment=heavy", "loader.batch_size=4", "loader.crop_fraction=0.8"),
    ],
)
def test_bench_builds_what_make_cv_builds(tiny_base: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    overrides = tiny_overrides(tiny_base, "model.pretrained=false", *extra)
    cfg = load_config(overrides)
    assert load_configs(overrides, None, ["mobilevit_s"]) == [cfg]  # the overrides' model, not the default

    recipe = TrainingSettings.from_config(cfg)
    module, datamodule = build(recipe, loader_dataset(tiny_base / "processed", tmp_path, 1, recipe))
    measured = training_settings(recipe, module, datamodule)
    # make cv: pipeline.runs.jobs.fold_job.build_fold on the config itself, over the real fold file
    built = build_fold(*training_of(cfg), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                       planned(cfg))
    cv_module, cv_datamodule = built.module, built.datamodule
    assert measured == training_settings(recipe, cv_module, cv_datamodule)

    data_config = module.model.backbone.data_config
    assert measured["img_size"] == (cfg.model.img_size or data_config.input_size[-1])
    assert measured["optim"] == dataclasses.asdict(OptimConfig(**cfg.model.optim))
    assert measured["train_transform"] == A.to_dict(
        build_train_transform(data_config, cfg.augment, cfg.loader.crop_fraction)
    )
    assert (measured["batch_size"], measured["frames_per_video"], measured["from_s"]) == (
        cfg.loader.batch_size, cfg.loader.frames_per_video, cfg.loader.from_s
    )
    if cfg.model.name == "vit_b16":  # the specialisation applies (the model file alone says layer_decay 0.75)
        assert (measured["img_size"], measured["batch_size"], measured["optim"]["layer_decay"]) == (48, 16, 1.0)
    else:
        assert (measured["batch_size"], measured["optim"]["backbone_lr"]) == (4, 2e-4)


def test_bench_picks_backbones_as_the_makefile_does() -> None:
    assert load_configs(["data=synthetic"], ["resnet10t"], []) == [
        load_config(["data=synthetic", "model=timm", "model.name=resnet10t"])
    ]
    defaults = load_configs([], None, ["cvt_13", "mobilevit_s"])
    assert [cfg.model.name for cfg in defaults] == ["cvt_13", "mobilevit_s"]
    assert defaults[1] == load_config(["model=mobilevit_s"])
    assert load_configs([], None, ["vit_ref"]) == [load_config(["model=vit_ref"])]  # the course's ViT is benchable
    with pytest.raises(SystemExit, match="not both"):
        load_configs(["model=cvt_13"], ["mobilevit_s"], [])
    with pytest.raises(SystemExit, match="unknown backbone"):
        load_configs(["model=timm", "model.name=no_such_net"], None, [])


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
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)


def assert_ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )


def assert_positive(section: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        value = section.get(key)
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, f"{where}.{key} = {value!r}"


def test_bench_data_quick(tmp_path: Path) -> None:
    # one preprocessing worker: a pool of two would spend most of the test importing torch in its workers (the
    # pool itself is tested in test_preprocess)
    result = run_script("bench_data.py", tmp_path, "--quick", "--loader-data", "subset", "loader.num_workers=1",
                        "preprocess.workers=1")
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
    cfg = load_config(["model=mobilevit_xxs", "model.img_size=32", "loader.batch_size=8", "loader.num_workers=1"])
    assert report["settings"]["preprocess"]["crop_size"] == cfg.preprocess.crop_size  # make data's settings

    detection = report["detection"]["tiny"]
    assert set(detection["per_class"]) == {"BL1", "PA1", "PA2", "PA3", "PA4"}
    assert 0 < detection["overall"] <= 1 and all(0 <= rate <= 1 for rate in detection["per_class"].values())
    assert detection["n_frames"] == 5 * cfg.preprocess.frames_per_video
    assert 0 < detection["n_detected"] <= detection["n_frames"]

    loader = report["loader"]
    assert_positive(loader, ("images_per_s", "training_images_per_s", "ratio", "images", "workers"), "loader")
    assert loader["ratio"] == pytest.approx(loader["images_per_s"] / loader["training_images_per_s"])
    assert (loader["model"], loader["img_size"], loader["batch_size"], loader["workers"]) == ("mobilevit_xxs", 32, 8, 1)
    assert loader["settings"]["optim"] == dataclasses.asdict(OptimConfig(**cfg.model.optim))
    assert loader["images"] >= 4 * 8  # --loader-batches 4 of batch 8 in the quick run's one pass
    assert report["loader_dataset"]["kind"] == "subset:tiny"
    assert report["loader_dataset"]["train_frames"] >= 32

    assert "Preprocessing" in result.stdout and "loader img/s" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench_data.json", "bench_data.png"]


def test_bench_train_quick(tmp_path: Path) -> None:
    result = run_script("bench_train.py", tmp_path, "--quick", "--data", "subset", "loader.batch_size=4",
                        "preprocess.workers=1", "--finetune", "full,lora")  # preprocess: no pool to start here
    assert_ran(result)
    report = json.loads((tmp_path / "out" / "bench_train.json").read_text())
    assert (tmp_path / "out" / "bench_train.png").stat().st_size > 0
    assert list(report["models"]) == ["mobilevit_xxs full", "mobilevit_xxs lora_r8"]  # the finetune column's rows
    entry, lora = report["models"]["mobilevit_xxs full"], report["models"]["mobilevit_xxs lora_r8"]
    # a CPU's peak memory is read through /proc/self/clear_refs (Linux; NaN where it cannot be reset)
    measured = ("peak_memory_MB",) if os.access("/proc/self/clear_refs", os.W_OK) else ()
    for name, row in report["models"].items():
        assert_positive(row, ("lightning_images_per_s", "bare_images_per_s", "ratio", "bare_seconds_per_step",
                              "parameters_M", "parameters_trainable", *measured), f"models.{name}")
    assert entry["backbone_trainable_share"] == 1.0 and 0 < lora["backbone_trainable_share"] < 0.1
    assert (entry["settings"]["finetune"], lora["settings"]["finetune"]) == ("full", "lora_r8")
    assert lora["parameters_trainable"] < entry["parameters_trainable"]
    assert entry["ratio"] == pytest.approx(entry["lightning_images_per_s"] / entry["bare_images_per_s"])
    settings = entry["settings"]
    cfg = load_config(["model=mobilevit_xxs", "model.img_size=32", "loader.batch_size=4"])  # the command line wins
    assert (settings["img_size"], settings["batch_size"], settings["task"]) == (32, 4, cfg.task.name)
    assert settings["optim"] == dataclasses.asdict(OptimConfig(**cfg.model.optim))
    assert report["settings"]["steps"] == 3 and entry["torch_threads"] >= 1 and settings["num_workers"] >= 0
    assert entry["dataset"]["train_frames"] >= 4 * (1 + 3 + 1)  # one epoch covers warm-up and timed steps
    assert "mobilevit_xxs" in result.stdout and "bare PyTorch img/s" in result.stdout
    device = training_device("auto")  # said first, and recorded with the numbers
    assert result.stdout.splitlines()[0] == device.line and report["environment"]["device"] == device.kind
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench_train.json", "bench_train.png"]


def test_bench_train_rejects_unknown_model(tmp_path: Path) -> None:
    """The script's own main, in this process (a subprocess would spend its time importing torch to say one line):
    the exit message names the backbone, and nothing was generated before it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", SCRIPTS / "bench_train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match=r"unknown backbone\(s\) no_such_net"):
        script.main(["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--no-progress", "--quick",
                     "--models", "no_such_net"])
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
