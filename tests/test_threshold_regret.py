"""The threshold rules' regret on real folds (pipeline/analysis/threshold_regret.py): each rule chosen on a fold's
validation videos and scored on its test videos, against the best cut on them; the cluster-bootstrap table; and the
same numbers read from a real CV's folds in a real MLflow store, where the rule the CV ran with must give back the
threshold and balanced accuracy its folds logged. scripts/check_default_thresholds.py runs on that store too."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.analysis.threshold_regret import (
    FoldVideos,
    compared_rules,
    failing_folds,
    fold_rule_rows,
    one_run_per_fold,
    regret_rows,
    regret_table,
    resampled_means,
)
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.paths import PROJECT_ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROBE = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "model.finetune=frozen",
         "model.head.fit=in_memory", "loader.num_workers=0", "loader.batch_size=8", "trainer.max_epochs=3",
         "trainer.folds=[0,1,2]", "cv.log_models=false", "cv.fold_plots=false")


def constructed_fold(split: str = "a:0", test_scores: tuple[float, ...] = (0.2, 0.55, 0.58, 0.52, 0.7, 0.8)
                     ) -> FoldVideos:
    """Validation videos whose classes part at 0.6 (Youden's cut; both class medians 0.5 apart from 0.5 on either
    scale, so the midpoints are 0.5), and test videos whose best cut, 0.6 to 0.7, reaches 5/6 balanced accuracy."""
    return FoldVideos("cv", "run", 0, "", "twin", "bl1_vs_pa4", "model", split, 2,
                      np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.6, 0.9]),
                      np.array([0, 0, 0, 1, 1, 1]), np.array(test_scores))


def test_regret_of_each_rule_on_a_constructed_fold() -> None:
    rows = {row["rule"]: row for row in fold_rule_rows(constructed_fold(), compared_rules())}
    assert set(rows) == {"youden", "equal_error", "median_midpoint", "logit_midpoint", "shrinkage", "fixed_0.5"}
    for row in rows.values():
        assert row["best_balanced_accuracy"] == pytest.approx(5 / 6)
        assert row["video_auroc"] == pytest.approx(7 / 9)  # of the 9 pairs, 7 rank pain above baseline
    # Youden cuts at 0.6: 0.7 and 0.8 are pain, nothing else -> 2/3 sensitivity, full specificity: the best cut
    assert rows["youden"]["threshold"] == pytest.approx(0.6)
    assert rows["youden"]["regret"] == pytest.approx(0.0)
    # the midpoints and 0.5 cut at 0.5: every test video but 0.2 is pain -> (1 + 1/3) / 2
    for rule in ("median_midpoint", "logit_midpoint", "fixed_0.5"):
        assert rows[rule]["threshold"] == pytest.approx(0.5)
        assert rows[rule]["balanced_accuracy"] == pytest.approx(2 / 3)
        assert rows[rule]["regret"] == pytest.approx(5 / 6 - 2 / 3)
    # shrinkage: 2 validation subjects keep 2/12 of Youden's move away from 0.5 -> 0.5167, as 0.5 here
    assert rows["shrinkage"]["threshold"] == pytest.approx(0.5 + (0.6 - 0.5) * 2 / 12)
    assert rows["shrinkage"]["regret"] == pytest.approx(5 / 6 - 2 / 3)


def test_a_validation_set_of_one_class_falls_back_as_the_fold_does() -> None:
    one_class = dataclasses.replace(constructed_fold(), val_labels=np.zeros(4, dtype=int))
    rows = {row["rule"]: row for row in fold_rule_rows(one_class, ["youden"])}
    assert rows["youden"]["threshold"] == 0.5 and rows["youden"]["fallback"]


def test_the_table_resamples_splits_and_pairs_the_rules() -> None:
    # two splits: on the second, the test videos are ranked so that every cut from 0.5 to 0.6 is the best one
    rows = pd.DataFrame(fold_rule_rows(constructed_fold("a:0"), compared_rules())
                        + fold_rule_rows(constructed_fold("b:0", (0.1, 0.2, 0.3, 0.65, 0.7, 0.8)), compared_rules()))
    table = regret_table(rows, ["dataset"], resamples=500, seed=0).set_index("rule")
    assert table.loc["youden", "regret"] == pytest.approx(0.0)
    assert table.loc["fixed_0.5", "regret"] == pytest.approx(100 * (5 / 6 - 2 / 3) / 2)
    assert table.loc["fixed_0.5", "worst"] == pytest.approx(100 * (5 / 6 - 2 / 3))
    # Youden and the equal error rate both cut at 0.6 on validation: either is the best, the other 0 behind it
    assert set(table.index[:2]) == {"youden", "equal_error"} and table["versus_best"].iloc[0] in table.index[:2]
    assert table.loc["youden", "difference"] == table.loc["equal_error", "difference"] == 0
    # resampling two splits: either one twice (0 or the worst) or both (the mean)
    assert table.loc["fixed_0.5", "regret_low"] == pytest.approx(0.0)
    assert table.loc["fixed_0.5", "regret_high"] == pytest.approx(table.loc["fixed_0.5", "worst"])
    assert (table["folds"] == 2).all() and (table["clusters"] == 2).all()


def test_a_fold_trained_twice_in_a_store_counts_once() -> None:
    """The same task, split and seed run again as another CV (a setting that changes no training, e.g. the threshold
    rule): its rows are left out and counted; another split or task stays."""
    first = pd.DataFrame(fold_rule_rows(constructed_fold("a:0"), compared_rules())).assign(cv_run="newer")
    again = first.assign(cv_run="older")
    other_split = pd.DataFrame(fold_rule_rows(constructed_fold("a:1"), compared_rules())).assign(cv_run="older")
    kept, left_out = one_run_per_fold(pd.concat([first, again, other_split], ignore_index=True))
    assert left_out == 1 and set(kept["cv_run"]) == {"newer", "older"}  # "older" still holds split a:1
    assert len(kept) == len(first) + len(other_split) and set(kept["split"]) == {"a:0", "a:1"}
    kept, left_out = one_run_per_fold(pd.concat([first, again], ignore_index=True))
    assert (left_out, set(kept["cv_run"]), len(kept)) == (1, {"newer"}, len(first))


def test_a_resampled_mean_weighs_each_split_by_its_folds() -> None:
    values = np.array([1.0, 3.0, 10.0])  # split 0 holds two folds, split 1 one
    draws = np.array([[0, 0], [1, 1], [0, 1]])
    assert resampled_means(values, np.array([0, 0, 1]), draws) == pytest.approx([2.0, 10.0, 14 / 3])


def script(name: str):
    """A script of scripts/ as a module (its main takes argv)."""
    spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_cv(tiny_config, tmp_path_factory: pytest.TempPathFactory):
    """Three folds of a frozen probe on the tiny twin, in a store of their own (1 validation subject a fold)."""
    base = tmp_path_factory.mktemp("threshold_regret")
    cfg = tiny_config(*PROBE, "mlflow.experiment=pain-thresholds", f"mlflow.artifact_root={base / 'art'}",
                      f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}", f"cv.work_dir={base / 'runs'}")
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    return cfg, client, cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(cfg)).info.run_id


def test_every_rule_on_a_real_cvs_folds_and_its_own_rule_gives_back_what_the_folds_logged(tiny_cv) -> None:
    cfg, client, parent = tiny_cv
    rows, skipped = regret_rows(client, [parent])
    assert skipped == 0 and sorted(rows["fold"].unique()) == [0, 1, 2]
    assert len(rows) == 3 * len(compared_rules()) and (rows["validation_subjects"] == 1).all()
    assert (rows["regret"] >= -1e-12).all() and (rows["regret"] == rows["best_balanced_accuracy"]
                                                  - rows["balanced_accuracy"]).all()
    logged = tracking.finished_fold_runs(client, parent)
    for fold, run in logged.items():
        own = rows[(rows["fold"] == fold) & (rows["rule"] == cfg.eval.threshold)].iloc[0]
        assert own["fold_run"] == run.info.run_id
        assert own["threshold"] == pytest.approx(run.data.metrics["test/threshold"])
        assert own["balanced_accuracy"] == pytest.approx(
            run.data.metrics["test/video_balanced_accuracy_at_threshold"])
        assert own["video_auroc"] == pytest.approx(run.data.metrics["test/video_auroc"])


def test_the_default_cv_check_reads_the_store_and_fails_a_fold_below_the_floor(tiny_cv, tmp_path, capsys) -> None:
    cfg, client, parent = tiny_cv
    check = script("check_default_thresholds")
    arguments = ["--store", cfg.mlflow.tracking_uri, "--run", parent, "--out", str(tmp_path)]
    status = check.main([*arguments, "--rule", "youden"])
    printed = capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "default_cv_folds.csv")
    failing = failing_folds(rows, "youden", check.AUROC_FLOOR, check.ACCURACY_FLOOR)
    assert status == (1 if len(failing) else 0) and f"{len(failing)} of 3 folds" in printed
    # a floor no fold can pass: every fold whose AUROC reaches 0 fails it
    assert len(failing_folds(rows, "youden", 0.0, 1.01)) == 3
    # without --run it looks for the default backbones' finished CVs: none here, and it says so
    with pytest.raises(SystemExit) as stopped:
        check.main(["--store", cfg.mlflow.tracking_uri, "--experiment", "pain-thresholds", "--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert "no finished default CV of vit_b16, cvt_13, mobilevit_s" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # a store where no CV ran under that experiment
        check.main(["--store", cfg.mlflow.tracking_uri, "--experiment", "no-such", "--out", str(tmp_path)])
    assert stopped.value.code == 2 and "no experiment 'no-such' in this store" in capsys.readouterr().err


def test_the_study_script_tables_the_store_it_is_given(tiny_cv, tmp_path, capsys) -> None:
    cfg, client, parent = tiny_cv
    store = Path(cfg.mlflow.tracking_uri.removeprefix("sqlite:///")).parent
    status = script("threshold_regret").main(["--analyse-only", "--store", str(store), "--out", str(tmp_path),
                                              "--resamples", "50"])
    assert status == 0 and "1 finished CVs, 0 fold(s) left out" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "threshold_regret.csv")
    folds = pd.read_csv(tmp_path / "threshold_regret_folds.csv")
    # one group (the tiny twin, 1 validation subject), every rule once, its mean the mean of its folds' regrets
    assert sorted(table["rule"]) == sorted(str(rule) for rule in folds["rule"].unique()) and len(table) == len(
        compared_rules())
    for rule, part in folds.groupby("rule"):
        row = table[table["rule"] == rule].iloc[0]
        assert row["folds"] == 3 and row["regret"] == pytest.approx(100 * part["regret"].mean())
        # a resampled mean of whole splits lies between the best and the worst fold
        low, high = 100 * part["regret"].min() - 1e-9, 100 * part["regret"].max() + 1e-9
        assert low <= row["regret_low"] <= row["regret_high"] <= high
    assert (tmp_path / "threshold_regret.png").stat().st_size > 0
