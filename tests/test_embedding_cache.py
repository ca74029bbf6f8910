"""The embedding cache of frozen backbones: built once and reused, a new entry for a changed key part, a corrupted
entry refused with its file named, and a frozen CV that reads embeddings only, scoring what the image CV scores."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.models.backbones import create_backbone
from pipeline.models.embedding_cache import CacheSettings, CorruptEmbeddings, ensure_embeddings
from pipeline.runs.orchestration.cross_validation import run_cv

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SETTINGS = CacheSettings(views=0, seed=0, batch_size=16)
# a frozen CV as small as it gets: two folds, two epochs, no augmentation (so images and embeddings see the same)
FROZEN = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "model.finetune=frozen",
          "loader.num_workers=0", "loader.batch_size=8", "trainer.max_epochs=2", "trainer.patience=2",
          "trainer.folds=[0]", "augment=none", "cv.log_models=false")


@pytest.fixture(scope="module")
def processed_copy(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny twin's crops in a folder of this module's own (the cache writes next to them)."""
    copy = tmp_path_factory.mktemp("cache") / "processed"
    shutil.copytree(tiny_base / "processed", copy, ignore=shutil.ignore_patterns("embeddings"))
    return copy


def entry(backbone, processed: Path, **changes):
    options = {"crop_fraction": 1.0, "from_s": None, "frames_per_video": None, "augment": {}, "settings": SETTINGS,
               "workers": 0, **changes}
    return ensure_embeddings(backbone, processed, **options)


def test_an_entry_is_built_once_rebuilt_for_a_changed_key_and_refused_when_corrupted(tmp_path: Path,
                                                                                     processed_copy: Path) -> None:
    processed = tmp_path / "processed"
    shutil.copytree(processed_copy, processed, ignore=shutil.ignore_patterns("embeddings"))
    torch.manual_seed(0)
    backbone, _ = create_backbone("mobilevit_xxs", img_size=32)
    first = entry(backbone, processed)
    again = entry(backbone, processed)
    assert first.built and not again.built and again.path == first.path
    np.testing.assert_array_equal(first.table.plain, again.table.plain)
    # every key part that changes the numbers gives another entry
    changed = [entry(backbone, processed, crop_fraction=0.8), entry(backbone, processed, frames_per_video=2),
               entry(backbone, processed, settings=CacheSettings(views=2, seed=0, batch_size=16),
                     augment={"horizontal_flip": {"p": 0.5}})]
    original = {key: value.clone() for key, value in backbone.state_dict().items()}
    with torch.no_grad():
        backbone.model.stem.conv.weight.mul_(1.01)  # other weights
    changed.append(entry(backbone, processed))
    assert all(item.built for item in changed) and len({item.path for item in [first, *changed]}) == 5
    assert changed[1].table.plain.shape[0] < first.table.plain.shape[0]  # 2 of the 3 crops per video
    assert changed[2].table.views.shape == (2, *first.table.plain.shape)
    assert not np.allclose(changed[2].table.views[0], changed[2].table.views[1])  # the views differ
    # a byte changed in the stored arrays of the first entry: refused, naming the file
    backbone.load_state_dict(original)
    data = bytearray(first.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.path.write_bytes(bytes(data))
    with pytest.raises(CorruptEmbeddings, match=f"embedding cache file {first.path} is corrupted"):
        entry(backbone, processed)


def augmentation_runs(cfg) -> tuple:
    """The newest finished CV parent of `cfg` and its first fold run."""
    from mlflow import MlflowClient

    from pipeline.runs.store import cv_runs, tracking

    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(cfg))
    return parent, tracking.fold_runs(client, parent.info.run_id)[0]


