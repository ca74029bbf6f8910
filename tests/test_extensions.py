"""The extension points are registries the rest of the code asks (issue 44, item 2): a head mode, a threshold rule and
a backbone family defined here, in tests/ alone, with no line of pipeline/ changed, run a tiny cross-validation end to
end; Grad-CAM, the shape trace and the device settings ask the family's adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from torch import nn

from pipeline.analysis.gradcam import gradcam_layer
from pipeline.evaluation.thresholds import THRESHOLD_RULES, ThresholdRule, choose_threshold, register_rule
from pipeline.models.backbone_adapter import (
    ADAPTERS,
    FAMILIES,
    Backbone,
    BackboneAdapter,
    CamSpec,
    DataConfig,
    family_traits,
    register_adapter,
)
from pipeline.models.backbones import model_family
from pipeline.models.cost import shape_trace
from pipeline.models.factory import create_model
from pipeline.models.fold_result import FoldResult
from pipeline.runs.jobs.head_modes import HEAD_MODES, BuiltFold, TwoStageHead, register_head_mode
from pipeline.runs.jobs.step_times import StepTimes
from pipeline.runs.jobs.two_stage import RECORD, second_stage
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store import tracking
from pipeline.utils.devices import FamilyTraits, device_settings
from tests.test_cv import FAST
from tests.test_probe_training import store

MIDRANGE = "midrange_for_a_test"
AS_BUILT = "as_built_for_a_test"
TOY, TOY_FAMILY = "toy_net_for_a_test", "toy_family_for_a_test"


def midrange(labels: np.ndarray, scores: np.ndarray, n_subjects: int) -> float:
    """Halfway between the lowest and the highest validation score."""
    return float((scores.min() + scores.max()) / 2)


class HeadOnTheBackboneAsBuilt(TwoStageHead):
    """A temporal head on the backbone's embeddings as built (its pretrained weights): no frame model trains, whatever
    the strategy; the second stage alone."""

    name = AS_BUILT

    def train(self, cfg, built: BuiltFold, work_dir: Path, precision: str, callbacks: Sequence,
              scored: Sequence[str], times: StepTimes) -> FoldResult:
        with times("second_stage"):
            return second_stage(cfg, built.datamodule.fold, built.module, built.datamodule,
                                FoldResult(built.datamodule.fold), work_dir)


class ToyBackbone(Backbone):
    """A backbone family of one strided convolution: features of width 8, averaged over the image."""

    family = TOY_FAMILY

    def __init__(self, name: str, img_size: int | None) -> None:
        size = img_size or 32
        super().__init__(name, "one 3x3 convolution", 8,
                         DataConfig((3, size, size), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bilinear", 1.0))
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)

    def forward(self, images):
        return self.conv(images).mean(dim=(2, 3))

    def parameter_groups(self):
        return [("conv", list(self.conv.parameters()))]

    def cam_layers(self) -> list[CamSpec]:
        return [CamSpec("conv", self.conv, None)]

    def trace_patterns(self) -> tuple[tuple[str, str], ...]:
        return ((r"conv", "feature map"),)


@pytest.fixture
def extended() -> Iterator[None]:
    """The test's rule, mode and backbone family, registered for the test only."""
    register_rule(ThresholdRule(MIDRANGE, midrange, measured=False))
    register_head_mode(HeadOnTheBackboneAsBuilt)
    register_adapter(BackboneAdapter("toy", lambda name: name == TOY, lambda name: (None, ()),
                                     lambda name, weights, img_size: ToyBackbone(name, img_size), names=(TOY,)),
                     {TOY_FAMILY: FamilyTraits(bf16_on_cpu=False, channels_last_on_gpu=True)})
    try:
        yield
    finally:
        THRESHOLD_RULES.pop(MIDRANGE)
        HEAD_MODES.pop(AS_BUILT)
        ADAPTERS.pop("toy")
        FAMILIES.pop(TOY_FAMILY)


def test_a_head_mode_a_threshold_rule_and_a_backbone_family_from_tests_run_a_cross_validation(
        extended, tiny_config, tmp_path: Path) -> None:
    fast = [override for override in FAST if not override.startswith("model=")]
    cfg = tiny_config(*fast, f"model={TOY}", "trainer.folds=[0]", f"eval.threshold={MIDRANGE}", "model.head.name=gru",
                      f"model.head.mode={AS_BUILT}", "model.head.hidden=8", "model.head.epochs=3",
                      "model.head.patience=2", "loader.clip_frames=3", "cv.log_models=false",
                      *store(tmp_path))
    summary = run_cv(cfg)
    assert "pooled/video_auroc" in summary
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.CV_RUN}'")
    assert parent.data.tags[tracking.HEAD_TAG] == f"gru_h8x1_{AS_BUILT}"
    assert parent.data.tags[tracking.MODEL_FAMILY_TAG] == TOY_FAMILY and parent.data.metrics["cost/params"] > 0
    fold = tracking.finished_fold_runs(client, parent.info.run_id)[0]
    assert fold.data.tags[tracking.THRESHOLD_RULE_TAG] == MIDRANGE
    # the mode's own training: no frame model trained (no epoch of it), its head on the backbone as built
    record = json.loads(Path(client.download_artifacts(fold.info.run_id, f"{RECORD}")).read_text())
    assert record["frame_model"] == "frozen, as built" and record["frame_model_trained_on"] == []
    assert "frame_model/test/video_auroc" not in fold.data.metrics
    # the rule's threshold, chosen on the fold's validation videos
    validation = pd.read_csv(client.download_artifacts(fold.info.run_id, "predictions_videos_val.csv"))
    labels, scores = (validation["label"] != 0).astype(int).to_numpy(), validation["prob_PA4"].to_numpy()
    expected = choose_threshold(labels, scores, MIDRANGE)
    assert fold.data.metrics["test/threshold"] == pytest.approx(expected.threshold)
    assert expected.fallback or expected.threshold == pytest.approx(midrange(labels, scores, 0))


def test_an_unknown_name_is_refused_with_the_registered_ones(extended) -> None:
    with pytest.raises(ValueError, match=f"eval.threshold='no_such_rule': expected one of youden, .*{MIDRANGE}"):
        choose_threshold(np.array([0, 1]), np.array([0.2, 0.8]), "no_such_rule")
    with pytest.raises(ValueError, match="exists already"):
        register_rule(ThresholdRule(MIDRANGE, midrange))
    with pytest.raises(ValueError, match="exists already"):
        register_head_mode(HeadOnTheBackboneAsBuilt)


def test_what_a_backbone_family_is_asked_comes_from_its_adapter(extended) -> None:
    net, _ = create_model(TOY, 2, pretrained=False, img_size=32)
    assert isinstance(net.backbone, ToyBackbone) and model_family(TOY, 32) == TOY_FAMILY
    assert gradcam_layer(net, 32).name == "conv"  # the adapter's layer: a 16 x 16 map
    assert ("conv", "feature map", (1, 8, 16, 16)) in shape_trace(net, 32, 1)
    on_a_gpu = device_settings("auto", "auto", family_traits(TOY_FAMILY), "cuda", gpu_bf16=True)
    assert on_a_gpu.channels_last and on_a_gpu.precision == "bf16-mixed"
    assert device_settings("auto", "auto", family_traits(TOY_FAMILY), "cpu", cpu_bf16=True).precision == "32-true"
