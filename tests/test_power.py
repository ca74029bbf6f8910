"""`make power`: the error rates of `make compare`'s test over independent BioVid-scale twins, and the statistics it
rests on (Clopper-Pearson intervals, the minimum detectable effect)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from pipeline.analysis.comparison_statistics import PRIMARY_CHOICES, PRIMARY_METRIC
from pipeline.analysis.power import PowerSettings, clopper_pearson, effect_metric, run_power, study_key
from pipeline.data.synthetic.settings import EFFECTS
from pipeline.evaluation.statistics import minimum_detectable_effect
from pipeline.utils.config import load_config


def test_clopper_pearson_is_the_exact_binomial_interval() -> None:
    low, high = clopper_pearson(0, 20)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 20))  # the exact bound when nothing is rejected
    low, high = clopper_pearson(10, 20)
    assert low == pytest.approx(stats.beta.ppf(0.025, 10, 11)) and high == pytest.approx(stats.beta.ppf(0.975, 11, 10))


def power_group(*overrides: str):
    return load_config(list(overrides), groups=("power=default",)).power


def power_settings(*overrides: str) -> PowerSettings:
    return PowerSettings.of(power_group(*overrides))


def test_every_configured_effect_names_a_twin_a_metric_compare_takes_and_two_settings_that_differ() -> None:
    power = power_group()
    assert {"null", "temporal", "baseline", "graded"} <= set(power.effects)
    for name, entry in power.effects.items():
        assert entry.twin in EFFECTS, name
        assert effect_metric(power_settings(f"power.effect={name}")) in PRIMARY_CHOICES, name
        assert list(entry.a.overrides) != list(entry.b.overrides), name
        load_config([f"task={entry.task}", *entry.a.overrides])  # each side composes
        load_config([f"task={entry.task}", *entry.b.overrides])
    assert effect_metric(power_settings("power.effect=graded")) == "mae"
    assert effect_metric(power_settings("power.effect=temporal")) == PRIMARY_METRIC
    assert list(power.effects.baseline.allow_differences) == ["personalise"]


def test_a_true_difference_of_the_minimum_detectable_effect_is_detected_four_times_in_five() -> None:
    """The known answer: paired differences whose true mean is the MDE are rejected by the paired test at its level
    in about 80 % of simulated studies (the t approximation the permutation test converges to)."""
    rng = np.random.default_rng(0)
    n, alpha = 40, 0.05 / 6
    sd = 1.0  # the spread the studies are drawn with; the MDE of a sample of that spread
    mde = minimum_detectable_effect(np.array([-1.0, 1.0] * (n // 2)) * sd * np.sqrt((n - 1) / n), alpha)
    rejected = [stats.ttest_1samp(rng.normal(mde, sd, n), 0).pvalue < alpha for _ in range(4000)]
    assert np.mean(rejected) == pytest.approx(0.8, abs=0.025)
    assert np.isnan(minimum_detectable_effect(np.array([0.1]), 0.05))
    assert minimum_detectable_effect(np.zeros(10), 0.05) == 0.0


@pytest.mark.slow
def test_make_power_repeats_a_comparison_over_twins_and_resumes(tmp_path: Path, capsys) -> None:
    """One repeat of the null twin end to end (truth crops of 87 people, a frozen backbone's cache, two CVs on
    BioVid's hold-out file, `compare` of the two): its row, summary, plot and run; a rerun runs nothing again."""
    overrides = ["model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "protocol=holdout",
                 "power.effect=null", "power.repeats=1", "data.synthetic.samples_per_class=1",
                 "preprocess.frames_per_video=3", "preprocess.crop_size=48", "loader.num_workers=0",
                 "trainer.max_epochs=1", "model.head.epochs=2", "trainer.precision=32-true",
                 f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"mlflow.artifact_root={tmp_path / 'art'}",
                 f"reports_dir={tmp_path / 'reports'}", f"power.dir={tmp_path / 'twins'}",
                 f"cv.work_dir={tmp_path / 'runs'}", "data.synthetic.workers=1"]
    cfg = load_config(overrides, groups=("power=default",))
    summary = run_power(cfg, overrides)
    out = tmp_path / "reports" / "power" / "null"
    repeats = pd.read_csv(out / "repeats.csv", dtype={"study": str})
    assert len(repeats) == 1 and repeats.seed.tolist() == [1000] and repeats.n_subjects.iloc[0] == 26
    assert summary["repeats"] == 1 and summary["measures"] == "type-I error"
    assert summary["rate_ci95_high"] == pytest.approx(clopper_pearson(summary["rejections"], 1)[1])
    assert json.loads(summary["planted"])["class_intensity"] == [0.0] * 5
    assert np.isfinite(repeats.mde80.iloc[0]) and (out / "power.png").stat().st_size > 0
    assert not (tmp_path / "twins" / "null" / "seed_1000").exists()  # a repeat's twin is removed once measured
    capsys.readouterr()
    run_power(cfg, overrides)  # done before: nothing is trained again
    assert "== null twin" not in capsys.readouterr().out
    # a record's row is counted only for its own study: another backbone or its weights over the same seeds is not
    base = [o for o in overrides if not o.startswith(("power.", "task=", "data="))]
    power = PowerSettings.of(cfg.power)
    assert repeats.study.iloc[0] == study_key(power, base)
    assert study_key(power, [*base, "model.weights=/elsewhere.pt"]) != study_key(power, base)
    assert study_key(power, list(reversed(base))) == study_key(power, base)