def test_a_frozen_cv_with_cached_views_says_how_many(tiny_config, processed_copy: Path, tmp_path: Path, capsys,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    processed = tmp_path / "processed"
    shutil.copytree(processed_copy, processed, ignore=shutil.ignore_patterns("embeddings"))
    cfg = tiny_config(*FROZEN, "trainer.max_epochs=1", "augment=light", "cache.views=2",
                      f"data.processed_dir={processed}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                      f"mlflow.artifact_root={tmp_path / 'art'}", f"cv.work_dir={tmp_path / 'runs'}")
    with caplog.at_level(logging.INFO, logger="pipeline.runs.jobs.fold_job"):
        run_cv(cfg)
    said = "2 augmented view(s) per crop (frozen embeddings, cache.views=2, drawn with augment.*)"
    assert f"augmentation: {said}" in capsys.readouterr().out  # the CV's printed summary
    assert any(said in record.getMessage() for record in caplog.records)  # the fold's line
    for run in augmentation_runs(cfg):
        assert (run.data.tags["augment_applied"], run.data.tags["augmentation"]) == ("true", said)


def fold_metrics(summary: dict) -> dict[str, float]:
    return {key: value for key, value in summary.items() if key.startswith(("cv/", "pooled/"))}


def test_a_frozen_cv_reads_embeddings_only_builds_them_once_and_scores_as_from_images(
        tiny_config, processed_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = (f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"mlflow.artifact_root={tmp_path / 'art'}",
             f"cv.work_dir={tmp_path / 'runs'}")
    cached = (*FROZEN, *store, f"data.processed_dir={processed_copy}")
    with caplog.at_level(logging.INFO, logger="pipeline.models.embedding_cache"):
        first = run_cv(tiny_config(*cached))
        built = [r for r in caplog.records if r.getMessage().startswith("building embeddings")]
        assert len(built) == 1
        # trained without augmentation (cache.views=0): the runs say so beside the augment.* params they keep
        parent, fold = augmentation_runs(tiny_config(*cached))
        for run in (parent, fold):
            assert run.data.tags["augment_applied"] == "false", run.data.tags
            assert run.data.tags["augmentation"].startswith("none (frozen embeddings, cache.views=0")
        assert "augment.affine" in parent.data.params  # kept for the run's identity (augment=none: null)
        caplog.clear()
        shutil.rmtree(processed_copy / "crops")  # from now on, no image can be read
        second = run_cv(tiny_config(*cached, "cv.resume=never"))
        assert not [r for r in caplog.records if r.getMessage().startswith("building embeddings")]
        assert [r for r in caplog.records if r.getMessage().startswith("embeddings of mobilevit_xxs read")]
    from_images = run_cv(tiny_config(*FROZEN, *store, "cache.embeddings=false"))
    assert all(run.data.tags["augment_applied"] == "true"
               for run in augmentation_runs(tiny_config(*FROZEN, *store, "cache.embeddings=false")))
    assert fold_metrics(first) and fold_metrics(first).keys() == fold_metrics(from_images).keys()
    for key, value in fold_metrics(from_images).items():
        assert first[key] == pytest.approx(value, abs=1e-5, nan_ok=True), key
        assert second[key] == pytest.approx(first[key], abs=1e-7, nan_ok=True), key


@pytest.mark.slow
def test_a_parallel_frozen_cv_builds_the_shared_entry_once_in_its_driver(tiny_config, tiny_base: Path,
                                                                         tmp_path: Path, capsys) -> None:
    """Two fold jobs side by side, each on a core of its own, would each build the missing entry at once: the
    driver builds it first (on all its threads), and both jobs read it (its record older than either fold run);
    their scores are those of the local CV."""
    from mlflow import MlflowClient

    from pipeline.runs.store import cv_runs, tracking

    processed = tmp_path / "processed"  # from the tiny twin itself: a test above removes processed_copy's crops
    shutil.copytree(tiny_base / "processed", processed, ignore=shutil.ignore_patterns("embeddings"))
    store = (f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"mlflow.artifact_root={tmp_path / 'art'}",
             f"data.processed_dir={processed}", "trainer.folds=[0,1]", "trainer.max_epochs=1")
    parallel = run_cv(tiny_config(*FROZEN, *store, "launcher=parallel", "launcher.jobs=2",
                                  f"cv.work_dir={tmp_path / 'parallel'}"))
    (record,) = (processed / "embeddings").rglob("*.json")  # one entry, written before either fold run started
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(tiny_config(*FROZEN, *store)))
    folds = tracking.fold_runs(client, parent.info.run_id)
    assert len(folds) == 2 and record.stat().st_mtime * 1000 < min(run.info.start_time for run in folds)
    assert "embedding cache: the shared entry built here on" in capsys.readouterr().out
    local = run_cv(tiny_config(*FROZEN, *store, "mlflow.experiment=local", f"cv.work_dir={tmp_path / 'local'}"))
    assert "embedding cache: the shared entry" not in capsys.readouterr().out  # one process: it builds as it goes
    assert fold_metrics(parallel) == pytest.approx(fold_metrics(local), abs=1e-6)
