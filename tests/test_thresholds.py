"""The decision threshold: chosen on validation videos, applied unchanged to test videos."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipeline.evaluation.thresholds import (
    ALL_EQUAL,
    NO_BETTER_THAN_CHANCE,
    ONE_CLASS,
    binary_metrics_at,
    choose_threshold,
    decide_fold,
    parse_rule,
    rule_name,
    video_threshold,
)

CLASSES = ("BL1", "PA4")


def videos(labels: list[int], scores: list[float], subject: str) -> pd.DataFrame:
    return pd.DataFrame({"subject_name": subject, "sample_name": [f"{subject}-{i}" for i in range(len(labels))],
                         "label": labels, "prob_BL1": 1 - np.array(scores), "prob_PA4": scores,
                         "pred": (np.array(scores) > 0.5).astype(int)})


def test_well_ranked_scores_above_one_half_are_separated() -> None:
    """A model that ranks perfectly but calls everything pain at 0.5: the validation threshold separates."""
    val = videos([0, 0, 0, 1, 1, 1], [0.62, 0.66, 0.70, 0.81, 0.85, 0.90], "val-subject")
    test = videos([0, 0, 0, 0, 1, 1, 1, 1], [0.60, 0.64, 0.69, 0.71, 0.83, 0.86, 0.88, 0.93], "test-subject")
    threshold, decided, metrics, fallback = decide_fold(val, test, CLASSES, "youden")
    assert fallback == "" and metrics["threshold_fallback"] == 0.0
    assert 0.70 < threshold <= 0.81
    assert (decided["decision"] == decided["label"]).all()
    assert metrics["video_accuracy_at_threshold"] == 1.0 > metrics["video_accuracy_at_0.5"] == 0.5
    assert metrics["video_sensitivity_at_threshold"] == metrics["video_specificity_at_threshold"] == 1.0
    assert (decided["threshold"] == threshold).all()


def test_the_threshold_is_the_validation_one_not_the_test_one() -> None:
    """Validation and test have different best thresholds: the fold uses the validation one, whatever test holds."""
    val = videos([0, 0, 1, 1], [0.20, 0.30, 0.40, 0.50], "v")
    test = videos([0, 0, 1, 1], [0.70, 0.75, 0.85, 0.90], "t")
    best_on_val = choose_threshold(val["label"], val["prob_PA4"], "youden").threshold
    best_on_test = choose_threshold(test["label"], test["prob_PA4"], "youden").threshold
    assert best_on_val != best_on_test
    threshold, _, metrics, _ = decide_fold(val, test, CLASSES, "youden")
    assert threshold == best_on_val
    # the test labels do not move it: flipping them changes the metrics, never the threshold
    flipped = test.assign(label=1 - test["label"])
    assert decide_fold(val, flipped, CLASSES, "youden")[0] == threshold
    assert metrics == {f"video_{k}_at_threshold": v for k, v in binary_metrics_at(
        test["label"], test["prob_PA4"], threshold).items()} | {"video_accuracy_at_0.5": 0.5, "threshold_fallback": 0.0}


def test_fixed_threshold_and_five_classes() -> None:
    val = videos([0, 1], [0.1, 0.9], "v")
    test = videos([0, 1, 1], [0.2, 0.45, 0.8], "t")
    threshold, decided, metrics, _ = decide_fold(val, test, CLASSES, 0.4)
    assert threshold == 0.4 and decided["decision"].tolist() == [0, 1, 1]
    assert metrics["video_accuracy_at_threshold"] == 1.0
    five = pd.DataFrame({"subject_name": "s", "sample_name": ["a", "b"], "label": [0, 3],
                         **{f"prob_{c}": [0.2, 0.2] for c in ("BL1", "PA1", "PA2")},
                         "prob_PA3": [0.1, 0.3], "prob_PA4": [0.3, 0.1]})
    names = ("BL1", "PA1", "PA2", "PA3", "PA4")
    threshold, decided, metrics, _ = decide_fold(five, five, names, "youden")
    assert np.isnan(threshold) and metrics == {} and decided["decision"].tolist() == [4, 3]
    assert rule_name("youden", 5) == "argmax" and rule_name(0.5, 2) == "fixed" and rule_name("youden", 2) == "youden"
    with pytest.raises(ValueError, match="eval.threshold"):
        parse_rule("median")


def test_validation_scores_that_cannot_choose_fall_back_to_one_half_and_say_why(tmp_path, capsys,
                                                                               monkeypatch) -> None:
    """Inverted validation scores (every pain video scored below every baseline one): the best J is 0, at a cut below
    every score that would call every test video pain. The fold falls back to 0.5, tags why, and the CV counts it."""
    import mlflow

    from pipeline.models.fold_result import FoldResult
    from pipeline.runs.jobs.fold_job import log_threshold_fallback
    from pipeline.runs.orchestration.cv_summary import print_table
    from pipeline.runs.store.run_record import RunRecord

    inverted = videos([0, 0, 0, 1, 1, 1], [0.9, 0.8, 0.7, 0.3, 0.2, 0.1], "val-subject")
    test = videos([0, 0, 1, 1], [0.2, 0.6, 0.4, 0.9], "test-subject")
    threshold, decided, metrics, fallback = decide_fold(inverted, test, CLASSES, "youden")
    assert threshold == 0.5 and fallback == NO_BETTER_THAN_CHANCE and metrics["threshold_fallback"] == 1.0
    assert decided["decision"].tolist() == [0, 1, 0, 1]  # at 0.5, not "all pain"
    assert choose_threshold([0, 0, 1], [0.1, 0.2, 0.9], "youden") == (0.9, "")  # J = 1 there: it chose
    assert choose_threshold([1, 1, 1], [0.1, 0.2, 0.9], "youden") == (0.5, ONE_CLASS)
    assert choose_threshold([0, 1, 0, 1], [0.3] * 4, "balanced_accuracy") == (0.5, ALL_EQUAL)
    assert choose_threshold([0, 1], [0.2, 0.7], 0.6) == (0.6, "")  # a fixed threshold never falls back

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a real file store: no database to migrate for one run
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    with mlflow.start_run() as run:
        record = RunRecord.of_active_run()
        log_threshold_fallback(3, fallback, record)
        record.log_metrics({f"test/{k}": v for k, v in metrics.items()})
        record.flush()
    logged = mlflow.get_run(run.info.run_id).data
    assert logged.tags["threshold_fallback"] == NO_BETTER_THAN_CHANCE
    assert logged.metrics["test/threshold_fallback"] == 1.0

    chose = decide_fold(videos([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9], "v"), test, CLASSES, "youden")
    results = [FoldResult(fold, {"test/threshold": d.threshold, **{f"test/{k}": v for k, v in d.metrics.items()}},
                          pd.DataFrame(), d.videos, 1.0) for fold, d in enumerate([chose, chose, decide_fold(
                              inverted, test, CLASSES, "youden")])]
    print_table(results, {})
    out = capsys.readouterr().out
    assert "threshold fallbacks: 1 of 3 folds" in out and "(fold 2;" in out


def test_threshold_spread_shrinks_with_more_validation_subjects() -> None:
    """The same kind of scores from 2 and from 20 validation subjects: every rule's bootstrap interval is wider with
    2; the shrinkage rule stays nearer 0.5 with 2 subjects; the midpoint of class medians worked by hand."""
    from pipeline.evaluation.thresholds import median_midpoint_threshold, threshold_spread

    rng = np.random.default_rng(1)

    def validation(n_subjects: int) -> pd.DataFrame:
        parts = []
        for s in range(n_subjects):
            labels = [0] * 6 + [1] * 6
            scores = np.clip(np.r_[rng.normal(0.35, 0.12, 6), rng.normal(0.6, 0.12, 6)], 0, 1)
            parts.append(videos(labels, list(scores), f"s{s}"))
        return pd.concat(parts, ignore_index=True)

    few, many = threshold_spread(validation(2), "prob_PA4"), threshold_spread(validation(20), "prob_PA4")
    def width(spread: dict, rule: str) -> float:
        return spread[f"threshold_ci95_high_{rule}"] - spread[f"threshold_ci95_low_{rule}"]

    for rule in ("youden", "equal_error", "median_midpoint"):
        assert width(few, rule) > width(many, rule) > 0, rule
        assert few[f"threshold_ci95_low_{rule}"] <= few[f"threshold_{rule}"] <= few[f"threshold_ci95_high_{rule}"]
    # shrinkage keeps 2 / 12 of Youden's move with two subjects: it moves far less than Youden's threshold there
    assert width(few, "shrinkage") == pytest.approx(width(few, "youden") / 6, rel=0.05)
    assert abs(few["threshold_shrinkage"] - 0.5) < abs(few["threshold_youden"] - 0.5)
    # medians 0.2 (of 0.1, 0.2, 0.3) and 0.7 (of 0.6, 0.7, 0.9): midpoint 0.45
    assert median_midpoint_threshold(np.array([0, 0, 0, 1, 1, 1]),
                                     np.array([0.1, 0.2, 0.3, 0.6, 0.7, 0.9])) == pytest.approx(0.45)


def test_roc_points_are_sklearns_roc_curve() -> None:
    """The fast ROC gives sklearn's points and cut points exactly, ties in the scores included."""
    from sklearn.metrics import roc_curve

    from pipeline.evaluation.thresholds import roc_points

    for seed in range(20):
        rng = np.random.default_rng(seed)
        labels = np.r_[0, 1, rng.integers(0, 2, int(rng.integers(0, 40)))]
        scores = np.round(rng.random(labels.size), 1 if seed % 2 else 8)  # coarse scores: many ties
        for ours, theirs in zip(roc_points(labels, scores), roc_curve(labels, scores, drop_intermediate=False),
                                strict=True):
            np.testing.assert_array_equal(ours, theirs)


