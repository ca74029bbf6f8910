"""Clip models trained end to end on the tiny twin: the backbone runs on every frame of a clip and trains through the
temporal head; one prediction per video; the kept model is the clip model; a frozen backbone is refused here."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from pipeline.data.datamodule import SubjectRoles
from pipeline.models.embedding_cache import state_dict_sha256
from pipeline.models.model_file import load_model_file
from pipeline.models.temporal_heads import ClipNet
from pipeline.runs.jobs.fold_job import build_fold, train_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store.tracking import get_or_create_experiment
from pipeline.utils.paths import resolve_path
from tests.conftest import planned, training_of
from tests.test_two_stage import FAST

END_TO_END = (*FAST, "model.head.mode=end_to_end", "loader.batch_size=4", "trainer.limit_train_batches=2")


def test_an_end_to_end_fold_trains_the_backbone_through_the_head_and_keeps_the_clip_model(tiny_config,
                                                                                        tmp_path: Path) -> None:
    cfg = tiny_config(*END_TO_END, "model.head.name=attention", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}")
    decisions = planned(cfg)
    built = build_fold(*training_of(cfg), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0), decisions)
    module, datamodule = built.module, built.datamodule
    clips, labels, videos = next(iter(datamodule.train_dataloader()))
    assert clips.shape == (4, 3, 3, 32, 32) and labels.shape == videos.shape == (4,)  # (B, T, C, H, W) per video
    table = datamodule.prediction_rows("test")
    assert len(table) == table["sample_name"].nunique() == datamodule.frames("test")["sample_name"].nunique()

    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    with mlflow.start_run(experiment_id=get_or_create_experiment("e2e", Path(cfg.mlflow.artifact_root))) as run:
        result = train_fold(TrainingSettings.from_config(cfg), 0, decisions, tmp_path / "fold_0", keep_model=True)
    stored = MlflowClient(cfg.mlflow.tracking_uri).get_run(run.info.run_id).data
    assert stored.params["head"] == "attention_h16_end_to_end" and int(stored.params["head_parameters"]) > 0
    assert int(stored.params["parameters_trainable"]) == int(stored.params["parameters_total"])  # all of it trains
    assert "time/fit_s" in stored.metrics and "time/second_stage_s" not in stored.metrics
    videos_scored = result.video_predictions
    assert len(videos_scored) == videos_scored["sample_name"].nunique() == len(table)  # one call per video
    kept, meta = load_model_file(run.info.run_id, cfg.mlflow.tracking_uri)
    assert isinstance(kept, ClipNet) and meta["head"]["mode"] == "end_to_end" and meta["loader"]["clip_frames"] == 3
    # the backbone trained through the head: its weights are no longer those the fold built it with (the untrained
    # module above, built the same way)
    assert state_dict_sha256(kept.backbone) != state_dict_sha256(module.model.backbone)
    with torch.no_grad():
        assert kept(clips).shape == (4, 2)


def test_end_to_end_refuses_a_frozen_backbone_and_says_what_to_use(tiny_config, tmp_path: Path) -> None:
    cfg = tiny_config(*END_TO_END, "model.head.name=gru", "model.finetune=frozen",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}")
    with pytest.raises(ValueError, match="model.head.mode=two_stage"):
        build_fold(*training_of(cfg), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                   planned(cfg))
    with pytest.raises(ValueError, match="model.head.mode=two_stage"):  # make cv: before any run is created
        run_cv(cfg)
    experiment = MlflowClient(cfg.mlflow.tracking_uri).get_experiment_by_name(cfg.mlflow.experiment)
    assert experiment is None or not MlflowClient(cfg.mlflow.tracking_uri).search_runs([experiment.experiment_id])
