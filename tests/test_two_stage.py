"""Two-stage clip training of a fold on the tiny twin: who embeds what (split files, cache keys), the head's scores,
the frozen probe over time, and the CV identity of a clip model."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from mlflow import MlflowClient

from pipeline.data.datamodule import LoaderConfig, PainDataModule, SubjectRoles
from pipeline.data.fold_files import fold_subjects, read_folds
from pipeline.data.tasks import get_task
from pipeline.models.embedding_cache import state_dict_sha256
from pipeline.models.factory import create_model
from pipeline.models.model_file import load_model_file
from pipeline.models.temporal_heads import ClipNet
from pipeline.runs.jobs.fold_job import train_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.store.cv_runs import CvConfig, config_sha256
from pipeline.runs.store.tracking import get_or_create_experiment
from pipeline.utils.paths import resolve_path
from tests.conftest import planned

FAST = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
        "loader.batch_size=8", "trainer.max_epochs=1", "trainer.limit_train_batches=1", "augment=light",
        "loader.clip_frames=3", "model.head.hidden=16", "model.head.epochs=5", "model.head.patience=2")


def two_stage_fold(cfg, fold: int, work_dir: Path, keep_model: bool = False) -> tuple[dict, dict, dict]:
    """train_fold in a fresh run of the test's store: the fold's metrics, params and its two_stage.json (and, with
    `keep_model`, the kept clip model reloaded as `record["model"]`)."""
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    experiment_id = get_or_create_experiment("two-stage-tests", Path(cfg.mlflow.artifact_root))
    with mlflow.start_run(experiment_id=experiment_id) as run:
        result = train_fold(TrainingSettings.from_config(cfg),
                            fold, planned(cfg), work_dir, keep_model=keep_model)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    record = json.loads(Path(client.download_artifacts(run.info.run_id, "two_stage.json")).read_text())
    if keep_model:
        record["model"] = load_model_file(run.info.run_id, cfg.mlflow.tracking_uri)
    stored = client.get_run(run.info.run_id).data
    assert len(result.video_predictions) == result.video_predictions["sample_name"].nunique()  # a score per video
    return stored.metrics, stored.params, record


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module's fold runs (created once: its tables take seconds)."""
    return f"mlflow.tracking_uri=sqlite:///{tmp_path_factory.mktemp('two_stage') / 'mlflow.db'}"


def test_two_stage_never_embeds_a_folds_test_subjects_with_a_model_that_trained_on_them(tiny_config, store,
                                                                                       tmp_path: Path) -> None:
    cfg = tiny_config(*FAST, "model.head.name=gru", store)
    fold = 1
    metrics, params, record = two_stage_fold(cfg, fold, tmp_path, keep_model=True)
    roles = fold_subjects(read_folds(resolve_path(cfg.fold_file)), fold)  # the fold file, as written
    # the frame model trained on the fold's training subjects only, and the cache entry's key says so
    assert record["frame_model"] == "fine-tuned in this fold"
    assert record["frame_model_trained_on"] == sorted(roles["train"])
    assert record["cache_key"] == {"weights_sha256": record["frame_model_weights_sha256"], "frame_model_fold": fold,
                                   "frame_model_trained_on": sorted(roles["train"])}
    assert not set(record["frame_model_trained_on"]) & set(roles["test"] + roles["val"])
    assert {role: set(names) for role, names in record["embedded"].items()} == {
        role: set(names) for role, names in roles.items()}
    # the entry lives in the fold's own folder (the fold job removes it with the folder), not in the shared cache
    assert (tmp_path / "embeddings" / record["cache_record"]).is_file()
    assert not (resolve_path(cfg.data.processed_dir) / "embeddings" / record["cache_record"]).exists()
    # the head's test scores are the fold's; the frame model's stay beside them
    assert np.isfinite(metrics["test/video_accuracy_at_threshold"])
    assert "frame_model/test/video_auroc" in metrics and "time/second_stage_s" in metrics
    assert params["head"] == "gru_h16x1_two_stage" and int(params["head_parameters"]) > 0
    # the same backbone as built (what a frozen probe embeds with) has other weights: the fine-tuned model embedded
    net, _ = create_model(cfg.model.name, n_classes=2, pretrained=False, img_size=cfg.model.img_size)
    assert state_dict_sha256(net.backbone) != record["frame_model_weights_sha256"]
    # the fold's kept model is the clip model: the embedding backbone and the trained head
    kept, meta = record["model"]
    assert isinstance(kept, ClipNet) and meta["head"]["name"] == "gru" and meta["loader"]["clip_frames"] == 3
    assert state_dict_sha256(kept.backbone) == record["frame_model_weights_sha256"]
    # and the seconds between its training clips' crops, which predict spaces its windows by
    assert meta["loader"]["clip_spacing_s"] > 0