def test_every_measured_rule_is_selectable_and_decides_at_its_own_threshold() -> None:
    """eval.threshold takes each rule the spread measures; a fold decides at the value that rule computes on its
    validation videos (shrinkage weighs Youden's by the fold's validation subjects), and falls back as Youden does."""
    from pipeline.evaluation.thresholds import equal_error_threshold, median_midpoint_threshold, shrink

    val = pd.concat([videos([0, 0, 1, 1, 1], [0.55, 0.70, 0.66, 0.82, 0.90], "a"),
                     videos([0, 1, 0, 1], [0.60, 0.75, 0.64, 0.95], "b")])
    test = videos([0, 0, 1, 1], [0.58, 0.67, 0.72, 0.91], "t")
    labels, scores = val["label"].to_numpy(), val["prob_PA4"].to_numpy()
    youden = choose_threshold(labels, scores, "youden").threshold
    expected = {"equal_error": equal_error_threshold(labels, scores),
                "median_midpoint": median_midpoint_threshold(labels, scores),
                "shrinkage": shrink(youden, 2)}
    assert expected["shrinkage"] == pytest.approx(2 / 12 * youden + 10 / 12 * 0.5)
    assert expected["median_midpoint"] == pytest.approx((np.median([0.55, 0.70, 0.60, 0.64])
                                                         + np.median([0.66, 0.82, 0.90, 0.75, 0.95])) / 2)
    for rule, value in expected.items():
        threshold, decided, _, fallback = decide_fold(val, test, CLASSES, rule)
        assert threshold == pytest.approx(value) and fallback == "" and rule_name(rule, 2) == rule
        assert (decided["decision"] == (decided["prob_PA4"] >= value)).all()
        # inverted validation scores: every rule falls back to 0.5 and says why
        inverted = val.assign(prob_PA4=1 - val["prob_PA4"], prob_BL1=val["prob_PA4"])
        assert decide_fold(inverted, test, CLASSES, rule)[3] == NO_BETTER_THAN_CHANCE
    with pytest.raises(ValueError, match="number of validation subjects"):
        choose_threshold(labels, scores, "shrinkage")


