"""One decoding rule for every output (`eval.decoding`, issue 43 item 5a): a softmax's class probabilities and an
ordinal head's level probabilities, decoded by the same rule, give the same levels where the probabilities are the
same; the rule is a CV's tag and label, and `make compare` refuses five-class CVs decoded by different rules."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from pipeline.analysis.comparison_runs import comparability_problems
from pipeline.evaluation.aggregation import DECODINGS, called_classes
from pipeline.evaluation.metrics import evaluate_predictions
from pipeline.models.ordinal import CoralHead, CornHead, output_probabilities
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import CvConfig, CvSettings, cv_label, decoding_of, identity_config
from pipeline.utils.config import load_config

LEVELS = ("BL1", "PA1", "PA2", "PA3", "PA4")


def coral_and_matching_softmax(features: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A CORAL head's level probabilities of `features`, and a softmax `Linear` head's class probabilities of the
    same features built to be the same distribution (its logits the log of CORAL's level probabilities, fitted as
    a linear map of the features): both through `output_probabilities`, the function every evaluation calls."""
    torch.manual_seed(0)
    coral = CoralHead(features.shape[1], len(LEVELS))
    with torch.no_grad():
        coral.weight.weight.copy_(torch.tensor([[1.5, -0.7, 0.3]]))
        ordinal = output_probabilities(coral, coral(features))
        # log-probabilities as logits, solved for exactly (features augmented with a constant column for the bias)
        design = torch.cat([features, torch.ones(len(features), 1)], dim=1).double()
        solution = torch.linalg.lstsq(design, ordinal.double().log()).solution
        softmax_head = nn.Linear(features.shape[1], len(LEVELS))
        softmax_head.weight.copy_(solution[:-1].T.float())
        softmax_head.bias.copy_(solution[-1].float())
        softmax = output_probabilities(softmax_head, softmax_head(features))
    return ordinal.numpy(), softmax.numpy()


def test_softmax_and_ordinal_decoded_by_one_rule_call_the_same_levels() -> None:
    # four rows, so the 4x4 system is solved exactly: the two heads give one distribution per row; the second is
    # flat in the middle (CORAL logit -0.6): its mode is PA4, its median PA2
    features = torch.tensor([[2.0, 0.0, 0.0], [-0.4, 0.0, 0.0], [-1.0, 1.0, 0.5], [0.5, -2.0, 1.0]])
    ordinal, softmax = coral_and_matching_softmax(features)
    np.testing.assert_allclose(softmax, ordinal, atol=1e-5)
    for rule in DECODINGS:
        assert called_classes(softmax, rule).tolist() == called_classes(ordinal, rule).tolist(), rule
    # the former pairing (softmax by argmax, ordinal by its median level) calls these same distributions apart
    assert called_classes(softmax, "argmax").tolist() != called_classes(ordinal, "median").tolist()


def test_the_rules_on_hand_made_level_probabilities() -> None:
    probs = np.array([[0.4, 0.0, 0.0, 0.3, 0.3],   # mode 0, median 3, expected 1.8 -> 2
                      [0.1, 0.1, 0.1, 0.3, 0.4],   # mode 4, median 3, expected 2.8 -> 3
                      [0.2, 0.2, 0.2, 0.2, 0.2],   # a tie: the lowest mode; median 2; expected 2
                      [0.0, 0.5, 0.5, 0.0, 0.0]])  # median 1 (P(level > 1) = 0.5 is not above 0.5); 1.5 -> 1
    assert called_classes(probs, "argmax").tolist() == [0, 4, 0, 1]
    assert called_classes(probs, "median").tolist() == [3, 3, 2, 1]
    assert called_classes(probs, "expected").tolist() == [2, 3, 2, 1]
    with pytest.raises(ValueError, match=r"eval.decoding='mode': expected one of argmax, median, expected"):
        called_classes(probs, "mode")


def test_on_two_classes_every_rule_calls_alike_ties_included() -> None:
    pain = np.array([0.0, 0.2, 0.5, 0.5000001, 0.8, 1.0])
    probs = np.stack([1 - pain, pain], axis=1)
    calls = {rule: called_classes(probs, rule).tolist() for rule in DECODINGS}
    assert calls["argmax"] == [0, 0, 0, 1, 1, 1]
    assert calls["median"] == calls["expected"] == calls["argmax"]