def test_a_frozen_backbone_skips_the_first_stage_and_shares_the_cache(tiny_config, store, tmp_path: Path) -> None:
    cfg = tiny_config(*FAST, "model.head.name=attention", "model.finetune=frozen", store)
    metrics, params, record = two_stage_fold(cfg, 0, tmp_path / "fold0")
    assert "time/fit_s" not in metrics and "frame_model/test/video_auroc" not in metrics
    assert record["frame_model_trained_on"] == [] and record["frame_model"] == "frozen, as built"
    entry = resolve_path(cfg.data.processed_dir) / "embeddings" / record["cache_record"]
    assert json.loads(entry.read_text())["key"]["weights_sha256"] == record["frame_model_weights_sha256"]
    assert params["head"] == "attention_h16_two_stage" and np.isfinite(metrics["test/video_auroc"])


def test_the_cv_identity_holds_the_head_and_keeps_older_frame_cvs(tiny_config) -> None:
    def identity(*overrides: str) -> str:
        return config_sha256(CvConfig.from_config(tiny_config(*FAST, *overrides)))

    linear = identity()
    assert linear == identity("loader.clip_frames=5", "model.head.hidden=8")
    assert len({linear, identity("model.head.name=gru"), identity("model.head.name=transformer"),
                identity("model.head.name=gru", "model.head.mode=end_to_end")}) == 4


def test_a_two_stage_lora_folds_kept_model_loads_and_scores_as_in_the_fold(tiny_config, store, tmp_path: Path) -> None:
    """The kept clip model of a LoRA frame model holds the backbone with its adapters merged (as a kept frame model
    does): it loads (`load_model_file`) and scores the fold's test videos as the fold did."""
    cfg = tiny_config(*FAST, "model.head.name=gru", "model.finetune=lora", store)
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    with mlflow.start_run(experiment_id=get_or_create_experiment("two-stage-tests", Path(cfg.mlflow.artifact_root))):
        result = train_fold(TrainingSettings.from_config(cfg),
                            0, planned(cfg), tmp_path, keep_model=True)
        run_id = mlflow.active_run().info.run_id
    kept, meta = load_model_file(run_id, cfg.mlflow.tracking_uri)
    assert isinstance(kept, ClipNet) and meta["finetune"] == "lora_r8" and meta["head"]["mode"] == "two_stage"
    assert not any("lora_" in name for name in kept.state_dict())  # merged: a plain backbone
    # the fold's test clips as images (the evaluation transform, the clip's crops in time order), through the kept model
    data = PainDataModule(resolve_path(cfg.data.processed_dir), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                          get_task(cfg.task.name), kept.backbone.data_config, {}, LoaderConfig.from_config(cfg.loader),
                          cfg.seed, clips=True)
    data.setup()
    rows = data.prediction_rows("test")
    with torch.no_grad():
        scored = torch.cat([torch.softmax(kept(clips), dim=1) for clips, _, _ in data.test_dataloader()]).numpy()
    fold = result.video_predictions.set_index(["subject_name", "sample_name"])
    expected = fold.loc[list(zip(rows["subject_name"], rows["sample_name"], strict=True)), ["prob_BL1", "prob_PA4"]]
    np.testing.assert_allclose(scored, expected.to_numpy(), atol=1e-5)
    # and the adapters are in it: the merged attention weights are not the ones the fold's backbone started from
    pl.seed_everything(cfg.seed, workers=True, verbose=False)  # as build_fold seeds the network it builds
    start, _ = create_model(cfg.model.name, n_classes=2, pretrained=False, img_size=cfg.model.img_size)
    started = start.backbone.state_dict()
    attention = [name for name in kept.backbone.state_dict() if name.endswith("attn.qkv.weight")]
    assert attention and any(not torch.equal(kept.backbone.state_dict()[name], started[name]) for name in attention)
