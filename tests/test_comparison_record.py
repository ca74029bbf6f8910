"""A comparison reads in the MLflow UI (issue 45, item 2): its run sits in the comparisons' experiment under a name
that says task, protocol and the CVs compared; its description holds the pairs' table (difference with interval, p,
corrected p, mde80, the unit resampled) and each CV's figures; each pair's headline figures are metrics equal to the
table's; its plots come first among its artifacts, the tables under tables/; the experiment's headline view shows
the pairs' columns and grows with a second comparison's. On a real sqlite store, with CVs that logged pooled videos."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.analysis.compare import compare
from pipeline.analysis.comparison_record import HEADLINE_PAIR_METRICS
from pipeline.runs.store import tracking
from tests.test_compare import EXPERIMENT, make_cv, pooled_video_table, random_scores

VIEW_TAG = tracking.SHARED_VIEW_TAG_PREFIX + tracking.HEADLINE_VIEW


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    """Three CVs with pooled test videos, compared; then a fourth backbone, compared with the first two."""
    root = tmp_path_factory.mktemp("record")
    uri = f"sqlite:///{root / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = tracking.get_or_create_experiment(EXPERIMENT, root / "artifacts", client=client)
    for seed, model in enumerate(("vit", "cvt", "mobilevit", "swin")):
        run_id = make_cv(client, experiment_id, model, random_scores(50 + seed), 7_000 + seed, dataset="ui")
        path = root / run_id / "predictions_videos_all_folds.csv"
        path.parent.mkdir()
        pooled_video_table(seed, drop_reference=False).to_csv(path, index=False)
        client.log_artifact(run_id, str(path))
    first = compare("ui", "loso", "bl1_vs_pa4", root / "first", tracking_uri=uri, experiment=EXPERIMENT,
                    only=["vit", "cvt", "mobilevit"])
    second = compare("ui", "loso", "bl1_vs_pa4", root / "second", tracking_uri=uri, experiment=EXPERIMENT,
                     only=["vit", "swin"])
    return {"client": client, "first": first, "second": second}


def test_the_comparison_run_is_named_apart_and_lives_in_the_comparisons_experiment(compared) -> None:
    client, result = compared["client"], compared["first"]
    run = client.get_run(result["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == f"{EXPERIMENT}-comparisons"
    assert run.info.run_name == "bl1_vs_pa4 loso: cvt vs mobilevit vs vit (ui)"
    assert run.data.tags["painvit.run_kind"] == "comparison"
    assert run.data.params["parent_run_id.vit"] == result["parent_run_ids"]["vit"]


def shown(value: float) -> float:
    """A figure with the four significant digits the metrics keep."""
    return float(f"{value:.4g}")


def test_each_pair_s_headline_figures_are_metrics_equal_to_the_table(compared) -> None:
    client, result = compared["client"], compared["first"]
    metrics = client.get_run(result["run_id"]).data.metrics
    primary = result["subjects_paired"][result["subjects_paired"]["primary"]]
    assert len(primary) == 3
    for row in primary.itertuples():
        pair = f"{row.model_a}-{row.model_b}"
        assert metrics[f"{pair}/diff"] == shown(row.mean_diff)
        assert metrics[f"{pair}/diff_ci_low"] == shown(row.diff_ci95_low)
        assert metrics[f"{pair}/diff_ci_high"] == shown(row.diff_ci95_high)
        assert metrics[f"{pair}/p"] == shown(row.p_value)
        assert metrics[f"{pair}/p_holm"] == shown(row.p_holm)
        assert metrics[f"{pair}/mde80"] == shown(row.mde80)
    secondary = result["subjects_paired"][~result["subjects_paired"]["primary"]].iloc[0]
    assert metrics[f"{secondary.model_a}-{secondary.model_b}/{secondary.metric}/diff"] == shown(secondary.mean_diff)
    # Holm's family is the primary metric's tests alone: no secondary metric carries a corrected p-value
    assert not [name for name in metrics if name.count("/") == 2 and name.endswith("/p_holm")]
    subjects = result["subjects"].set_index(["model", "metric"])
    assert metrics["vit/accuracy_at_threshold"] == shown(subjects.loc[("vit", "accuracy_at_threshold"), "value"])


def test_the_description_holds_the_pairs_table_and_each_cv(compared) -> None:
    client, result = compared["client"], compared["first"]
    text = client.get_run(result["run_id"]).data.tags[tracking.NOTE_TAG]
    assert text.startswith("### Comparison: bl1_vs_pa4 loso: cvt vs mobilevit vs vit")
    header = next(line for line in text.splitlines() if line.startswith("| pair (a - b)"))
    for column in ("difference [95 % CI]", "| p |", "p_holm", "mde80"):
        assert column in header, header
    row = result["subjects_paired"][result["subjects_paired"]["primary"]].iloc[0]
    line = next(line for line in text.splitlines()
                if line.startswith(f"| {row.model_a} - {row.model_b} | **{row.metric}** |"))
    assert f"{row.mean_diff:+.3f} [{row.diff_ci95_low:.3f}, {row.diff_ci95_high:.3f}]" in line
    unit = next(column for column in ("unit", "interval") if column in result["subjects_paired"].columns)
    assert f"unit resampled: {result['subjects_paired'][unit].iloc[0]}" in text
    for model, run_id in result["parent_run_ids"].items():
        assert any(line.startswith(f"| {model} |") and run_id in line for line in text.splitlines())


def test_the_plots_come_first_among_the_artifacts(compared) -> None:
    client, result = compared["client"], compared["first"]
    names = [item.path for item in client.list_artifacts(result["run_id"])]
    assert not any(item.is_dir for item in client.list_artifacts(result["run_id"]))  # the UI lists folders first
    assert names[:3] == ["plot_1_subjects.png", "plot_2_accuracy_vs_cost.png", "plot_3_reliability.png"] or \
        names[:2] == ["plot_1_subjects.png", "plot_2_reliability.png"]  # no cost plot without MACs
    plots = [name for name in names if name.endswith(".png")]
    assert names[:len(plots)] == plots and "plot_folds_test_video_auroc.png" in plots
    assert {"table_subjects_paired.csv", "table_summary.csv", "table_paired.csv"} <= set(names[len(plots):])
    paired = Path(client.download_artifacts(result["run_id"], "table_subjects_paired.csv"))
    assert pd.read_csv(paired)["mean_diff"].tolist() == pytest.approx(result["subjects_paired"]["mean_diff"].tolist())


def test_the_comparisons_view_shows_every_pair_s_columns(compared) -> None:
    client = compared["client"]
    run = client.get_run(compared["second"]["run_id"])
    envelope = json.loads(client.get_experiment(run.info.experiment_id).tags[VIEW_TAG])
    assert envelope["name"] == tracking.HEADLINE_VIEW_NAME
    view = json.loads(envelope["state"])
    pairs = ["cvt-mobilevit", "cvt-vit", "mobilevit-vit", "swin-vit"]  # the second comparison's pair added
    assert view["selectedColumns"] == [f"metrics.`{pair}/{name}`" for pair in pairs for name in HEADLINE_PAIR_METRICS]
    assert view["columnOrder"] == [tracking.RUN_NAME_COLUMN, *view["selectedColumns"]]
    assert all(view["columnWidths"][column] >= 7 * len(column.split("`")[1]) for column in view["columnOrder"])
    assert pd.notna(run.data.metrics["swin-vit/p_holm"])
