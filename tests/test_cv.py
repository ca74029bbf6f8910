"""The whole `make cv` / `make compare` path on the tiny synthetic twin, in a real sqlite MLflow store."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import pytorch_lightning as pl
import timm
import torch
from mlflow import MlflowClient

from pipeline.analysis.compare import compare, run_compare
from pipeline.analysis.comparison_runs import ComparisonError
from pipeline.data.datamodule import PainDataModule, SubjectRoles
from pipeline.data.tasks import get_task
from pipeline.evaluation.thresholds import choose_threshold
from pipeline.models.lightning_module import OptimConfig, PainLightningModule
from pipeline.models.model_file import load_model_file
from pipeline.runs.jobs.fold_job import train_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.orchestration.cross_validation import identity_lock, plan_cv, run_cv
from pipeline.runs.orchestration.cv_settings import CvRunSettings
from pipeline.runs.orchestration.cv_summary import HEADLINE_METRICS
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import CvConfig, run_key
from pipeline.runs.store.environment import FREEZE_ARTIFACT
from pipeline.runs.store.tracking import get_or_create_experiment
from pipeline.utils.accelerator import training_device
from pipeline.utils.paths import resolve_path
from tests.conftest import loader_config, planned

# Tiny and fast: a small timm model, 32 px inputs, no workers, two folds.
FAST = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
        "loader.batch_size=8", "trainer.max_epochs=3", "trainer.patience=1", "trainer.folds=[0,1]",
        "augment=light")


@pytest.fixture(scope="module")
def cv_runs(tiny_config) -> dict:
    """Two backbones cross-validated on the same folds into one sqlite store."""
    first = run_cv(tiny_config(*FAST))
    second = run_cv(tiny_config(*FAST, "model=timm", "model.name=resnet10t"))
    return {"mobilevit_xxs": first, "resnet10t": second}


def fold_run(cfg):
    """An MLflow run in the test's own store and artifact folder, for calling train_fold directly."""
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    experiment_id = get_or_create_experiment("train-fold-tests", Path(cfg.mlflow.artifact_root))
    return mlflow.start_run(experiment_id=experiment_id)


def runs_of(cfg, kind: str):
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    return client, client.search_runs([experiment.experiment_id], f"tags.`painvit.run_kind` = '{kind}'")


