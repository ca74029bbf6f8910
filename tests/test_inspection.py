"""`make inspect` end to end on tiny cross-validations, in real sqlite MLflow stores of the tests' own."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from omegaconf import OmegaConf

from pipeline.analysis.comparison_report import cost_lines, plot_accuracy_vs_cost
from pipeline.analysis.comparison_runs import cost_and_regions, fold_scores
from pipeline.analysis.comparison_statistics import summary_table
from pipeline.analysis.inspection import InspectSettings, inspect_cv
from pipeline.analysis.regions import box_polygon, polygons_mask
from pipeline.cli import main
from pipeline.models.cost import backbone_cost
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store.cv_runs import CvConfig
from pipeline.runs.store.tracking import fold_runs, store_uri
from pipeline.utils.config import load_config
from pipeline.utils.paths import resolve_path
from tests.conftest import tiny_overrides

# A ViT (rollout, Grad-CAM, the paper's pictures) at 32 px: 2 x 2 patches; one epoch per fold is enough to inspect.
TINY_VIT = ("model=timm", "model.name=vit_tiny_patch16_224", "model.img_size=32", "model.pretrained=false",
            "loader.num_workers=0", "loader.batch_size=8", "trainer.max_epochs=1", "trainer.patience=1",
            "trainer.folds=[0,1]", "augment=light")
IMAGES = {"grid.png", "video_maps.npz", "attention_distance.png", "embedding_filters.png", "position_similarity.png"}
NUMBERS = {"video_scores.csv", "attention_distance.csv"}


def own_store(base: Path) -> tuple[str, ...]:
    return (f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}", f"mlflow.artifact_root={base / 'artifacts'}",
            f"reports_dir={base / 'reports'}", f"cv.work_dir={base / 'runs'}")


def upper_face(row: pd.Series, data_config, crop_fraction: float) -> np.ndarray:
    """Hand-made regions for every crop: a band across the upper half of the model's view."""
    size = int(data_config.input_size[1])
    return polygons_mask([box_polygon((0, size / 4, size, size / 2))], size, size)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One MLflow store for this module's cross-validations (a new sqlite store costs seconds of migrations)."""
    return tmp_path_factory.mktemp("inspect")


def parent_of(cfg, dataset: str) -> str:
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    runs = client.search_runs([experiment.experiment_id],
                              f"tags.`painvit.run_kind` = 'cv' and tags.dataset = '{dataset}'")
    return runs[0].info.run_id


@pytest.fixture(scope="module")
def vit_cv(tiny_base: Path, store: Path) -> tuple:
    overrides = tiny_overrides(tiny_base, *TINY_VIT, *own_store(store))
    cfg = load_config(overrides)
    run_cv(cfg)
    return cfg, MlflowClient(cfg.mlflow.tracking_uri), parent_of(cfg, "synthetic"), overrides


def artifact_names(client: MlflowClient, run_id: str, folder: str) -> set[str]:
    return {Path(a.path).name for a in client.list_artifacts(run_id, folder)}


def every_artifact(client: MlflowClient, run_id: str, folder: str | None = None) -> list[str]:
    found = []
    for item in client.list_artifacts(run_id, folder):
        found += every_artifact(client, run_id, item.path) if item.is_dir else [item.path]
    return found


