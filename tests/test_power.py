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
from pipeline.analysis.power_report import eighty_percent_point
from pipeline.analysis.resampled_power import ResampledStudy
from pipeline.data.synthetic.settings import EFFECTS
from pipeline.data.tasks import get_task
from pipeline.evaluation.statistics import minimum_detectable_effect, paired_test
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
    assert {"null", "temporal", "baseline", "graded", "aa", "aa_signal", "curve"} <= set(power.effects)
    for name, entry in power.effects.items():
        if entry.get("design") == "resampled":  # two copies of one configuration, b's embeddings degraded by levels
            assert get_task(entry.task).n_classes == 2 and list(entry.levels) == sorted(entry.levels), name
            assert entry.levels[0] == entry.get("base_level", 0.0), name  # the curve starts at no difference
            continue
        assert entry.twin in EFFECTS, name
        assert effect_metric(power_settings(f"power.effect={name}")) in PRIMARY_CHOICES, name
        assert list(entry.a.overrides) != list(entry.b.overrides), name
        load_config([f"task={entry.task}", *entry.a.overrides])  # each side composes
        load_config([f"task={entry.task}", *entry.b.overrides])
    assert list(power.effects.aa.levels) == [0.0]
    for effect in ("aa", "aa_signal"):  # an A/A: one configuration twice, the seeds alone differ
        study = ResampledStudy.from_config(power, effect, [], "twin")
        a, b = study.copies(3)
        assert a.shift == b.shift == power.effects[effect].get("base_level", 0.0) and a.seeds != b.seeds, effect
    assert power.effects.aa_signal.base_level > 0
    assert effect_metric(power_settings("power.effect=graded")) == "mae"
    assert effect_metric(power_settings("power.effect=temporal")) == PRIMARY_METRIC
    assert list(power.effects.baseline.allow_differences) == ["personalise"]


def test_a_true_difference_of_the_minimum_detectable_effect_is_detected_four_times_in_five() -> None:
    """The known answer: 85 subjects in five folds of 17, each fold's models shifting its subjects together. At a
    true mean difference of the minimum detectable effect (from the true standard error of the mean, on the 4 degrees
    of freedom of five folds, at Holm's first step over three pairs), the paired test over fold-grouped subjects
    rejects in about 80 % of simulated studies: the exact non-central t, where the normal approximation's
    (z_{1-a/2} + z_{0.8}) * se would have claimed 80 % at a difference it detects far less often."""
    rng = np.random.default_rng(0)
    folds = np.repeat(np.arange(5), 17)
    alpha, fold_sd, subject_sd = 0.05 / 3, 0.03, 0.15
    se = np.sqrt(fold_sd**2 + subject_sd**2 / 17) / np.sqrt(5)
    mde = minimum_detectable_effect(se, 4, alpha)
    normal = (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(0.8)) * se
    assert mde > 1.5 * normal

    def rate(delta: float) -> float:
        studies = delta + rng.normal(0, subject_sd, (3000, 85)) + rng.normal(0, fold_sd, (3000, 5))[:, folds]
        return float(np.mean([paired_test(d, folds).p_value < alpha for d in studies]))

    assert rate(mde) == pytest.approx(0.8, abs=0.025)
    assert rate(normal) < 0.5
    assert np.isnan(minimum_detectable_effect(float("nan"), 4, 0.05))
    assert np.isnan(minimum_detectable_effect(0.01, 0, 0.05))  # one unit: no degrees of freedom
    assert minimum_detectable_effect(0.0, 4, 0.05) == 0.0


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