def test_parent_and_child_runs_hold_the_promised_records(cv_runs, tiny_config) -> None:
    cfg = tiny_config(*FAST)
    client, parents = runs_of(cfg, "cv")
    parent = next(r for r in parents if r.data.tags["model"] == "mobilevit_xxs")
    tags = parent.data.tags
    assert parent.info.status == "FINISHED"
    for key in ("model", "dataset", "protocol", "task", "git_commit", "seed", "weights_source", "fold_file_sha256"):
        assert tags[key], key
    assert (tags["dataset"], tags["protocol"], tags["task"], tags["weights_source"]) == (
        "synthetic", "kfold5", "bl1_vs_pa4", "random")
    for key in ("cv/video_auroc_mean", "cv/video_auroc_std", "cv/frame_accuracy_mean", "pooled/video_accuracy",
                "cv/video_accuracy_at_threshold_mean", "pooled/video_accuracy_at_threshold",
                "pooled/within_subject_video_auroc"):
        assert key in parent.data.metrics, key
    low, high = (parent.data.metrics[f"pooled/video_accuracy_at_threshold_ci95_{end}"] for end in ("low", "high"))
    assert 0 <= low <= parent.data.metrics["pooled/video_accuracy_at_threshold"] <= high <= 1
    assert parent.data.params["model.name"] == "mobilevit_xxs"
    assert tags["headline_metric"] == "pooled/video_accuracy_at_threshold"
    assert (tags["precision_asked"], tags["precision"]) == ("32-true", "32-true")  # asked, and what the folds used
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"config.yaml", "folds", "folds_summary.csv", "predictions_videos_all_folds.csv", "data",
            "scores_per_subject.csv", "reliability_video_pooled.png"} <= artifacts
    pooled = pd.read_csv(client.download_artifacts(parent.info.run_id, "predictions_videos_all_folds.csv"))
    assert parent.data.metrics["pooled/video_brier"] == pytest.approx(((pooled.prob_PA4 - pooled.label) ** 2).mean())
    assert 0 <= parent.data.metrics["pooled/video_ece"] <= 1
    for name in ("brier", "ece"):  # subject-bootstrap intervals, said to pool the fold models, beside the fold mean
        low, value, high = (parent.data.metrics[f"pooled/video_{name}{end}"] for end in ("_ci95_low", "", "_ci95_high"))
        assert 0 <= low <= value <= high
        assert f"cv/video_{name}_mean" in parent.data.metrics
    assert "mixes the 2 fold models" in tags["calibration_note"] and "mean over folds" in tags["calibration_note"]
    assert parent.data.metrics["data/subjects_tested"] == pooled.subject_name.nunique()
    # the headline figures under short names, equal to the long ones, and the experiment's view shows them as columns
    assert {name: parent.data.metrics[name] for name in HEADLINE_METRICS} == {
        name: float(f"{parent.data.metrics[key]:.4g}") for name, key in HEADLINE_METRICS.items()}
    view = json.loads(json.loads(client.get_experiment(parent.info.experiment_id).tags[
        tracking.SHARED_VIEW_TAG_PREFIX + tracking.HEADLINE_VIEW])["state"])
    assert view["selectedColumns"] == [tracking.DURATION_COLUMN, *(f"metrics.`{name}`" for name in HEADLINE_METRICS)]
    assert parent.data.metrics["data/videos_tested"] == len(pooled)
    assert parent.data.metrics["pooled/video_accuracy_argmax"] == pytest.approx((pooled.pred == pooled.label).mean())
    lost = pd.read_csv(client.download_artifacts(parent.info.run_id, "data/exclusions_per_class.csv"))
    assert set(lost.class_name) == {"BL1", "PA1", "PA2", "PA3", "PA4"} and (lost.sampled_frames > 0).all()
    assert parent.data.metrics["data/share_lost_BL1"] == pytest.approx(lost.set_index("class_name").share_lost["BL1"])
    # what it ran on and with: the device, the key libraries' versions, the whole environment
    device = training_device(cfg.trainer.accelerator)
    expected = tracking.training_device_tags(device)
    assert {k: tags[k] for k in expected} == expected and tags["device"] == device.kind
    assert tags["version.torch"] == torch.__version__ and tags["version.timm"] == timm.__version__
    assert tags["version.python"] == platform.python_version() and tags["version.lightning"] == pl.__version__
    freeze = Path(client.download_artifacts(parent.info.run_id, FREEZE_ARTIFACT)).read_text()
    assert f"timm=={timm.__version__}" in freeze and f"mlflow=={mlflow.__version__}" in freeze

    _, children = runs_of(cfg, "fold")
    children = [c for c in children if c.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["device"] == device.kind  # each fold's own node says where it trained
        assert (child.data.tags["precision"], child.data.tags["precision_asked"]) == ("32-true", "32-true")
        for key in ("test/video_auroc", "test/video_accuracy", "test/video_balanced_accuracy", "test/video_f1",
                    "test/frame_auroc", "test/frame_accuracy", "best_epoch"):
            assert key in child.data.metrics, key
        curve = client.get_metric_history(child.info.run_id, "val/video_auroc")
        assert [m.step for m in curve] == list(range(len(curve))) and len(curve) >= 2
        # the test fold is evaluated exactly once
        assert len(client.get_metric_history(child.info.run_id, "test/video_auroc")) == 1
        names = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"confusion_video.png", "training_curves.png", "predictions_videos.csv",
                "accuracy_per_subject.csv"} <= names
        videos = pd.read_csv(client.download_artifacts(child.info.run_id, "predictions_videos.csv"))
        assert set(videos.columns) >= {"subject_name", "sample_name", "label", "prob_BL1", "prob_PA4", "decision"}
        # the threshold is the one the validation videos give; no test subject is among them
        val = pd.read_csv(client.download_artifacts(child.info.run_id, "predictions_videos_val.csv"))
        assert not set(val.subject_name) & set(videos.subject_name)
        threshold = child.data.metrics["test/threshold"]
        rule = cfg.eval.threshold  # the configured rule, on the validation videos alone
        assert threshold == pytest.approx(choose_threshold(val.label.to_numpy(), val.prob_PA4.to_numpy(), rule,
                                                           n_subjects=val.subject_name.nunique()).threshold)
        assert child.data.params["threshold_rule"] == rule
        assert (videos.decision == (videos.prob_PA4 >= threshold)).all()
        assert child.data.metrics["test/video_accuracy_at_threshold"] == pytest.approx(
            (videos.decision == videos.label).mean())