def test_make_inspect_logs_pictures_and_numbers_of_every_fold(vit_cv, capsys) -> None:
    cfg, client, parent_id, overrides = vit_cv
    assert main(["inspect", *overrides]) == 0  # the newest finished CV of the model, as `make inspect` finds it
    out = capsys.readouterr().out
    assert f"parent run {parent_id}" in out and "fold runs in MLflow (synthetic faces)" in out
    assert "region score: not computed" not in out  # the twin records where it draws the action units
    out_dir = next((Path(cfg.reports_dir) / "inspect").glob(f"*_{parent_id[:8]}"))

    children = [run for run in fold_runs(client, parent_id) if run.info.status == "FINISHED"]
    assert len(children) == 2
    for child in children:
        assert IMAGES | NUMBERS <= artifact_names(client, child.info.run_id, "inspect")  # synthetic faces may go
        metrics = client.get_run(child.info.run_id).data.metrics
        assert {f"inspect/attention_distance/layer_{layer}" for layer in range(12)} <= set(metrics)
        assert 0 <= metrics["inspect/gradcam/empty_map_share"] < 1
        fold = child.data.tags["fold"]
        assert (out_dir / f"fold_{fold}" / "grid.png").is_file()
        scores = pd.read_csv(client.download_artifacts(child.info.run_id, "inspect/video_scores.csv"))
        assert len(scores) == 4 and set(scores["label"]) == {0, 1}  # the test subject's BL1 and PA4 videos
        maps = np.load(client.download_artifacts(child.info.run_id, "inspect/video_maps.npz"))
        for method in ("rollout", "gradcam"):
            assert maps[f"map_{method}"].shape == (4, 32, 32)
            # each video's score is the mean of its crops' scores against the twin's action-unit regions
            assert (scores[f"region_score_{method}"] > 0).all()
            assert metrics[f"inspect/{method}/region_score"] == pytest.approx(scores[f"region_score_{method}"].mean())
        assert (maps["map_rollout"] > 0).all()  # rollout never leaves a patch without attention

    parent = client.get_run(parent_id).data.metrics
    for method in ("rollout", "gradcam"):
        per_fold = [client.get_run(child.info.run_id).data.metrics[f"inspect/{method}/region_score"]
                    for child in children]
        assert parent[f"inspect/{method}/region_score_mean"] == pytest.approx(np.mean(per_fold))
        assert parent[f"inspect/{method}/region_score_std"] == pytest.approx(np.std(per_fold, ddof=1))
    assert client.get_run(parent_id).data.tags["painvit.inspect_images"] == "mlflow and disk"

    # `make compare` puts the region score next to accuracy and cost (the cost the cross-validation recorded)
    parent = client.get_run(parent_id)
    summary = summary_table(fold_scores(client, parent, ["test/video_auroc"]), ["test/video_auroc"])
    table = cost_and_regions({"vit_tiny_patch16_224": parent}, summary, "bl1_vs_pa4")
    row = table.iloc[0]
    assert row["cost_source"] == "run"
    assert row["params"] == backbone_cost("vit_tiny_patch16_224", 32)["cost/params"]
    assert row["region_gradcam_mean"] == pytest.approx(parent.data.metrics["inspect/gradcam/region_score_mean"])
    assert "region gradcam" in cost_lines(table)


@pytest.fixture(scope="module")
def biovid_cv(tiny_base: Path, store: Path) -> tuple:
    """A cross-validation with data=biovid on the tiny twin's raw videos (BioVid's layout), one fold."""
    base = store / "biovid"
    (base / "manifests").mkdir(parents=True)
    for suffix in (".csv", ".json"):  # the twin's folds, under the name BioVid's all87 subject set reads
        shutil.copy(tiny_base / "manifests" / f"kfold5_all{suffix}", base / "manifests" / f"kfold5_all87{suffix}")
    overrides = ["data=biovid", f"data.root={tiny_base / 'raw'}", f"data.processed_dir={base / 'processed'}",
                 f"data.manifest_dir={base / 'manifests'}", "preprocess.frames_per_video=3", "preprocess.crop_size=64",
                 "preprocess.workers=1", "trainer.precision=32-true", "model=mobilevit_xxs", "model.img_size=32",
                 "model.pretrained=false", "augment=light", "loader.num_workers=0", "loader.batch_size=8",
                 "trainer.max_epochs=1", "trainer.folds=[0]", *own_store(store)]
    cfg = load_config(overrides)
    run_cv(cfg)
    return cfg, MlflowClient(cfg.mlflow.tracking_uri), parent_of(cfg, "biovid"), overrides


