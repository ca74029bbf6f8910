"""An ordinal output end to end on the tiny twin: a five-class CV with `model/output=ordinal` (CORAL) trains, logs
the graded metrics per fold and pooled, keeps fold models that load as ordinal models, score new frames through the
scorer (`FrameScorer`) and export to ONNX with their level probabilities, which a runtime reading only the contract
reproduces; the same output under a temporal head (a two-stage GRU) does all of it over clips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from pipeline.data.datamodule import PainDataModule, SubjectRoles
from pipeline.data.tasks import get_task
from pipeline.deployment.export import run_export
from pipeline.deployment.predict import find_scorer
from pipeline.deployment.video_frames import sampled_frames
from pipeline.evaluation.aggregation import ordinal_decision
from pipeline.models.model_file import load_model_file
from pipeline.models.ordinal import CoralHead, output_probabilities
from pipeline.models.temporal_heads import ClipLevels, ClipNet
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import cv_label
from pipeline.utils.paths import resolve_path
from tests.conftest import loader_config, scorer_source
from tests.onnx_contract_client import ContractRuntime

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ORDINAL = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
           "loader.batch_size=8", "trainer.max_epochs=2", "trainer.patience=1", "trainer.folds=[0,1]",
           "augment=light", "task=five_class", "model/output=ordinal")
LEVELS = ["BL1", "PA1", "PA2", "PA3", "PA4"]


@pytest.fixture(scope="module")
def ordinal_cv(tiny_config, tmp_path_factory) -> dict:
    """A finished two-fold five-class CV of an ordinal MobileViT-XXS in a store of its own."""
    own = tmp_path_factory.mktemp("ordinal_cv")
    cfg = tiny_config(*ORDINAL, f"mlflow.tracking_uri=sqlite:///{own / 'mlflow.db'}",
                      f"mlflow.artifact_root={own / 'mlartifacts'}", f"cv.work_dir={own / 'runs'}",
                      f"reports_dir={own / 'reports'}")
    summary = run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id],
                                f"tags.`{tracking.RUN_KIND_TAG}` = 'cv'")[0]
    folds = tracking.finished_fold_runs(client, parent.info.run_id)
    assert sorted(folds) == [0, 1]
    return {"cfg": cfg, "summary": summary, "client": client, "parent": parent, "folds": folds, "dir": own}


def test_each_fold_and_the_cv_log_graded_metrics_and_level_ordered_confusions(ordinal_cv) -> None:
    client, summary = ordinal_cv["client"], ordinal_cv["summary"]
    for run in ordinal_cv["folds"].values():
        metrics = run.data.metrics
        assert 0.0 <= metrics["test/video_mae"] <= 4.0 and -1.0 <= metrics["test/video_qwk"] <= 1.0
        assert {"test/video_mae_ci95_low", "test/video_qwk_ci95_high", "test/video_macro_f1"} <= set(metrics)
        assert "test/video_spearman_within_subject_n_subjects" in metrics
        stored = {info.path for info in client.list_artifacts(run.info.run_id)}
        assert {"confusion_levels.csv", "confusion_levels.png"} <= stored
        levels = pd.read_csv(client.download_artifacts(run.info.run_id, "confusion_levels.csv"))
        assert levels["true"].tolist() == LEVELS  # rows and columns in level order
        videos = pd.read_csv(client.download_artifacts(run.info.run_id, "predictions_videos.csv"))
        assert levels.drop(columns="true").to_numpy().sum() == len(videos)
        # the called level is the ordinal rule on the video's level probabilities, not their argmax
        called = ordinal_decision(videos[[f"prob_{name}" for name in LEVELS]].to_numpy())
        assert videos["pred"].tolist() == videos["decision"].tolist() == called.tolist()
        mae = np.abs(videos["label"] - videos["decision"]).mean()
        assert metrics["test/video_mae"] == pytest.approx(mae)
    assert np.isfinite(summary["pooled/video_mae"]) and np.isfinite(summary["pooled/video_qwk"])
    assert summary["pooled/video_mae_ci95_low"] <= summary["pooled/video_mae"] <= summary["pooled/video_mae_ci95_high"]
    assert np.isfinite(summary["cv/video_mae_mean"])
    parent = ordinal_cv["parent"].info.run_id
    table = pd.read_csv(client.download_artifacts(parent, "graded_metrics.csv"))
    assert {"pooled", "fold 0", "fold 1"} <= set(table["scope"])
    stored = {info.path for info in client.list_artifacts(parent)}
    assert {"confusion_levels_pooled.csv", "confusion_levels_pooled.png"} <= stored


def test_the_cv_carries_its_output_and_protocol_and_is_named_by_them(ordinal_cv, tiny_config) -> None:
    tags = ordinal_cv["parent"].data.tags
    assert (tags["output"], tags["personalise"]) == ("ordinal_coral", "none")
    assert cv_label(tags) == "mobilevit_xxs ordinal_coral"  # not the label of the backbone's softmax CVs
    # a personalisation protocol on a path that does not apply it (a backbone trained on images) is refused, never
    # trained as a plain CV under its name
    with pytest.raises(ValueError, match=r"personalise=baseline \(baseline_k1\) is applied to a frozen backbone's "
                                         r"cached embeddings.*a backbone trained on images"):
        run_cv(tiny_config(*ORDINAL, "personalise=baseline"))


def test_the_kept_ordinal_model_loads_and_gives_the_folds_test_probabilities(ordinal_cv) -> None:
    cfg, client = ordinal_cv["cfg"], ordinal_cv["client"]
    run = ordinal_cv["folds"][0]
    net, meta = load_model_file(run.info.run_id, tracking_uri=cfg.mlflow.tracking_uri)
    assert isinstance(net.head, CoralHead) and meta["output"]["name"] == "ordinal" and meta["class_names"] == LEVELS
    biases = net.head.biases().detach()
    assert (biases[1:] < biases[:-1]).all()  # CORAL's K-1 thresholds stay ordered after training
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                get_task("five_class"), net.backbone.data_config, {}, loader_config(num_workers=0, **{
                                    key: meta["loader"][key] for key in ("frames_per_video", "from_s", "crop_fraction")
                                    if key in meta["loader"]}), cfg.seed)
    datamodule.setup()
    with torch.no_grad():
        probs = torch.cat([output_probabilities(net.head, net(images))
                           for images, _, _ in datamodule.test_dataloader()])
    logged = pd.read_csv(client.download_artifacts(run.info.run_id, "predictions_frames.csv"))
    expected = datamodule.frames("test").reset_index(drop=True)
    ours = expected.assign(**{f"ours_{name}": probs[:, i].numpy() for i, name in enumerate(LEVELS)})
    merged = ours.merge(logged, on=["sample_name", "frame_index"])
    assert len(merged) == len(logged) == len(expected)
    for name in LEVELS:
        np.testing.assert_allclose(merged[f"ours_{name}"], merged[f"prob_{name}"], atol=1e-5)


def test_the_ordinal_model_scores_frames_and_its_onnx_export_gives_the_same_pain_probabilities(ordinal_cv) -> None:
    cfg, run = ordinal_cv["cfg"], ordinal_cv["folds"][1]
    scorer, _ = find_scorer(scorer_source(cfg), run=run.info.run_id)
    video = sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]
    frames = list(next(sampled_frames(video, 5))[2][:8])
    table = scorer.score(frames)
    found = table[table.face_found.astype(bool)]
    assert len(found) >= 6
    probs = found[[f"prob_{name}" for name in LEVELS]].to_numpy(dtype=float)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(found.pain_probability, 1.0 - probs[:, 0], atol=1e-6)  # P(level >= 1)
    path = run_export(cfg, run=run.info.run_id, out=str(ordinal_cv["dir"] / "export"))
    runtime = ContractRuntime(path.with_suffix(".json"))
    assert runtime.contract["output"] == "level_probabilities"
    assert runtime.contract["output_settings"]["pain_level"] == 1
    assert runtime.contract["max_abs_difference_to_pytorch"] < 1e-4
    follower = scorer.follower()
    faces = [follower.step(face) for face in scorer.find_faces(frames)]
    with_face = [i for i, face in enumerate(faces) if face is not None]
    crops = [runtime.aligned_crop(frames[i], np.stack([faces[i][5:10], faces[i][10:15]], axis=1)) for i in with_face]
    theirs = runtime.pain_probabilities(crops)
    np.testing.assert_allclose(theirs, table.pain_probability.iloc[with_face].to_numpy(dtype=float), rtol=0,
                               atol=1e-4)


def test_a_two_stage_clip_model_over_levels_trains_scores_windows_and_exports(tiny_config, tmp_path: Path) -> None:
    """An ordinal output under a temporal head: a frozen backbone's two-stage GRU on five classes logs the graded
    metrics of its clip scores, keeps a clip model whose head ends in CORAL with ordered thresholds, whose window
    scores are level probabilities (pain = P(level >= 1)), and which exports with them."""
    cfg = tiny_config(*ORDINAL, "trainer.folds=[0]", "model.finetune=frozen", "model.head.name=gru",
                      "model.head.mode=two_stage", "model.head.epochs=3", "augment=none", "cv.log_models=true",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                      f"mlflow.artifact_root={tmp_path / 'mlartifacts'}", f"cv.work_dir={tmp_path / 'runs'}")
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id],
                                f"tags.`{tracking.RUN_KIND_TAG}` = 'cv'")[0]
    assert parent.data.tags["output"] == "ordinal_coral"
    run = tracking.finished_fold_runs(client, parent.info.run_id)[0]
    assert 0.0 <= run.data.metrics["test/video_mae"] <= 4.0
    videos = pd.read_csv(client.download_artifacts(run.info.run_id, "predictions_videos.csv"))
    probs = videos[[f"prob_{name}" for name in LEVELS]].to_numpy()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert videos["decision"].tolist() == ordinal_decision(probs).tolist()
    net, meta = load_model_file(run.info.run_id, tracking_uri=cfg.mlflow.tracking_uri)
    assert isinstance(net, ClipNet) and isinstance(net.head, ClipLevels) and meta["output"]["name"] == "ordinal"
    biases = net.head.levels.biases().detach()
    assert (biases[1:] < biases[:-1]).all()
    scorer, _ = find_scorer(scorer_source(cfg), run=run.info.run_id)
    video = sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]
    table = scorer.score(list(next(sampled_frames(video, 5))[2][:8]))
    found = table[table.face_found.astype(bool)]
    window = found[[f"prob_{name}" for name in LEVELS]].to_numpy(dtype=float)
    assert len(found) >= 6
    np.testing.assert_allclose(window.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(found.pain_probability, 1.0 - window[:, 0], atol=1e-6)
    path = run_export(cfg, run=run.info.run_id, out=str(tmp_path / "export"))
    runtime = ContractRuntime(path.with_suffix(".json"))
    assert runtime.contract["output"] == "level_probabilities"
    assert runtime.contract["max_abs_difference_to_pytorch"] < 1e-4