def test_mean_over_folds_matches_the_children(cv_runs, tiny_config) -> None:
    cfg = tiny_config(*FAST)
    _, parents = runs_of(cfg, "cv")
    parent = next(r for r in parents if r.data.tags["model"] == "resnet10t")
    _, children = runs_of(cfg, "fold")
    scores = [c.data.metrics["test/frame_accuracy"] for c in children
              if c.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.data.metrics["cv/frame_accuracy_mean"] == pytest.approx(np.mean(scores))
    assert parent.data.metrics["cv/frame_accuracy_std"] == pytest.approx(np.std(scores, ddof=1))


def test_early_stopping_stops(tiny_config, tmp_path: Path) -> None:
    """With learning rates of zero the validation metric cannot improve: training stops after `patience` epochs.

    A ViT (layer norm, no dropout) so that nothing else changes the network in training mode, unlike batch norm.
    """
    cfg = tiny_config(*FAST, "model=timm", "model.name=vit_tiny_patch16_224", "trainer.max_epochs=8",
                      "trainer.patience=2", "model.optim.head_lr=0", "model.optim.backbone_lr=0")
    with fold_run(cfg):
        result = train_fold(TrainingSettings.from_config(cfg), 0, planned(cfg), tmp_path)
    assert result.epochs_trained == 3 and result.best_epoch == 0


def test_test_fold_is_scored_with_the_best_checkpoint(tiny_config, tmp_path: Path) -> None:
    # the crop window travels from the config to the data: crops at 2.0, 3.8 and 5.5 s, only the later two used
    cfg = tiny_config(*FAST, "trainer.max_epochs=3", "trainer.patience=5", "loader.from_s=3.0")
    with fold_run(cfg):
        result = train_fold(TrainingSettings.from_config(cfg), 1, planned(cfg), tmp_path)
    assert result.frame_predictions["time_s"].min() >= 3.0
    assert result.frame_predictions.groupby("sample_name").size().eq(2).all()
    checkpoint = torch.load(tmp_path / "best.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == result.best_epoch

    from pipeline.models.factory import create_model

    task = get_task(cfg.task.name)
    net, _ = create_model(cfg.model.name, n_classes=2, pretrained=False, img_size=cfg.model.img_size)
    module = PainLightningModule(net, task.classes, OptimConfig(**cfg.model.optim), aggregation=cfg.trainer.aggregation,
                                 topk=cfg.trainer.topk, decoding=cfg.eval.decoding)
    module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), 1),
                                task,
                                net.backbone.data_config, {}, loader_config(num_workers=0, from_s=3.0), cfg.seed)
    datamodule.setup()
    with torch.no_grad():
        probs = torch.cat([module(images).softmax(1) for images, _, _ in datamodule.test_dataloader()])
    np.testing.assert_allclose(result.frame_predictions["prob_PA4"].to_numpy(), probs[:, 1].numpy(), atol=1e-5)