def test_make_inspect_on_biovid_keeps_every_image_off_mlflow(biovid_cv, capsys) -> None:
    cfg, client, parent_id, overrides = biovid_cv
    assert main(["inspect", *overrides, f"--run={parent_id}"]) == 0  # as `make inspect DATA=biovid RUN=...`
    out = capsys.readouterr().out
    assert "biometric data" in out and "on this disk only" in out and "MLflow gets numbers only" in out

    child = next(run for run in fold_runs(client, parent_id) if run.info.status == "FINISHED")
    logged = every_artifact(client, child.info.run_id) + every_artifact(client, parent_id)
    assert {Path(path).name for path in logged if path.startswith("inspect/")} == {"video_scores.csv"}
    assert not {Path(path).name for path in logged} & IMAGES
    assert not [path for path in logged if path.endswith((".jpg", ".npz"))]
    assert "inspect/gradcam/empty_map_share" in client.get_run(child.info.run_id).data.metrics  # numbers do go
    out_dir = next((Path(cfg.reports_dir) / "inspect").glob(f"*_{parent_id[:8]}"))
    assert (out_dir / "fold_0" / "grid.png").is_file() and (out_dir / "fold_0" / "video_maps.npz").is_file()
    assert client.get_run(parent_id).data.tags["painvit.inspect_images"].startswith("disk only")


def test_untrained_baseline_and_the_cost_reach_make_compare(biovid_cv) -> None:
    cfg, client, parent_id, _ = biovid_cv
    settings = InspectSettings(CvConfig.from_config(cfg), store_uri(cfg.mlflow.tracking_uri), cfg.data.name, False,
                               resolve_path(cfg.fold_file), resolve_path(cfg.data.processed_dir),
                               OmegaConf.to_container(cfg.loader, resolve=True), cfg.seed,
                               resolve_path(cfg.reports_dir))
    baseline = inspect_cv(settings, run_id=parent_id, untrained=True, regions=upper_face)
    fold = baseline["folds"][0]
    metrics = client.get_run(parent_id).data.metrics
    assert metrics["inspect/untrained/gradcam/region_score_mean"] == pytest.approx(
        fold.metrics["inspect/gradcam/region_score"])
    assert "inspect/untrained/gradcam/region_score" in client.get_run(fold.run_id).data.metrics
    assert baseline["out_dir"].name.endswith("_untrained")
    # the baseline is a fresh network on the same test videos: its predictions are not the kept model's
    kept = pd.read_csv(client.download_artifacts(fold.run_id, "predictions_videos.csv"))
    both = fold.videos.merge(kept, on=["subject_name", "sample_name"], suffixes=("", "_kept"))
    assert len(both) == len(kept) == len(fold.videos)
    assert not np.allclose(both["prob_PA4"], both["prob_PA4_kept"], atol=1e-4)

    # a cost recorded on the parent run (the CV logs pipeline.models.cost.backbone_cost) is read, not recomputed
    cost = backbone_cost("mobilevit_xxs", 32)
    client.log_batch(parent_id, metrics=[Metric(key, value, 0, 0) for key, value in cost.items()])
    parent = client.get_run(parent_id)
    summary = summary_table(fold_scores(client, parent, ["test/video_auroc"]), ["test/video_auroc"])
    row = cost_and_regions({"mobilevit_xxs": parent}, summary, "bl1_vs_pa4").iloc[0]
    assert (row["cost_source"], row["macs"]) == ("run", cost["cost/macs"])
    assert row["untrained_region_gradcam_mean"] == pytest.approx(metrics["inspect/untrained/gradcam/region_score_mean"])
    plot_accuracy_vs_cost(pd.DataFrame([row]), "test/video_auroc", Path(cfg.reports_dir) / "cost.png")
    assert (Path(cfg.reports_dir) / "cost.png").stat().st_size > 0