def test_a_fold_evaluation_calls_frames_and_videos_by_the_rule_for_a_corn_head_and_a_softmax_alike() -> None:
    """Through `evaluate_predictions`: the same level probabilities in the `prob_<class>` columns (a CORN head's,
    and the same numbers as a softmax's) give the same frame and video calls under each rule."""
    torch.manual_seed(1)
    corn = CornHead(3, len(LEVELS))
    features = torch.randn(12, 3) * 2
    with torch.no_grad():
        probs = output_probabilities(corn, corn(features)).numpy()
    frames = pd.DataFrame({"subject_name": np.repeat(["a", "b"], 6),
                           "sample_name": np.tile(np.repeat(["v1", "v2"], 3), 2), "label": np.repeat([0, 4, 1, 3], 3)})
    for index, name in enumerate(LEVELS):
        frames[f"prob_{name}"] = probs[:, index]
    for rule in DECODINGS:
        evaluation = evaluate_predictions(frames, LEVELS, aggregation="mean", k=1, decoding=rule)
        video_probs = evaluation.video_predictions[[f"prob_{name}" for name in LEVELS]].to_numpy()
        assert evaluation.video_predictions["pred"].tolist() == called_classes(video_probs, rule).tolist()
        np.testing.assert_array_equal(evaluation.confusion_frame.sum(axis=0),
                                      np.bincount(called_classes(probs, rule), minlength=len(LEVELS)))


def settings(output: str, task: str, decoding: str | None) -> CvSettings:
    tags = {tracking.MODEL_TAG: "resnet10t", tracking.TASK_TAG: task, tracking.OUTPUT_TAG: output}
    if decoding is not None:
        tags[tracking.DECODING_TAG] = decoding
    return CvSettings(tags, {} if decoding is None else {"eval.decoding": decoding})


def test_make_compare_refuses_five_class_cvs_decoded_by_different_rules() -> None:
    # CVs made before the setting: an ordinal one was called by its median level, a softmax one by argmax
    old = {"softmax": settings("softmax", "five_class", None), "ordinal": settings("ordinal_coral", "five_class", None)}
    assert decoding_of(old["ordinal"].tags, old["ordinal"].params) == "median"
    problems = comparability_problems(old)
    assert len(problems) == 1 and problems[0].startswith("eval.decoding differs (ordinal: median; softmax: argmax)")
    assert comparability_problems(old, allowed=["eval.decoding"]) == []
    fair = {"softmax": settings("softmax", "five_class", "median"), "ordinal": settings("ordinal_coral", "five_class",
                                                                                        "median")}
    assert comparability_problems(fair) == []
    # on two classes the rules call alike: no refusal
    binary = {"softmax": settings("softmax", "bl1_vs_pa4", None), "ordinal": settings("ordinal_coral", "bl1_vs_pa4",
                                                                                      None)}
    assert comparability_problems(binary) == []
    # the label names a rule other than argmax on a five-class task, never on a binary one
    assert cv_label(fair["ordinal"].tags) == "resnet10t ordinal_coral by_median"
    assert cv_label(settings("ordinal_coral", "bl1_vs_pa4", "median").tags) == "resnet10t ordinal_coral"


def test_the_rule_joins_a_cvs_identity_only_where_it_is_not_its_outputs_former_one() -> None:
    """A CV made before `eval.decoding` keeps its identity: the former rule of its output is left out of it."""
    def identity(*overrides: str) -> dict:
        return identity_config(CvConfig.from_config(load_config(list(overrides))))

    assert "decoding" not in identity("task=five_class")["eval"]
    assert identity("task=five_class", "eval.decoding=median")["eval"]["decoding"] == "median"
    ordinal = ["task=five_class", "model/output=ordinal"]
    assert identity(*ordinal)["eval"]["decoding"] == "argmax"
    assert "decoding" not in identity(*ordinal, "eval.decoding=median")["eval"]