def test_compare_writes_table_and_plot(cv_runs, tiny_config, capsys) -> None:
    cfg = tiny_config(*FAST, "compare.allow_incomplete=true")  # two folds of five: a smoke comparison
    result = run_compare(cfg)
    out = capsys.readouterr().out
    assert "SMOKE COMPARISON (compare.allow_incomplete=true)" in out
    # every pair comes with the smallest difference its test could have detected (80 % power, Holm's first step)
    assert "the smallest difference this test detects with 80% power is +-" in out
    tested = result["subjects_paired"].dropna(subset=["p_value"])  # a metric repeating another is not tested twice
    assert tested["mde80"].notna().all() and (tested["mde80"] >= 0).all()
    summary = pd.read_csv(result["paths"]["summary"])
    assert set(summary.model) == {"mobilevit_xxs", "resnet10t"}
    assert all(path.stat().st_size > 0 for path in result["paths"]["plots"].values())
    assert set(result["paired"].model_a) | set(result["paired"].model_b) == {"mobilevit_xxs", "resnet10t"}
    # subject-level: an interval inside [0, 1] around each backbone's pooled value, and a Holm-adjusted test
    subjects = pd.read_csv(result["paths"]["subjects"])
    assert set(subjects.model) == {"mobilevit_xxs", "resnet10t"}
    finite = subjects.dropna()
    assert len(finite) and ((0 <= finite.ci95_low) & (finite.ci95_low <= finite.value)
                            & (finite.value <= finite.ci95_high) & (finite.ci95_high <= 1)).all()
    paired = pd.read_csv(result["paths"]["subjects_paired"])
    primary = paired[paired.primary]  # Holm over the primary metric's tests, one a pair; the units are the folds
    assert (paired.n_subjects > 0).all() and len(primary) == 1 and (primary.p_holm >= primary.p_value).all()
    assert paired.unit.str.startswith("fold (2 folds").all() and (paired.n_units == 2).all()
    # calibration: pooled over each CV's fold models with subject-bootstrap intervals, the fold models' mean beside
    calibration = pd.read_csv(result["paths"]["calibration"]).set_index("model")
    assert "calibration of the pooled test videos, 95 % subject-bootstrap intervals (pooled over" in out
    client, parents = runs_of(cfg, "cv")
    for name in ("brier", "ece"):
        assert ((calibration[f"{name}_ci95_low"] <= calibration[name])
                & (calibration[name] <= calibration[f"{name}_ci95_high"])).all()
        for model in calibration.index:
            parent = next(r for r in parents if r.data.tags["model"] == model and r.info.status == "FINISHED")
            assert calibration.loc[model, name] == pytest.approx(parent.data.metrics[f"pooled/video_{name}"])
            assert calibration.loc[model, f"{name}_mean_over_folds"] == pytest.approx(
                parent.data.metrics[f"cv/video_{name}_mean"])


def test_compare_refuses_mismatched_folds(cv_runs, tiny_config, tmp_path: Path) -> None:
    other_folds = (*FAST, f"data.manifest_dir={tmp_path}", "protocol.seed=7", "trainer.folds=[0]",
                   "trainer.max_epochs=1")
    run_cv(tiny_config(*other_folds, "model=timm", "model.name=resnet10t"))
    cfg = tiny_config(*FAST)
    # The latest resnet10t CV ran on other folds: an unfiltered comparison must refuse ...
    with pytest.raises(ComparisonError, match="different fold files"):
        compare("synthetic", "kfold5", "bl1_vs_pa4", tmp_path, tracking_uri=cfg.mlflow.tracking_uri)
    # ... and `make compare` only considers CVs on the current fold file, so it pairs the two on identical folds.
    result = run_compare(tiny_config(*FAST, "compare.allow_incomplete=true"))
    client = MlflowClient(cfg.mlflow.tracking_uri)
    hashes = {client.get_run(run_id).data.tags["fold_file_sha256"] for run_id in result["parent_run_ids"].values()}
    assert len(hashes) == 1