@pytest.mark.slow
def test_make_power_aa_resamples_a_population_onto_the_fold_files_slots_and_resumes(tmp_path: Path, capsys) -> None:
    """EFFECT=aa end to end on a small population (two twins of 87, one video a class, two crops a video, a tiny
    frozen backbone): two replicates on BioVid's kfold5 slots, each copy cross-validated in memory, `make compare`'s
    paired test over the five folds and the subject-level test beside it; the record, the summary with both copies'
    accuracy and the true one, the plot and the run; a rerun fits nothing. With levels, copy b sees the action units."""
    overrides = ["model=timm", "model.name=resnet10t", "model.img_size=32", "model.pretrained=false",
                 "power.effect=aa", "power.repeats=2", "power.resampled.population_twins=2",
                 "power.resampled.truth_replicates=1", "data.synthetic.samples_per_class=1",
                 "preprocess.frames_per_video=2", "preprocess.crop_size=48", "loader.num_workers=0",
                 "trainer.max_epochs=2", "data.synthetic.workers=1",
                 f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"mlflow.artifact_root={tmp_path / 'art'}",
                 f"reports_dir={tmp_path / 'reports'}", f"power.dir={tmp_path / 'power'}"]
    cfg = load_config(overrides, groups=("power=default",))
    summary = run_power(cfg, overrides)
    out = tmp_path / "reports" / "power" / "aa"
    record = pd.read_csv(out / "replicates.csv", dtype={"study": str})
    assert record.replicate.tolist() == [1000, 1001] and (record.level == 0.0).all()
    assert (record.n_subjects == 87).all() and (record.n_units == 5).all()  # the kfold5 file's 87 slots, 5 folds
    assert record.p_value.between(0, 1).all() and record.p_subject.between(0, 1).all()
    assert record.true_a.notna().tolist() == [True, False]  # the truth from the first replicate only
    assert summary["replicates"] == 2 and summary["rate_ci95_high"] == pytest.approx(
        clopper_pearson(summary["rejections"], 2)[1])
    assert 0 <= summary["value_a"] <= 1 and 0 <= summary["true_a"] <= 1
    assert (out / "power.png").stat().st_size > 0 and (out / "power_summary.csv").is_file()
    printed = capsys.readouterr().out
    assert ("an A/A: copies a and b differ only in their training seeds (both plain), 1 training seed(s) a copy"
            in printed)
    assert "aa kfold5, 1 training seed a copy, copies differing only in their training seeds: " in printed
    assert "Clopper-Pearson" in printed
    run_power(cfg, overrides)  # done before: no replicate again
    assert "replicate 1000" not in capsys.readouterr().out
    curve = [*overrides[:4], "power.effect=curve", "power.effects.curve.levels=[0.0,4.0]",
             *[o for o in overrides[5:]]]
    run_power(load_config(curve, groups=("power=default",)), curve)
    rows = pd.read_csv(tmp_path / "reports" / "power" / "curve" / "replicates.csv")
    assert sorted(set(rows.level)) == [0.0, 4.0] and len(rows) == 4
    seeing = rows[rows.level == 4.0]  # b also sees the crops' action units: better where a random backbone sees little
    assert (rows.knob == "action_units").all() and (seeing.true_b.dropna() > seeing.true_a.dropna() + 0.05).all()


def test_the_eighty_percent_point_is_read_on_the_size_of_the_true_difference_of_either_sign() -> None:
    """A better copy b makes a - b negative: the curve is read against |a - b|, interpolated between its levels."""
    worse = pd.DataFrame({"true_diff": [0.0, 0.02, 0.04, 0.06], "rate": [0.05, 0.4, 0.7, 0.9]})
    better = worse.assign(true_diff=-worse["true_diff"])
    for summary in (worse, better, better.iloc[::-1]):
        assert eighty_percent_point(summary) == pytest.approx(0.05)
    assert np.isnan(eighty_percent_point(worse.assign(rate=0.5)))


def test_the_minimum_detectable_effect_is_finite_on_one_degree_of_freedom() -> None:
    """Two folds leave one degree of freedom, where scipy's non-central t returns NaN for the lower tail near the
    answer (df 1, non-centrality about 15): the effect is still found, and a true difference of it is detected with
    the promised power by the exact non-central t."""
    mde = minimum_detectable_effect(1.0, 1, 0.05)
    assert np.isfinite(mde) and mde > stats.t.ppf(0.975, 1)
    critical = stats.t.ppf(0.975, 1)
    assert stats.nct.sf(critical, 1, mde) + stats.nct.sf(critical, 1, -mde) == pytest.approx(0.8, abs=1e-6)


def test_a_study_is_keyed_by_its_weights_content_not_the_path_they_were_given_by(tmp_path: Path) -> None:
    """One study resumed from another checkout (or with WEIGHTS written otherwise) keeps its key and its replicates;
    other weights make another study."""
    power = power_group("power.effect=aa")
    first, copy, other = tmp_path / "a" / "w.pt", tmp_path / "b" / "w.pt", tmp_path / "c" / "w.pt"
    for path, content in ((first, b"weights"), (copy, b"weights"), (other, b"other weights")):
        path.parent.mkdir()
        path.write_bytes(content)
    key = {name: ResampledStudy.from_config(power, "aa", [f"model.weights={path}", "model.img_size=64"], "twin").key
           for name, path in (("first", first), ("copy", copy), ("other", other))}
    assert key["first"] == key["copy"] != key["other"]
    assert ResampledStudy.from_config(power, "aa", ["model.img_size=32", f"model.weights={first}"], "twin").key != key[
        "first"]