def test_one_decision_with_the_rule_the_config_gives() -> None:
    """Folds, final models and trials choose with `video_threshold`; no function of the module has a rule of its
    own to fall back on (configs/config.yaml's eval.threshold is the one default)."""
    import inspect

    from pipeline.evaluation import thresholds

    for function in (thresholds.choose_threshold, thresholds.video_threshold, thresholds.decide_fold):
        assert inspect.signature(function).parameters["rule"].default is inspect.Parameter.empty, function
    val = pd.concat([videos([0, 0, 1, 1], [0.2, 0.4, 0.6, 0.9], "a"), videos([0, 1], [0.3, 0.8], "b")])
    for rule in ("youden", "median_midpoint", "logit_midpoint", "shrinkage", 0.3):
        assert decide_fold(val, val, CLASSES, rule).threshold == video_threshold(val, CLASSES, rule).threshold
    # more classes: a final model's pain-or-not threshold, on 1 - P(first class), the score a served model cuts
    five = ("BL1", "PA1", "PA2", "PA3", "PA4")
    probs = np.array([[0.7, 0.1, 0.1, 0.05, 0.05], [0.6, 0.1, 0.1, 0.1, 0.1], [0.2, 0.1, 0.1, 0.1, 0.5],
                      [0.1, 0.1, 0.1, 0.2, 0.5]])
    multi = pd.DataFrame({"subject_name": ["a", "a", "b", "b"], "label": [0, 0, 2, 4],
                          **{f"prob_{name}": probs[:, i] for i, name in enumerate(five)}})
    chosen = video_threshold(multi, five, "median_midpoint")
    assert chosen.threshold == pytest.approx(((0.3 + 0.4) / 2 + (0.8 + 0.9) / 2) / 2) and chosen.fallback == ""