def test_a_seeded_fold_is_reproducible(tiny_config, tmp_path: Path) -> None:
    cfg = tiny_config(*FAST, "trainer.max_epochs=2", "augment=heavy")
    predictions = []
    for attempt in range(2):
        with fold_run(cfg):
            result = train_fold(TrainingSettings.from_config(cfg),
                                0, planned(cfg), tmp_path / str(attempt))
        predictions.append(result.frame_predictions["prob_PA4"].to_numpy())
    np.testing.assert_array_equal(predictions[0], predictions[1])


def children_of(client: MlflowClient, parent_run_id: str) -> list:
    parent = client.get_run(parent_run_id)
    return client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def test_a_finished_cv_is_not_trained_again(cv_runs, tiny_config, capsys) -> None:
    cfg = tiny_config(*FAST)
    client, parents = runs_of(cfg, "cv")
    before = {r.info.run_id for r in parents}
    summary = run_cv(cfg)
    assert "already finished" in capsys.readouterr().out
    _, after = runs_of(cfg, "cv")
    assert {r.info.run_id for r in after} == before  # no new parent, no new fold runs
    assert summary["cv/video_auroc_mean"] == cv_runs["mobilevit_xxs"]["cv/video_auroc_mean"]


def test_a_changed_config_starts_a_new_parent_and_says_why(cv_runs, tiny_config, capsys) -> None:
    cfg = tiny_config(*FAST, "trainer.folds=[0]", "trainer.max_epochs=1")
    run_cv(cfg)
    out = capsys.readouterr().out
    assert "not resuming" in out and "trainer.max_epochs: 3 -> 1" in out
    assert "lease" not in out  # the older CV's fold leases are its jobs' bookkeeping, not settings that differ
    assert training_device("auto").line in out.splitlines()  # the device line, as `make cv` prints it


def test_kept_model_reloads_and_gives_the_same_test_predictions(cv_runs, tiny_config) -> None:
    cfg = tiny_config(*FAST)
    client, children = runs_of(cfg, "fold")
    child = next(c for c in children if c.data.tags["model"] == "mobilevit_xxs" and c.info.status == "FINISHED")
    net, meta = load_model_file(child.info.run_id, tracking_uri=cfg.mlflow.tracking_uri)
    assert (meta["model_name"], meta["class_names"], meta["task"]) == ("mobilevit_xxs", ["BL1", "PA4"], "bl1_vs_pa4")
    assert meta["weights"]["weights_source"] == "random" and meta["img_size"] == 32
    # the file alone is enough: it loads with weights_only=True (no pickled code)
    path = client.download_artifacts(child.info.run_id, "model/model.pt")
    assert torch.load(path, weights_only=True)["meta"] == meta

    fold = int(child.data.tags["fold"])
    task = get_task(meta["task"])
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), fold),
                                task,
                                net.backbone.data_config, {}, loader_config(num_workers=0, **{
                                    key: meta["loader"][key] for key in ("frames_per_video", "from_s", "crop_fraction")
                                    if key in meta["loader"]}), cfg.seed)
    datamodule.setup()  # fed as the kept model's own record says it was trained and tested
    with torch.no_grad():
        probs = torch.cat([net(images).softmax(1) for images, _, _ in datamodule.test_dataloader()])
    logged = pd.read_csv(client.download_artifacts(child.info.run_id, "predictions_frames.csv"))
    expected = datamodule.frames("test").reset_index(drop=True)
    merged = expected.assign(prob=probs[:, 1].numpy()).merge(logged, on=["sample_name", "frame_index"])
    assert len(merged) == len(logged) == len(expected)
    np.testing.assert_allclose(merged["prob"], merged["prob_PA4"], atol=1e-5)


