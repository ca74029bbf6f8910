"""A frozen backbone's linear probe fitted in memory (`model.head.fit=in_memory`, pipeline/models/probe_training.py):
the same recipe as the Lightning fit, so a CV's every fold metric, epoch curve and kept model are the Lightning fit's;
fit callbacks (a lease check, a trial's pruning) still stop it; and what it cannot fit is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from pipeline.data.datamodule import SubjectRoles
from pipeline.models.model_file import MODEL_ARTIFACT, load_model_file
from pipeline.models.probe_training import EpochState
from pipeline.runs.jobs.fold_decisions import settings_here
from pipeline.runs.jobs.fold_job import build_fold, train
from pipeline.runs.jobs.head_modes import head_mode
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.paths import resolve_path
from tests.conftest import head_config, planned, training_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# two folds of a frozen probe with two augmented views a crop (the draw of a view per crop and epoch is exercised)
FROZEN = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "model.finetune=frozen",
          "loader.num_workers=0", "loader.batch_size=8", "trainer.max_epochs=6", "trainer.patience=2",
          "trainer.folds=[0,1]", "augment=light", "cache.views=2", "seed=3")


def store(base: Path) -> tuple[str, ...]:
    return (f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}", f"mlflow.artifact_root={base / 'art'}",
            f"cv.work_dir={base / 'runs'}")


def fold_runs(cfg) -> dict[int, object]:
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(cfg))
    return {int(run.data.tags[tracking.FOLD_TAG]): run for run in tracking.fold_runs(client, parent.info.run_id)}


def test_the_in_memory_fit_scores_logs_and_keeps_what_the_lightning_fit_does(tiny_config, tmp_path: Path) -> None:
    configs = {fit: tiny_config(*FROZEN, *store(tmp_path / fit), f"model.head.fit={fit}")
               for fit in ("lightning", "in_memory")}
    runs = {}
    for fit, cfg in configs.items():
        run_cv(cfg)
        runs[fit] = fold_runs(cfg)
    assert sorted(runs["lightning"]) == sorted(runs["in_memory"]) == [0, 1]
    for fold, lightning in runs["lightning"].items():
        in_memory = runs["in_memory"][fold]
        scores = {k: v for k, v in lightning.data.metrics.items() if k.startswith(("test/", "best_", "epochs_"))}
        assert len(scores) > 20 and scores["epochs_trained"] >= 2
        for name, value in scores.items():
            assert in_memory.data.metrics[name] == pytest.approx(value, abs=1e-6, nan_ok=True), (fold, name)
        # every epoch's validation score on the run, step = epoch, as the Lightning fit logs them
        histories = {fit: [(m.step, m.value) for m in MlflowClient(configs[fit].mlflow.tracking_uri)
                           .get_metric_history(run.info.run_id, "val/video_auroc")]
                     for fit, run in (("lightning", lightning), ("in_memory", in_memory))}
        assert len(histories["in_memory"]) == scores["epochs_trained"]
        (steps, values), (lightning_steps, lightning_values) = (zip(*sorted(histories[fit]), strict=True)
                                                              for fit in ("in_memory", "lightning"))
        assert steps == lightning_steps and values == pytest.approx(lightning_values, abs=1e-6)
        # the kept models: the same head weights, from the best epoch
        heads = []
        for fit, run in (("lightning", lightning), ("in_memory", in_memory)):
            client = MlflowClient(configs[fit].mlflow.tracking_uri)
            net, meta = load_model_file(client.download_artifacts(run.info.run_id, MODEL_ARTIFACT))
            assert meta["best_epoch"] == int(scores["best_epoch"])
            heads.append(net.head.state_dict())
        for name, weight in heads[0].items():
            torch.testing.assert_close(heads[1][name], weight, atol=1e-6, rtol=0)


class StopAfter:
    """A fit callback on the API the project's own use (`StopWhenLeaseLost`, `ReportToTrial`): counts the epochs it
    saw begin and asks the fit to stop after `epochs`."""

    def __init__(self, epochs: int) -> None:
        self.epochs, self.started, self.scores = epochs, 0, []

    def on_train_batch_start(self, trainer: EpochState, module, batch, batch_idx: int) -> None:
        self.started += 1

    def on_train_epoch_end(self, trainer: EpochState, module) -> None:
        self.scores.append(float(trainer.callback_metrics["val/video_auroc"]))
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def test_a_callback_sees_each_epoch_and_stops_the_fit(tiny_config, tmp_path: Path) -> None:
    cfg = tiny_config(*FROZEN, *store(tmp_path), "model.head.fit=in_memory", "trainer.patience=50")
    run_cv(tiny_config(*FROZEN, *store(tmp_path), "model.head.fit=in_memory", "trainer.folds=[0]",
                       "trainer.max_epochs=1"))  # prepares the fold file and builds the embedding cache
    decisions = planned(cfg)
    stop = StopAfter(2)
    settings = settings_here(decisions, cfg.trainer.channels_last, cfg.trainer.accelerator)
    built = build_fold(*training_of(cfg), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0), decisions, settings)
    trained = train(TrainingSettings.from_config(cfg), built, tmp_path / "fold", settings, callbacks=[stop])
    assert stop.started == 2 and len(stop.scores) == 2 and len(trained.history) == 2
    assert trained.best_path is None and trained.validation is not None and trained.evaluation is not None
    assert stop.scores[trained.selected["best_epoch"]] == pytest.approx(trained.selected["best_val_score"])


@pytest.mark.parametrize("changes, message", [
    (("model.finetune=full",), "fits the linear head on a fixed backbone's cached embeddings"),
    (("model.finetune=frozen", "cache.embeddings=false"), "cache.embeddings=False"),
])
def test_what_the_in_memory_fit_cannot_fit_is_refused(tiny_config, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        WhatTrains.of(TrainingSettings.from_config(tiny_config("model=mobilevit_xxs", "model.head.fit=in_memory",
                                                                *changes))).check()


def test_a_temporal_head_or_an_unknown_fit_is_refused() -> None:
    base = {"name": "linear", "hidden": 8, "layers": 1, "attention_heads": 1, "dropout": 0.0, "max_frames": 8}
    with pytest.raises(ValueError, match="a temporal head \\(gru\\) on a fixed backbone trains in memory already"):
        head_mode(head_config(**{**base, "name": "gru", "fit": "in_memory"}))
    with pytest.raises(ValueError, match="model.head.fit='gpu': expected one of lightning, in_memory"):
        head_mode(head_config(**{**base, "fit": "gpu"}))
