"""Ordinal and regression outputs (pipeline/models/ordinal.py): CORAL's thresholds stay ordered on random and on
trained weights, the losses are the papers' sums of binary cross-entropies, decoding gives level probabilities that
are a distribution, graded tasks are BioVid's levels in order, the config group leaves a default run untouched, and
an ordinal model exports to ONNX with the same level probabilities."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pipeline.data.tasks import TASKS, Task, graded_levels
from pipeline.models.ordinal import (
    CoralHead,
    CornHead,
    LevelProbabilities,
    OrdinalHead,
    OutputConfig,
    RegressionHead,
    build_output_head,
    output_probabilities,
    task_levels,
)
from pipeline.runs.store.cv_runs import CvConfig, identity_config
from pipeline.utils.config import CONFIG_DIR, load_config
from tests.conftest import head_config

K = 5


def _randomise(head: nn.Module, scale: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def _assert_distribution(head: OrdinalHead, features: torch.Tensor) -> None:
    logits = head(features)
    cumulative = head.cumulative(logits)
    assert (cumulative[:, 1:] <= cumulative[:, :-1]).all(), "P(level > k) rose with k"
    probs = head.level_probabilities(logits)
    assert probs.shape == (len(features), head.n_levels)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(features)))


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_coral_biases_are_ordered_and_its_level_probabilities_a_distribution_on_random_weights(scale: float) -> None:
    for seed in range(20):
        head = CoralHead(6, K)
        _randomise(head, scale, seed)  # any value of every parameter, steps included
        biases = head.biases()
        assert (biases[1:] < biases[:-1]).all() or scale == 30.0 and (biases[1:] <= biases[:-1]).all(), biases
        _assert_distribution(head, torch.randn(64, 6) * scale)


def _toy(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features whose first coordinate grows with the level, plus noise dimensions."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, K, (n,), generator=generator)
    features = torch.randn(n, 4, generator=generator) * 0.3
    features[:, 0] += levels.float()
    return features, levels


@pytest.mark.parametrize("head_class", [CoralHead, CornHead])
def test_a_trained_ordinal_head_keeps_ordered_thresholds_and_learns_the_levels(head_class: type[OrdinalHead]) -> None:
    torch.manual_seed(0)
    features, levels = _toy(400, 0)
    head = head_class(4, K)
    optimiser = torch.optim.Adam(head.parameters(), lr=0.05)
    first = head.loss(head(features), levels).item()
    for _ in range(300):
        optimiser.zero_grad()
        loss = head.loss(head(features), levels)
        loss.backward()
        optimiser.step()
    assert loss.item() < first / 3
    if isinstance(head, CoralHead):
        biases = head.biases().detach()
        assert (biases[1:] < biases[:-1]).all(), biases
    with torch.no_grad():
        test_features, test_levels = _toy(400, 1)
        _assert_distribution(head, test_features)
        predicted = head.predicted_level(head(test_features))
    assert (predicted - test_levels).abs().float().mean() < 0.3  # MAE over levels of a learnt toy


def test_coral_loss_is_the_sum_of_the_k_minus_1_binary_cross_entropies() -> None:
    torch.manual_seed(1)
    head = CoralHead(3, K)
    _randomise(head, 1.0, 1)
    features, levels = torch.randn(10, 3), torch.randint(0, K, (10,))
    logits = head(features).detach().double().numpy()
    p = 1 / (1 + np.exp(-logits))
    y = (levels.numpy()[:, None] > np.arange(K - 1)).astype(float)
    expected = -(y * np.log(p) + (1 - y) * np.log(1 - p)).sum(axis=1).mean()
    assert float(head.loss(head(features), levels)) == pytest.approx(expected, rel=1e-5)


def test_corn_loss_trains_task_k_only_on_the_samples_of_level_k_or_more() -> None:
    torch.manual_seed(2)
    head = CornHead(3, K)
    features, levels = torch.randn(12, 3), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 0])
    logits = head(features).detach().double().numpy()
    total, count = 0.0, 0
    for k in range(K - 1):
        subset = levels.numpy() >= k
        p = 1 / (1 + np.exp(-logits[subset, k]))
        y = (levels.numpy()[subset] > k).astype(float)
        total += float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).sum())
        count += int(subset.sum())
    assert float(head.loss(head(features), levels)) == pytest.approx(total / count, rel=1e-5)
    # a sample of level 0 takes part in the first task only: its other logits do not move the loss
    only_zero = torch.zeros(1, K - 1, requires_grad=True)
    head.loss(only_zero, torch.tensor([0])).backward()
    assert only_zero.grad is not None and (only_zero.grad[0, 1:] == 0).all() and only_zero.grad[0, 0] != 0


def test_decoding_counts_the_thresholds_passed_and_pain_is_one_minus_p_bl1() -> None:
    head = CornHead(2, K)
    logits = torch.tensor([[5.0, 5.0, -5.0, -5.0], [-5.0, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    assert head.predicted_level(logits).tolist() == [2, 0, 4]  # the product rule: a failed task stops the count
    probs = head.level_probabilities(logits)
    torch.testing.assert_close(head.pain_probability(logits, 1), 1 - probs[:, 0])
    torch.testing.assert_close(head.pain_probability(logits, 3), probs[:, 3:].sum(dim=1))
    with pytest.raises(ValueError, match="pain level 5 outside 1..4"):
        head.pain_probability(logits, 5)
    coral = CoralHead(2, K)
    assert coral.predicted_level(torch.tensor([[1.0, 0.5, -0.1, -2.0]])).tolist() == [2]


def test_regression_decodes_to_the_rounded_clipped_level_and_a_monotone_pain_score() -> None:
    head = RegressionHead(2, K, "mse")
    outputs = torch.tensor([[-1.3], [0.4], [0.6], [2.5], [3.49], [9.0]])
    assert head.predicted_level(outputs).tolist() == [0, 0, 1, 2, 3, 4]
    scores = head.pain_probability(outputs, 1)
    assert (scores[1:] > scores[:-1]).all()
    assert float(head.pain_probability(torch.tensor([[0.5]]), 1)) == pytest.approx(0.5)
    levels = torch.tensor([0, 0, 1, 2, 3, 4])
    assert float(head.loss(outputs, levels)) == pytest.approx(float(((outputs[:, 0] - levels) ** 2).mean()))
    probs = head.level_probabilities(outputs)
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(outputs)))
    torch.testing.assert_close(head.pain_probability(outputs, 1), 1 - probs[:, 0])
    # the count of cut points passed is the rounded level (away from exact halves)
    assert ((head.cumulative(outputs) > 0.5).sum(dim=1) == head.predicted_level(outputs)).all()
    huber = RegressionHead(2, K, "huber", 1.0)
    assert float(huber.loss(torch.tensor([[3.0]]), torch.tensor([0]))) == pytest.approx(2.5)  # linear past delta


def test_graded_tasks_are_biovid_levels_in_order_and_others_are_refused_by_name() -> None:
    assert graded_levels(TASKS["five_class"]) == (0, 1, 2, 3, 4)
    assert graded_levels(TASKS["bl1_vs_pa4"]) == (0, 4)
    assert graded_levels(Task("pa1_to_pa4", ("PA1", "PA2", "PA3", "PA4"))) == (1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"task 'reversed' is not graded: its classes PA2, BL1 are not"):
        graded_levels(Task("reversed", ("PA2", "BL1")))
    with pytest.raises(ValueError, match="its classes NOPE are not BioVid levels"):
        graded_levels(Task("odd", ("BL1", "NOPE")))
    ordinal = OutputConfig.from_config({"name": "ordinal", "ordinal": "coral", "pain_level": 1})
    assert task_levels(TASKS["five_class"], ordinal) == 5
    with pytest.raises(ValueError, match="is not graded"):
        task_levels(Task("reversed", ("PA4", "PA1")), ordinal)
    assert task_levels(Task("reversed", ("PA4", "PA1")), OutputConfig.from_config(None)) == 2  # softmax: any task
    with pytest.raises(ValueError, match="pain_level=2 is not a level of task 'bl1_vs_pa4'"):
        task_levels(TASKS["bl1_vs_pa4"], OutputConfig("ordinal", "corn", pain_level=2))


def test_output_probabilities_are_the_softmax_of_a_linear_head_and_the_level_probabilities_of_the_others() -> None:
    features = torch.randn(4, 6)
    linear = nn.Linear(6, K)
    torch.testing.assert_close(output_probabilities(linear, linear(features)), linear(features).softmax(dim=1))
    for head in (CoralHead(6, K), CornHead(6, K), RegressionHead(6, K, "mse")):
        torch.testing.assert_close(output_probabilities(head, head(features)), head.level_probabilities(head(features)))


def test_the_output_group_composes_each_head_and_refuses_unknown_methods() -> None:
    for overrides, expected in (([], nn.Linear), (["model/output=ordinal"], CoralHead),
                                (["model/output=ordinal", "model.output.ordinal=corn"], CornHead),
                                (["model/output=regression"], RegressionHead)):
        cfg = load_config(["task=five_class", *overrides])
        config = OutputConfig.from_config(cfg.model.get("output"))
        head = build_output_head(config, 8, task_levels(TASKS[cfg.task.name], config))
        assert type(head) is expected
        assert head(torch.zeros(3, 8)).shape[0] == 3
    assert OutputConfig.from_config(load_config(["model/output=regression"]).model.output).label == "regression_huber"
    with pytest.raises(ValueError, match="model.output.ordinal='cumulative'"):
        OutputConfig.from_config(load_config(["model/output=ordinal", "model.output.ordinal=cumulative"]).model.output)


def _configs_without_the_new_groups(tmp_path: Path) -> Path:
    """configs/ as it was before model/output and personalise: the groups and their defaults entries removed."""
    copy = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, copy)
    shutil.rmtree(copy / "model" / "output")
    shutil.rmtree(copy / "personalise")
    config = copy / "config.yaml"
    lines = config.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.lstrip().startswith(("- model/output:", "- personalise:"))]
    assert len(kept) == len(lines) - 2
    config.write_text("".join(kept))
    return copy


@pytest.mark.parametrize("overrides", [[], ["model=mobilevit_s", "task=five_class", "protocol=loso"]])
def test_the_default_output_and_personalisation_leave_a_runs_identity_as_it_was(overrides: list[str],
                                                                               tmp_path: Path) -> None:
    composed_before = load_config(overrides, config_dir=_configs_without_the_new_groups(tmp_path))
    def identity(config) -> dict:
        return identity_config(CvConfig.from_config(config))

    before = identity(composed_before)
    assert OmegaConf.to_container(load_config(overrides)) == OmegaConf.to_container(composed_before)  # every key
    assert identity(load_config(overrides)) == before
    assert identity(load_config([*overrides, "model/output=softmax", "personalise=none"])) == before
    assert identity(load_config([*overrides, "model/output=ordinal"])) != before  # a setting of its own


@pytest.mark.parametrize("output", ["coral", "corn", "regression"])
def test_an_ordinal_model_exports_to_onnx_and_onnx_runtime_gives_its_level_probabilities(output: str,
                                                                                        tmp_path: Path) -> None:
    import onnxruntime

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    config = OutputConfig("regression", loss="mse") if output == "regression" else OutputConfig("ordinal", output)
    head = build_output_head(config, 8, K)
    _randomise(head, 1.0, 3)
    net = nn.Sequential(backbone, LevelProbabilities(head)).eval()
    path = tmp_path / "ordinal.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 32, 32),), str(path), input_names=["image"], output_names=["probs"],
                      dynamic_axes={"image": {0: "batch"}, "probs": {0: "batch"}}, opset_version=17, dynamo=False)
    images = torch.randn(4, 3, 32, 32)  # another batch size than the traced one
    with torch.no_grad():
        expected = net(images).numpy()
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(["probs"], {"image": images.numpy()})[0]
    assert got.shape == (4, K)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)


def test_a_backbones_pain_net_with_an_ordinal_head_goes_through_the_projects_export_unchanged(tmp_path: Path) -> None:
    """The factory's ordinal frame model exports with its level probabilities as the output (`level_probabilities`)."""
    from pipeline.deployment.export import export_onnx, onnx_difference, output_name
    from pipeline.models.factory import create_model

    torch.manual_seed(0)
    net, _ = create_model("mobilevit_xxs", n_classes=K, pretrained=False, img_size=32,
                          output=OutputConfig("ordinal", "corn", pain_level=1))
    assert isinstance(net.head, CornHead) and output_name(net) == "level_probabilities"
    path = export_onnx(net, 32, tmp_path / "corn.onnx")
    assert onnx_difference(net, path, 32, batch=3) < 1e-5
    import onnxruntime

    got = onnxruntime.InferenceSession(str(path)).run(["level_probabilities"],
                                                     {"image": np.zeros((2, 3, 32, 32), np.float32)})[0]
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)