def test_a_crashed_fold_fails_alone_and_a_rerun_runs_only_it(tiny_config, tmp_path: Path, capsys) -> None:
    cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'crash.db'}", "trainer.max_epochs=1")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    plan = plan_cv(CvRunSettings.from_config(cfg), client, cfg.mlflow.tracking_uri)
    # fold 1 finds a damaged epoch checkpoint in its work folder and crashes when it tries to continue from it
    damaged = plan.work_dir / "fold_1" / "last.ckpt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match=r"fold\(s\) 1 failed"):
        run_cv(cfg)
    children = children_of(client, plan.parent_run_id)
    status = {(c.data.tags["fold"], c.info.status) for c in children}
    assert status == {("0", "FINISHED"), ("1", "FAILED")}
    failed = next(c for c in children if c.info.status == "FAILED")
    assert "Traceback" in Path(client.download_artifacts(failed.info.run_id, "traceback.txt")).read_text()
    assert client.get_run(plan.parent_run_id).info.status == "FAILED"

    damaged.unlink()
    capsys.readouterr()
    run_cv(cfg)
    assert "1 fold(s) already done" in capsys.readouterr().out
    children = children_of(client, plan.parent_run_id)
    assert sorted((c.data.tags["fold"], c.info.status) for c in children) == [
        ("0", "FINISHED"), ("1", "FAILED"), ("1", "FINISHED")]
    assert client.get_run(plan.parent_run_id).info.status == "FINISHED"


def test_a_second_driver_with_the_same_identity_refuses(tiny_config) -> None:
    cfg = tiny_config(*FAST)
    store = cfg.mlflow.tracking_uri

    def key(config, uri: str = store) -> str:
        return run_key(CvConfig.from_config(config), uri)

    with identity_lock(resolve_path(cfg.cv.work_dir), key(cfg), "the first driver"):
        with pytest.raises(SystemExit, match=f"already running: pid {os.getpid()}, the first driver, since "):
            run_cv(cfg)
    assert key(cfg) != key(tiny_config(*FAST, "model.finetune=frozen"))  # another strategy
    assert key(cfg) != key(cfg, "sqlite:///elsewhere.db")  # another store
    assert key(cfg) == key(tiny_config(*FAST, "launcher=parallel", "cv.lease_s=9"))


def test_an_unknown_launcher_key_is_an_error(tiny_config) -> None:
    with pytest.raises(Exception, match="partition"):
        tiny_config(*FAST, "launcher.partition=gpu")  # a slurm key, with the local launcher


def test_slurm_launcher_refuses_what_cannot_work(tiny_config, tmp_path: Path, monkeypatch) -> None:
    from pipeline.runs.orchestration.launchers import check_launcher

    cfg = tiny_config(*FAST, "launcher=slurm")
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without SLURM
    with pytest.raises(SystemExit, match="sbatch"):
        check_launcher(cfg.launcher.name, "http://127.0.0.1:5000")
    (tmp_path / "sbatch").write_text("#!/bin/sh\n")
    (tmp_path / "sbatch").chmod(0o755)
    with pytest.raises(SystemExit, match="tracking server that the compute nodes reach"):
        check_launcher(cfg.launcher.name, cfg.mlflow.tracking_uri)  # sqlite
    with pytest.raises(SystemExit, match="does not answer"):  # asked once before anything is submitted
        check_launcher(cfg.launcher.name, "http://login-node.invalid:5000")
    with pytest.raises(SystemExit, match="MLFLOW_TRACKING_USERNAME"):  # credentials in the URI: into job files
        check_launcher(cfg.launcher.name, "http://user:secret@login-node.invalid:5000")


