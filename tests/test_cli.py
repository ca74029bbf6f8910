"""The front door: config composition, `python -m pipeline data` / `aug-preview` on a fresh folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import pandas as pd
import pytest

from pipeline.utils.config import load_config
from pipeline.utils.config_checks import UsageError
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import tiny_overrides


def run_pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=600)


def test_config_composes_groups_and_rejects_unknown_keys() -> None:
    cfg = load_config(["model=cvt_13", "protocol=loso", "task=five_class"])
    assert (cfg.model.name, cfg.protocol.name, cfg.task.name) == ("cvt_13", "loso", "five_class")
    assert cfg.fold_file.endswith("loso_all.csv")
    biovid = load_config(["data=biovid", "data.root=/somewhere"])
    assert biovid.model.pretrained is True and biovid.fold_file.endswith("data_manifests/biovid/kfold5_all87.csv")
    with pytest.raises(UsageError, match="did you mean model.optim.head_lr=1"):
        load_config(["model.optim.head_rate=1"])
    with pytest.raises(UsageError, match="adding keys is not allowed"):
        load_config(["+trainer.new_key=1"])


def test_data_command_on_a_fresh_folder(tmp_path: Path) -> None:
    """Generate the twin, crop faces and write folds from nothing, as `make data` does."""
    result = run_pipeline("data", *tiny_overrides(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "data ready" in result.stdout
    samples = pd.read_csv(tmp_path / "raw" / "starting_point" / "samples.csv", sep="\t")
    frames = pd.read_csv(tmp_path / "processed" / "frames.csv")
    failures = pd.read_csv(tmp_path / "processed" / "failures.csv")
    assert frames.sample_name.nunique() + len(failures) == len(samples)
    assert json.loads((tmp_path / "processed" / "preprocess.json").read_text())["frames_per_video"] == 3
    folds = pd.read_csv(tmp_path / "manifests" / "kfold5_all.csv")
    assert folds.fold.nunique() == 5 and set(folds.role) == {"train", "val", "test"}
    # a rerun resumes: nothing is processed again
    again = run_pipeline("data", *tiny_overrides(tmp_path))
    assert again.returncode == 0 and "0 processed now" in again.stdout


def test_biovid_without_root_says_how_to_set_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BIOVID_ROOT"}
    result = subprocess.run([sys.executable, "-m", "pipeline", "data", "data=biovid"], cwd=PROJECT_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "BIOVID_ROOT=" in result.stderr
    result = run_pipeline("data", "data=biovid", f"data.root={tmp_path}")
    assert result.returncode != 0 and "not a BioVid Part A folder" in result.stderr


def test_aug_preview_writes_a_png(tiny_base: Path) -> None:
    result = run_pipeline("aug-preview", *tiny_overrides(tiny_base, "model=mobilevit_xxs", "model.img_size=64"))
    assert result.returncode == 0, result.stderr
    image = cv2.imread(str(tiny_base / "reports" / "aug_preview_synthetic_mobilevit_xxs.png"))
    assert image is not None and image.shape[0] > 64 and image.shape[1] > 64


def test_notebook_is_valid_and_its_code_compiles() -> None:
    notebook = json.loads((PROJECT_ROOT / "notebooks" / "review_cross_validation.ipynb").read_text())
    sources = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert sources
    for index, source in enumerate(sources):
        compile(source, f"notebook cell {index}", "exec")


def test_a_twin_or_crops_made_with_other_settings_stop_with_what_to_do(tiny_base: Path) -> None:
    """After the default twin changed, `make data` on an old twin folder says which settings differ and how to go on:
    one line, exit 2, no traceback. The same for crops made with other settings."""
    twin = run_pipeline("data", *tiny_overrides(tiny_base, "data.synthetic.difficulty=classic"))
    assert twin.returncode == 2 and "Traceback" not in twin.stderr
    assert "difficulty: 'hard' -> 'classic'" in twin.stderr and "make clean-data" in twin.stderr
    crops = run_pipeline("data", *tiny_overrides(tiny_base, "data.align_faces=false"))
    assert crops.returncode == 2 and "Traceback" not in crops.stderr
    assert "holds crops made with other settings (align differ" in crops.stderr