def test_an_ordinal_module_trains_on_its_heads_loss_and_refuses_cross_entropy_settings() -> None:
    """The LightningModule's loss of an ordinal frame model is the head's (CORAL's summed binary cross-entropies),
    its evaluation probabilities the level probabilities; class weights and label smoothing (cross-entropy's) are
    refused by name, never silently ignored."""
    from pipeline.models.factory import create_model
    from pipeline.models.lightning_module import OptimConfig, PainLightningModule

    optim = OptimConfig(1e-3, 1e-4, 0.5, 0.0, 0.0, 0)
    output = OutputConfig("ordinal", "coral", pain_level=1)
    torch.manual_seed(0)
    net, _ = create_model("mobilevit_xxs", K, pretrained=False, img_size=32, output=output)
    module = PainLightningModule(net, TASKS["five_class"].classes, optim, aggregation="mean", topk=3)
    images, levels = torch.randn(3, 3, 32, 32), torch.tensor([0, 2, 4])
    logits = module(images)
    assert logits.shape == (3, K - 1)
    torch.testing.assert_close(module._loss(logits, levels), net.head.loss(logits, levels))
    for bad in ({"class_weights": [1.0] * K}, {"label_smoothing": 0.1}):
        with pytest.raises(ValueError, match="trainer.class_weights and trainer.label_smoothing .* CoralHead"):
            PainLightningModule(net, TASKS["five_class"].classes, optim, aggregation="mean", topk=3, **bad)