def test_several_seeds_give_one_child_per_fold_and_seed_and_resume_exactly(tiny_config, tmp_path: Path,
                                                                              capsys) -> None:
    cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'seeds.db'}", "trainer.folds=[0]",
                      "trainer.max_epochs=1", "cv.seeds=[0,1]")
    summary = run_cv(cfg)
    assert "2 training seeds each" in capsys.readouterr().out
    client = MlflowClient(cfg.mlflow.tracking_uri)
    plan = plan_cv(CvRunSettings.from_config(cfg), client, cfg.mlflow.tracking_uri)
    children = children_of(client, plan.parent_run_id)
    assert sorted((c.data.tags["fold"], c.data.tags["seed"]) for c in children) == [("0", "0"), ("0", "1")]
    values = sorted(c.data.metrics["test/frame_accuracy"] for c in children)
    assert summary["seeds/frame_accuracy_std"] == pytest.approx(np.std(values, ddof=1))
    assert summary["cv/frame_accuracy_mean"] == pytest.approx(np.mean(values))
    # the confusion counts are the calls as made (each fold's decision), one seed at a time, fold by fold
    counts = pd.read_csv(client.download_artifacts(plan.parent_run_id, "confusion_video_pooled.csv"))
    assert sorted(counts.seed.unique()) == [0, 1]
    for child in children:
        seed = int(child.data.tags["seed"])
        videos = pd.read_csv(client.download_artifacts(child.info.run_id, "predictions_videos.csv"))
        classes = ["BL1", "PA4"]
        expected = {(classes[t], classes[c]): int(((videos.label == t) & (videos.decision == c)).sum())
                    for t in (0, 1) for c in (0, 1)}
        got = {(r.true, r.called): r.videos for r in counts[counts.seed == seed].itertuples()}
        assert got == expected and sum(got.values()) == len(videos)
        per_subject = pd.read_csv(client.download_artifacts(child.info.run_id, "accuracy_per_subject.csv"))
        by_hand = (videos.decision == videos.label).groupby(videos.subject_name).mean()
        assert per_subject.set_index("subject_name").accuracy.to_dict() == pytest.approx(by_hand.to_dict())
    first, second = (pd.read_csv(client.download_artifacts(c.info.run_id, "predictions_videos.csv")) for c in children)
    assert not first.equals(second)  # each child trained with its own seed, not the config's
    # seed 1's child lost: the plan resumes exactly that (fold, seed), never seed 0's again
    lost = next(c for c in children if c.data.tags["seed"] == "1")
    client.set_terminated(lost.info.run_id, "FAILED")
    client.set_terminated(plan.parent_run_id, "FAILED")
    again = plan_cv(CvRunSettings.from_config(cfg), client, cfg.mlflow.tracking_uri)
    assert again.parent_run_id == plan.parent_run_id and again.done == [(0, 0)]
    assert again.pending(0) == [] and again.pending(1) == [0]
    # one seed only is another cross-validation (cv.seeds is part of its identity)
    single_cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'seeds.db'}", "trainer.folds=[0]",
                             "trainer.max_epochs=1")
    single = plan_cv(CvRunSettings.from_config(single_cfg), client, cfg.mlflow.tracking_uri)
    assert single.parent_run_id != plan.parent_run_id and single.seeds == [None]


@pytest.mark.slow
def test_the_three_default_cvs_then_compare_need_no_args(tiny_config, tmp_path: Path, capsys) -> None:
    """The mission's own path: `make cv MODEL=vit_b16`, `MODEL=cvt_13`, `MODEL=mobilevit_s` with their defaults, then
    `make compare` with no ARGS, is not refused (tiny: the tiny twin's one hold-out fold, one epoch, a store of its
    own)."""
    store = ("protocol=holdout", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
             f"mlflow.artifact_root={tmp_path / 'art'}", f"cv.work_dir={tmp_path / 'runs'}", "trainer.max_epochs=1",
             "cv.log_models=false", "loader.num_workers=0")
    for model in ("vit_b16", "cvt_13", "mobilevit_s"):
        run_cv(tiny_config(f"model={model}", *store))
    result = run_compare(tiny_config(*store))
    assert set(result["parent_run_ids"]) == {"vit_b16", "cvt_13", "mobilevit_s"}
    assert result["differences"] == [] and all(result["complete"].values())
    out = capsys.readouterr().out
    assert "compared although" not in out
    # one test a pair in the corrected family, the primary metric's; a hold-out's one fold: subjects are the units
    assert "Holm over 3 test(s): the primary metric accuracy_at_threshold" in out
    assert result["subjects_paired"]["unit"].str.startswith("subject (one fold").all()
    # the comparison reads in the UI: its description holds the pairs' table, its metrics each pair's figures
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result["run_id"])
    assert "| pair (a - b) | metric | difference [95 % CI] |" in run.data.tags[tracking.NOTE_TAG]
    for row in result["subjects_paired"][result["subjects_paired"]["primary"]].itertuples():
        assert run.data.metrics[f"{row.model_a}-{row.model_b}/diff"] == float(f"{row.mean_diff:.4g}")
        assert run.data.metrics[f"{row.model_a}-{row.model_b}/p_holm"] == float(f"{row.p_holm:.4g}")


def test_a_finished_fold_whose_artifacts_are_gone_is_trained_again(tiny_config, tmp_path: Path, capsys) -> None:
    """Each finished fold run holds a record of what it stored, read back (size and SHA-256) before it was marked
    FINISHED, and the CV's work folders go once it is FINISHED. A fold's artifacts then deleted from the artifact
    store: the next `make cv` of the finished CV marks that run FAILED with the reason, trains the fold again (the
    other is left alone) and ends with the same fold and CV metrics as before."""
    import hashlib
    import json
    import shutil

    from pipeline.runs.jobs.sealing import local_artifact_folder

    cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'lost.db'}",
                      f"mlflow.artifact_root={tmp_path / 'art'}", f"cv.work_dir={tmp_path / 'runs'}",
                      "trainer.max_epochs=1")
    first = run_cv(cfg)
    client, (parent,) = runs_of(cfg, "cv")
    assert not list((tmp_path / "runs").glob("*/*/fold_*/"))  # the fold work folders went with the FINISHED CV
    children = {c.data.tags["fold"]: c for c in children_of(client, parent.info.run_id)}
    for child in children.values():
        record = json.loads(child.data.tags["painvit.stored_artifacts"])
        assert sorted(record) == ["model/model.pt", "predictions_frames.csv", "predictions_videos.csv"]
        for name, facts in record.items():
            stored = Path(client.download_artifacts(child.info.run_id, name, str(tmp_path / child.info.run_id)))
            assert facts == {"size": stored.stat().st_size, "sha256": hashlib.sha256(stored.read_bytes()).hexdigest()}

    lost = children["1"]
    shutil.rmtree(local_artifact_folder(lost.info.artifact_uri))  # deleted from the artifact store
    capsys.readouterr()
    second = run_cv(cfg)
    out = capsys.readouterr().out
    assert "already finished" not in out and "1 fold(s) already done" in out
    after = children_of(client, parent.info.run_id)
    assert sorted((c.data.tags["fold"], c.info.status) for c in after) == [
        ("0", "FINISHED"), ("1", "FAILED"), ("1", "FINISHED")]
    failed = client.get_run(lost.info.run_id)
    assert failed.info.status == "FAILED" and "predictions_frames.csv is missing" in failed.data.tags[
        "painvit.failed_reason"]
    (again,) = [c for c in after if c.data.tags["fold"] == "1" and c.info.status == "FINISHED"]
    assert "painvit.resumed_after_epoch" not in again.data.tags  # trained from the start: its work folder was gone

    def tested(run) -> dict[str, float]:
        return {k: v for k, v in run.data.metrics.items() if k.startswith("test/")}

    assert tested(again) == pytest.approx(tested(lost), nan_ok=True)
    assert second == pytest.approx(first, nan_ok=True)
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