@pytest.mark.parametrize("name", ["gru", "attention", "transformer"])
def test_a_temporal_head_over_levels_trains_on_its_last_layers_loss_and_exports_its_level_probabilities(
        name: str, tmp_path: Path) -> None:
    """A clip model with an ordinal output: its temporal head ends in the ordinal layer (`ClipLevels`), the module's
    loss is that layer's over the clip's outputs, a step of training keeps CORAL's thresholds ordered, and its ONNX
    export gives the level probabilities."""
    from pipeline.deployment.export import export_onnx, onnx_difference, output_name
    from pipeline.models.factory import create_model
    from pipeline.models.head_training import head_loss
    from pipeline.models.lightning_module import OptimConfig, PainLightningModule
    from pipeline.models.temporal_heads import ClipLevels, ClipNet, build_temporal_head

    config = head_config(name=name, hidden=8, layers=1, attention_heads=2, dropout=0.0, max_frames=8)
    output = OutputConfig("ordinal", "coral", pain_level=1)
    linear = head_config(name="linear", hidden=8, layers=1, attention_heads=2, dropout=0.0, max_frames=8)
    per_frame = build_temporal_head(linear, 8, K, output)  # mean of per-frame outputs
    assert isinstance(per_frame, ClipLevels) and isinstance(per_frame.levels, CoralHead)
    _assert_distribution(per_frame, torch.randn(4, 3, 8))
    assert not isinstance(build_temporal_head(config, 8, K), ClipLevels)  # softmax: the plain head, as before
    torch.manual_seed(0)
    net, _ = create_model("mobilevit_xxs", K, pretrained=False, img_size=32, head=config, output=output)
    assert isinstance(net, ClipNet) and isinstance(net.head, ClipLevels) and isinstance(net.head.levels, CoralHead)
    module = PainLightningModule(net, TASKS["five_class"].classes, OptimConfig(1e-2, 1e-2, 0.5, 0.0, 0.0, 0),
                                 aggregation="mean", topk=3)
    clips, levels = torch.randn(3, 2, 3, 32, 32), torch.tensor([0, 2, 4])
    outputs = module(clips)
    assert outputs.shape == (3, K - 1)
    torch.testing.assert_close(module._loss(outputs, levels), net.head.levels.loss(outputs, levels))
    torch.testing.assert_close(head_loss(net.head, outputs, levels), net.head.levels.loss(outputs, levels))
    _assert_distribution(net.head, torch.randn(4, 2, net.backbone.num_features))
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    for _ in range(3):  # large steps: the biases stay ordered by construction
        optimizer.zero_grad()
        module._loss(module(clips), levels).backward()
        optimizer.step()
    assert (net.head.levels.biases()[1:] < net.head.levels.biases()[:-1]).all()
    torch.testing.assert_close(output_probabilities(net.head, net(clips)).sum(dim=1), torch.ones(3))
    assert output_name(net) == "level_probabilities"
    path = export_onnx(net, 32, tmp_path / f"{name}.onnx")
    assert onnx_difference(net, path, 32, batch=2, frames=3) < 1e-5
