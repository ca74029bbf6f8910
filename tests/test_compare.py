"""Backbone comparison against a real sqlite MLflow store holding hand-made CV parent and fold runs."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from scipy import stats

from pipeline.analysis.compare import DEFAULT_METRICS, compare
from pipeline.analysis.comparison_report import cost_lines, plot_fold_scores
from pipeline.analysis.comparison_runs import (
    INSPECT_METHODS,
    ComparisonError,
    check_same_folds,
    comparability_problems,
    fold_scores,
)
from pipeline.analysis.comparison_statistics import paired_tests, summary_table
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import latest_finished_cvs

EXPERIMENT = "pain-cv-test"
N_FOLDS = 5
SHA = "a" * 64
MAIN = {"dataset": "synthetic", "protocol": "loso", "task": "bl1_vs_pa4", "subject_set": "all"}


def make_cv(
    client: MlflowClient,
    experiment_id: str,
    model: str,
    scores: dict[str, np.ndarray],
    start_time: int,
    status: str = "FINISHED",
    sha: str = SHA,
    skip: tuple[tuple[int, str], ...] = (),
    params: dict[str, str] | None = None,
    extra_tags: dict[str, str] | None = None,
    **where: str,
) -> str:
    """A parent CV run and one child per fold, with the tags and metrics the CV driver writes."""
    where = {**MAIN, **where}
    shared_tags = {"model": model, **{key: where[key] for key in ("dataset", "protocol", "task")}}
    parent = client.create_run(
        experiment_id,
        start_time=start_time,
        tags={
            "painvit.run_kind": "cv",
            **shared_tags,
            "subject_set": where["subject_set"],
            "seed": "0",
            "git_commit": "deadbeef",
            "weights_source": "random",
            "fold_file_sha256": sha,
            **(extra_tags or {}),
        },
    )
    parent_id = parent.info.run_id
    for key, value in (params or {}).items():
        client.log_param(parent_id, key, value)
    for fold in range(N_FOLDS):
        child = client.create_run(
            experiment_id,
            start_time=start_time + 1 + fold,
            tags={"painvit.run_kind": "fold", "mlflow.parentRunId": parent_id, "fold": str(fold), **shared_tags},
        )
        metrics = [
            Metric(name, float(values[fold]), start_time, 0)
            for name, values in scores.items()
            if (fold, name) not in skip
        ]
        client.log_batch(child.info.run_id, metrics=metrics)
        client.set_terminated(child.info.run_id, "FINISHED", end_time=start_time + 100)
    if status != "RUNNING":
        client.set_terminated(parent_id, status, end_time=start_time + 200)
    return parent_id


def random_scores(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: np.round(rng.uniform(0.5, 0.9, N_FOLDS), 4) for name in DEFAULT_METRICS}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """One sqlite store for the module: creating it costs seconds."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = tracking.get_or_create_experiment(EXPERIMENT, root / "artifacts", client=client)

    scores = {"vit": random_scores(1), "cvt": random_scores(2), "mobilevit": random_scores(3)}
    # Equal frame F1 for vit and mobilevit: every paired difference is zero.
    scores["mobilevit"]["test/frame_f1"] = scores["vit"]["test/frame_f1"].copy()
    ids = {
        "vit_old": make_cv(client, experiment_id, "vit", random_scores(10), start_time=1_000),
        "vit": make_cv(client, experiment_id, "vit", scores["vit"], start_time=2_000),
        "cvt": make_cv(client, experiment_id, "cvt", scores["cvt"], start_time=1_500, skip=((3, "test/frame_auroc"),)),
        "cvt_running": make_cv(client, experiment_id, "cvt", random_scores(11), start_time=3_000, status="RUNNING"),
        "mobilevit": make_cv(client, experiment_id, "mobilevit", scores["mobilevit"], start_time=1_800),
        "mobilevit_failed": make_cv(
            client, experiment_id, "mobilevit", random_scores(12), start_time=3_100, status="FAILED"
        ),
        "other_task": make_cv(client, experiment_id, "swin", random_scores(13), start_time=2_500, task="five_class"),
    }
    # A rerun of vit's fold 2 that failed, started after the finished one: it must not count.
    failed_child = client.create_run(
        experiment_id,
        start_time=2_900,
        tags={"painvit.run_kind": "fold", "mlflow.parentRunId": ids["vit"], "fold": "2", "model": "vit", **MAIN},
    )
    client.log_batch(failed_child.info.run_id, metrics=[Metric("test/video_auroc", 0.01, 2_900, 0)])
    client.set_terminated(failed_child.info.run_id, "FAILED")

    make_cv(client, experiment_id, "vit", random_scores(20), start_time=4_000, dataset="mismatch")
    make_cv(client, experiment_id, "cvt", random_scores(21), start_time=4_000, dataset="mismatch", sha="b" * 64)
    make_cv(client, experiment_id, "vit", random_scores(22), start_time=4_000, dataset="lonely")
    return {"uri": uri, "client": client, "experiment_id": experiment_id, "root": root, "scores": scores, "ids": ids}


def test_latest_finished_cv_per_model(store) -> None:
    client, ids = store["client"], store["ids"]
    runs = latest_finished_cvs(client, [store["experiment_id"]], "synthetic", "loso", "bl1_vs_pa4")
    assert {model: run.info.run_id for model, run in runs.items()} == {
        "cvt": ids["cvt"],
        "mobilevit": ids["mobilevit"],
        "vit": ids["vit"],
    }
    assert latest_finished_cvs(client, [store["experiment_id"]], "synthetic", "loso", "bl1_vs_pa4",
                               subject_set="67") == {}


def test_fold_scores_read_children(store) -> None:
    client = store["client"]
    parent = client.get_run(store["ids"]["vit"])
    table = fold_scores(client, parent, ["test/video_auroc", "test/frame_f1"])
    assert list(table.columns) == ["fold", "model", "test/video_auroc", "test/frame_f1"]
    assert table["fold"].tolist() == list(range(N_FOLDS))
    assert (table["model"] == "vit").all()
    np.testing.assert_allclose(table["test/video_auroc"], store["scores"]["vit"]["test/video_auroc"])
    cvt = fold_scores(client, client.get_run(store["ids"]["cvt"]), ["test/frame_auroc"])
    assert math.isnan(cvt.loc[cvt["fold"] == 3, "test/frame_auroc"].item())


def test_compare_writes_tables_plots_and_run(store, tmp_path) -> None:
    result = compare("synthetic", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    scores, models = store["scores"], ["cvt", "mobilevit", "vit"]

    summary = pd.read_csv(tmp_path / "comparison_synthetic_loso_bl1_vs_pa4.csv")
    assert len(summary) == len(models) * len(DEFAULT_METRICS)
    for model in models:
        for metric in DEFAULT_METRICS:
            values = scores[model][metric]
            if model == "cvt" and metric == "test/frame_auroc":
                values = np.delete(values, 3)
            row = summary[(summary["model"] == model) & (summary["metric"] == metric)].iloc[0]
            assert row["n_folds"] == len(values)
            assert row["mean"] == pytest.approx(np.mean(values))
            assert row["std"] == pytest.approx(np.std(values, ddof=1))
    assert "ci95_low" not in summary.columns  # no t-interval over folds that share training subjects

    paired = pd.read_csv(
        tmp_path / "comparison_synthetic_loso_bl1_vs_pa4_paired.csv", keep_default_na=False, na_values=[""]
    )
    assert len(paired) == 3 * len(DEFAULT_METRICS)
    row = paired[
        (paired["metric"] == "test/video_auroc") & (paired["model_a"] == "mobilevit") & (paired["model_b"] == "vit")
    ].iloc[0]
    differences = scores["mobilevit"]["test/video_auroc"] - scores["vit"]["test/video_auroc"]
    assert row["mean_diff"] == pytest.approx(differences.mean())
    assert row["std_diff"] == pytest.approx(differences.std(ddof=1))
    # five folds are described, never reported as a test: the note says why none can reach 0.05
    assert "p_value" not in paired.columns
    assert "2/2^5 = 0.0625" in row["note"] and stats.wilcoxon(differences).pvalue >= 0.0625
    assert result["subjects"] is None  # the hand-made runs logged no pooled videos
    missing_fold = paired[
        (paired["metric"] == "test/frame_auroc") & (paired["model_a"] == "cvt") & (paired["model_b"] == "vit")
    ].iloc[0]
    assert missing_fold["n_folds"] == N_FOLDS - 1

    folds = pd.read_csv(tmp_path / "comparison_synthetic_loso_bl1_vs_pa4_folds.csv")
    assert sorted(folds["model"].unique()) == models and len(folds) == len(models) * N_FOLDS
    plot = tmp_path / "comparison_synthetic_loso_bl1_vs_pa4_test_video_auroc.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(plot).ndim == 3
    assert set(result["paths"]["plots"]) == set(DEFAULT_METRICS)
    assert all(path.exists() for path in result["paths"]["plots"].values())

    client = store["client"]
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["painvit.run_kind"] == "comparison"
    assert run.data.params["models"] == "cvt,mobilevit,vit"
    assert run.data.params["task"] == "bl1_vs_pa4"
    assert run.data.params["parent_run_id.vit"] == store["ids"]["vit"]
    logged = {item.path for item in client.list_artifacts(result["run_id"])}  # the files, under the run's names
    assert {"table_summary.csv", "table_paired.csv", "plot_folds_test_video_auroc.png"} <= logged
    # The comparison run is not itself a CV: a second comparison sees the same three backbones.
    again = latest_finished_cvs(client, [store["experiment_id"]], "synthetic", "loso", "bl1_vs_pa4")
    assert sorted(again) == models


def test_mismatched_fold_files_are_refused(store, tmp_path) -> None:
    with pytest.raises(ComparisonError, match=r"cvt: b{64}.*vit: a{64}"):
        compare("mismatch", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    assert not list(tmp_path.iterdir())


def test_fewer_than_two_backbones_is_a_clear_error(store, tmp_path) -> None:
    with pytest.raises(ComparisonError, match=r"at least 2 backbones.*found: vit \("):
        compare("lonely", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    with pytest.raises(ComparisonError, match="found: none"):
        compare("nothing", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    with pytest.raises(ComparisonError, match="no MLflow experiment"):
        compare("synthetic", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment="absent")


def test_check_same_folds_flags_unrecorded_hash(store) -> None:
    client = store["client"]
    runs = {"vit": client.get_run(store["ids"]["vit"]), "cvt": client.get_run(store["ids"]["cvt"])}
    check_same_folds(runs)
    client.delete_tag(store["ids"]["cvt_running"], "fold_file_sha256")
    runs["cvt"] = client.get_run(store["ids"]["cvt_running"])
    with pytest.raises(ComparisonError, match="cvt: <not recorded>"):
        check_same_folds(runs)


def test_paired_tests_edge_cases() -> None:
    scores = pd.DataFrame(
        {
            "fold": [0, 1, 2, 0, 1, 2, 0],
            "model": ["a", "a", "a", "b", "b", "b", "c"],
            "score": [0.7, 0.6, 0.8, 0.7, 0.6, 0.8, 0.5],
        }
    )
    table = paired_tests(scores, "score")
    assert list(zip(table["model_a"], table["model_b"], strict=True)) == [("a", "b"), ("a", "c"), ("b", "c")]
    identical = table.iloc[0]
    assert identical["mean_diff"] == 0 and "2/2^3 = 0.25" in identical["note"]
    single = table.iloc[1]
    assert single["n_folds"] == 1 and single["std_diff"] == 0
    assert single["mean_diff"] == pytest.approx(0.2)


def test_summary_with_one_fold() -> None:
    scores = pd.DataFrame({"fold": [0], "model": ["a"], "score": [0.6]})
    row = summary_table(scores, ["score"]).iloc[0]
    assert row["mean"] == pytest.approx(0.6) and row["std"] == 0 and row["n_folds"] == 1


def test_plot_fold_scores_png(tmp_path) -> None:
    rng = np.random.default_rng(0)
    scores = pd.DataFrame({"fold": list(range(4)) * 2, "model": ["a"] * 4 + ["b"] * 4, "score": rng.random(8)})
    plot_fold_scores(scores, "score", tmp_path / "plot.png")
    assert matplotlib.image.imread(tmp_path / "plot.png").shape[2] in (3, 4)


def test_tracking_uri_default_and_env(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking.artifact_root(tmp_path) == (tmp_path.resolve() / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/m.db")
    assert tracking.tracking_uri(tmp_path) == "sqlite:////elsewhere/m.db"


def test_get_or_create_experiment_is_idempotent_with_local_artifacts(store) -> None:
    client = store["client"]
    again = tracking.get_or_create_experiment(EXPERIMENT, store["root"] / "elsewhere", client=client)
    assert again == store["experiment_id"]
    experiment = client.get_experiment(again)
    assert experiment.artifact_location == (store["root"] / "artifacts").resolve().as_uri()
    client.delete_experiment(tracking.get_or_create_experiment("to-delete", store["root"] / "d", client=client))
    restored = tracking.get_or_create_experiment("to-delete", store["root"] / "d", client=client)
    assert client.get_experiment(restored).lifecycle_stage == "active"


def test_review_notebook_reads_the_same_runs_as_compare(store, tmp_path) -> None:
    """The review notebook, executed in a fresh kernel against the store: per-fold scores of the latest finished CV
    of each backbone (older, running and failed CVs left out), and one run's artifacts."""
    import io
    import os

    import nbformat
    from nbclient import NotebookClient

    from pipeline.utils.paths import PROJECT_ROOT

    client, ids = store["client"], store["ids"]
    (tmp_path / "accuracy_per_subject.csv").write_text("subject_name,accuracy\ns1,0.5\ns2,1.0\n")
    (tmp_path / "predictions_videos_all_folds.csv").write_text("sample_name,p_pain\nv1,0.3\n")
    for name in ("accuracy_per_subject.csv", "predictions_videos_all_folds.csv"):
        client.log_artifact(ids["cvt"], str(tmp_path / name))  # cvt comes first: the notebook details that run

    path = PROJECT_ROOT / "notebooks" / "review_cross_validation.ipynb"
    notebook = nbformat.read(path, as_version=4)
    # the hand-made runs log no parameters: any crops
    fold_file = tmp_path / "no_fold_file.csv"
    parameters = f'EXPERIMENT = "{EXPERIMENT}"\nPROTOCOL = "loso"\nFOLD_FILE = "{fold_file}"\nCROPS = None'
    notebook.cells.insert(2, nbformat.v4.new_code_cell(parameters))
    notebook.cells.append(nbformat.v4.new_code_cell("print(folds.to_json())\nprint(len(per_subject), len(videos))"))
    runner = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    runner.execute(env={**os.environ, "MLFLOW_TRACKING_URI": store["uri"], "OMP_NUM_THREADS": "1"})
    printed = "".join(out.get("text", "") for out in notebook.cells[-1].outputs if out.output_type == "stream")
    folds_json, counts = printed.strip().split("\n")
    folds = pd.read_json(io.StringIO(folds_json))
    assert sorted(folds.columns) == ["cvt", "mobilevit", "vit"]
    for model in ("cvt", "mobilevit", "vit"):
        np.testing.assert_allclose(folds[model].sort_index().to_numpy(), store["scores"][model]["test/video_auroc"])
    assert counts == "2 1"


def test_cost_axis_labels_use_si_units() -> None:
    from pipeline.analysis.comparison_report import _cost_formatter

    _si = _cost_formatter()
    assert [_si(v) for v in (4.94e6, 3.5e8, 1.7e10, 2_000.0, 12.0)] == ["4.94M", "350M", "17G", "2k", "12"]


def test_only_cvs_on_the_same_crops_are_compared(store) -> None:
    """A backbone last run on other crops (here: square Haar crops) falls back to its latest CV on the asked-for
    crops; a backbone with none is missing rather than compared on other inputs."""
    client, experiment_id = store["client"], store["experiment_id"]
    aligned = {"preprocess.detector": "mtcnn", "preprocess.align": "True"}
    square = {"preprocess.detector": "haar", "preprocess.align": "False"}
    runs = {}
    for name, model, start, params in [("vit", "vit", 5_000, aligned), ("cvt", "cvt", 5_100, aligned),
                                       ("cvt_square", "cvt", 5_200, square), ("mobilevit", "mobilevit", 5_300, square)]:
        runs[name] = make_cv(client, experiment_id, model, random_scores(30), start_time=start, dataset="crops")
        for key, value in params.items():
            client.log_param(runs[name], key, value)
    latest = latest_finished_cvs(client, [experiment_id], "crops", "loso", "bl1_vs_pa4", params=aligned)
    assert {model: run.info.run_id for model, run in latest.items()} == {"vit": runs["vit"], "cvt": runs["cvt"]}
    unfiltered = latest_finished_cvs(client, [experiment_id], "crops", "loso", "bl1_vs_pa4")
    assert unfiltered["cvt"].info.run_id == runs["cvt_square"] and "mobilevit" in unfiltered


def test_crop_settings_name_the_twin_look_detector_and_alignment() -> None:
    from pipeline.runs.store.cv_runs import CvConfig, crop_settings
    from pipeline.utils.config import load_config

    settings = crop_settings(CvConfig.from_config(load_config(["data.align_faces=false"])))
    assert settings["preprocess.detector"] == "mtcnn" and settings["preprocess.align"] == "False"
    assert settings["data.synthetic.difficulty"] == "hard"
    assert not any("workers" in key or "device" in key for key in settings)  # how fast, not what was made
    # every backbone's specialisation (configs/data_model/) keeps the crops, so `make compare` finds all of them
    from pipeline.utils.paths import PROJECT_ROOT

    models = sorted(path.stem for path in (PROJECT_ROOT / "configs" / "model").glob("*.yaml") if path.stem != "timm")
    assert len(models) >= 7
    for data in ("synthetic", "biovid"):
        expected = crop_settings(CvConfig.from_config(load_config([f"data={data}"])))
        for model in models:
            cv = CvConfig.from_config(load_config([f"data={data}", f"model={model}"]))
            assert crop_settings(cv) == expected, (data, model)


def test_a_youden_cv_is_not_compared_with_a_fixed_threshold_cv(store, tmp_path) -> None:
    """Two CVs that decide their test videos differently: refused, naming eval.threshold and both values."""
    client, experiment_id = store["client"], store["experiment_id"]
    make_cv(client, experiment_id, "vit", random_scores(30), 5_000, dataset="rules",
            params={"eval.threshold": "youden"})
    make_cv(client, experiment_id, "cvt", random_scores(31), 5_000, dataset="rules", params={"eval.threshold": "0.5"})
    with pytest.raises(ComparisonError, match=r"eval\.threshold differs \(cvt: 0\.5; vit: youden\)"):
        compare("rules", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    # named as allowed, it is compared and the difference recorded
    result = compare("rules", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT,
                     allow_differences=["eval.threshold"])
    assert result["differences"] == ["eval.threshold differs (cvt: 0.5; vit: youden)"]
    assert "eval.threshold" in client.get_run(result["run_id"]).data.tags["compared_despite"]


def test_seeds_aggregation_and_incomplete_cvs_are_refused_unless_a_smoke_comparison(store, tmp_path) -> None:
    client, experiment_id = store["client"], store["experiment_id"]
    make_cv(client, experiment_id, "vit", random_scores(32), 5_000, dataset="seeds",
            params={"cv.seeds": "[0, 1]", "trainer.aggregation": "mean"})
    make_cv(client, experiment_id, "cvt", random_scores(33), 5_000, dataset="seeds",
            params={"trainer.aggregation": "max"})
    with pytest.raises(ComparisonError) as refused:
        compare("seeds", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    assert "cv.seeds differs (cvt: (not set); vit: [0, 1])" in str(refused.value)
    assert "trainer.aggregation differs (cvt: max; vit: mean)" in str(refused.value)

    make_cv(client, experiment_id, "vit", random_scores(34), 5_000, dataset="smoke", extra_tags={"complete": "false"})
    make_cv(client, experiment_id, "cvt", random_scores(35), 5_000, dataset="smoke")
    with pytest.raises(ComparisonError, match="incomplete CVs .*: vit; .*compare.allow_incomplete=true"):
        compare("smoke", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    smoke = compare("smoke", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT,
                    allow_incomplete=True)
    assert smoke["complete"] == {"cvt": True, "vit": False}
    assert client.get_run(smoke["run_id"]).data.tags["complete"] == "false"


def test_the_cost_table_keeps_its_columns_under_long_labels() -> None:
    """Labels that name a strategy and a weights file are longer than a backbone's name; the numbers stay in columns."""
    nan = float("nan")
    regions = {f"{kind}region_{method}_{stat}": nan for kind in ("", "untrained_") for method in INSPECT_METHODS
               for stat in ("mean", "std")}
    costs = pd.DataFrame([{"model": label, "test/video_auroc_mean": 0.9, "test/video_auroc_std": 0.1,
                           "params": 4.94e6, "macs": 3.83e8, **regions}
                          for label in ("mobilevit_s", "mobilevit_s top_blocks2 weights 37921033")])
    header, *rows, _legend = cost_lines(costs).splitlines()
    assert len(rows) == 2
    for value in ("0.900", "4.94M", "0.383G"):
        assert len({row.index(value) for row in rows}) == 1, value
    assert all(row.index("0.900") > header.index("model") + len(costs["model"].iloc[1]) for row in rows)


MISSION_BACKBONES = ("vit_b16", "cvt_13", "mobilevit_s")


@pytest.mark.parametrize("dataset", ["synthetic", "biovid"])
def test_the_default_cvs_of_every_backbone_are_comparable(dataset: str, tmp_path: Path) -> None:
    """`make cv MODEL=<each>` with no ARGS, then `make compare`: the configs of every backbone of configs/model/ (and
    a timm name without a file) on one dataset log the same compared settings, so the comparison is not refused."""
    from pipeline.models.weights import RANDOM_INIT
    from pipeline.runs.store.cv_runs import CvConfig, planned_settings
    from pipeline.utils.config import CONFIG_DIR, load_config

    fold_file = tmp_path / "folds.csv"  # one fold file for all, as `make data` writes it once per dataset
    fold_file.write_text("fold,subject_name,role\n0,a,train\n0,b,val\n0,c,test\n")
    models = sorted(path.stem for path in (CONFIG_DIR / "model").glob("*.yaml") if path.stem != "timm")
    assert set(MISSION_BACKBONES) <= set(models)
    settings = {}
    for model in [*models, "resnet18"]:
        cfg = load_config([f"data={dataset}", f"model={model}"])  # resnet18: a timm name
        settings[model] = planned_settings(CvConfig.from_config(cfg), fold_file, RANDOM_INIT)
    assert comparability_problems(settings) == []
    # and the check does see a difference when one is there
    cfg = load_config([f"data={dataset}", "model=vit_b16", "loader.frames_per_video=1"])
    changed = {**settings, "vit_b16": planned_settings(CvConfig.from_config(cfg), fold_file, RANDOM_INIT)}
    assert [problem.split(" ")[0] for problem in comparability_problems(changed)] == ["loader.frames_per_video"]


def test_no_backbone_preset_sets_a_compared_setting() -> None:
    """configs/data_model/ sizes a backbone for a dataset; the settings `make compare` checks belong to the dataset
    (data.loader) or to config.yaml, never to one backbone's preset."""
    from omegaconf import OmegaConf

    from pipeline.analysis.comparison_runs import SAME_PARAMS
    from pipeline.utils.config import CONFIG_DIR

    for path in sorted((CONFIG_DIR / "data_model").glob("*.yaml")):
        flat = pd.json_normalize(OmegaConf.to_container(OmegaConf.load(path)), sep=".").columns
        assert not set(flat) & set(SAME_PARAMS), f"{path.name} sets {sorted(set(flat) & set(SAME_PARAMS))}"


def pooled_video_table(seed: int, drop_reference: bool) -> pd.DataFrame:
    """A CV's pooled test videos: 6 subjects, 2 BL1 and 2 PA4 videos each; a baseline_k1 CV's first BL1 video of
    each subject was its reference and is not among them."""
    rng = np.random.default_rng(seed)
    rows = []
    for subject in range(6):
        for index, label in enumerate((0, 0, 1, 1)):
            if drop_reference and index == 0:
                continue
            pain = float(np.clip(0.5 + 0.3 * (label - 0.5) + rng.normal(0, 0.2), 0.01, 0.99))
            rows.append({"subject_name": f"s{subject}", "sample_name": f"s{subject}-v{index}", "label": label,
                         "prob_BL1": 1 - pain, "prob_PA4": pain, "decision": int(pain >= 0.5), "threshold": 0.5})
    return pd.DataFrame(rows)


def test_a_personalised_cv_is_refused_against_a_plain_one_and_paired_on_the_common_videos_when_allowed(
        store, tmp_path) -> None:
    """personalise.mode differs: refused by name; allowed (compare.allow_differences=[personalise]): both CVs are
    paired on the videos both tested (the baseline CV's references left out of the plain one too), said and logged."""
    client, experiment_id = store["client"], store["experiment_id"]
    plain = make_cv(client, experiment_id, "vit", random_scores(40), 6_000, dataset="personal")
    personal = make_cv(client, experiment_id, "vit", random_scores(41), 6_000, dataset="personal",
                       params={"personalise.mode": "baseline", "personalise.k": "1", "personalise.seed": "0"},
                       extra_tags={"personalise": "baseline_k1"})
    for run_id, drop in ((plain, False), (personal, True)):
        path = tmp_path / run_id / "predictions_videos_all_folds.csv"
        path.parent.mkdir()
        pooled_video_table(len(run_id), drop).to_csv(path, index=False)
        client.log_artifact(run_id, str(path))
    with pytest.raises(ComparisonError, match=r"personalise\.mode differs \(vit: \(not set\); vit baseline_k1: "
                                              r"baseline\)") as refused:
        compare("personal", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    assert "personalise.k differs" in str(refused.value)
    result = compare("personal", "loso", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT,
                     allow_differences=["personalise"])
    assert set(result["parent_run_ids"]) == {"vit", "vit baseline_k1"}  # the protocol is part of the label
    record = result["common_videos"].set_index("cv")
    assert record.loc["vit", "n_videos"] == 24 and record.loc["vit baseline_k1", "n_videos"] == 18
    assert (record["n_common_videos"] == 18).all() and record.loc["vit", "n_dropped_videos"] == 6
    assert (result["subjects"]["n_subjects"] == 6).all()
    tags = client.get_run(result["run_id"]).data.tags
    assert "personalise.mode differs" in tags["compared_despite"]
    assert "vit: 18 of its 24 tested videos (6 dropped)" in tags["paired_on"]
    assert pd.read_csv(result["paths"]["common_videos"]).shape[0] == 2


def test_the_output_and_protocol_name_a_cv_and_a_config() -> None:
    from pipeline.runs.store.cv_runs import CvConfig, config_label, cv_label
    from pipeline.utils.config import load_config

    assert cv_label({"model": "mobilevit_s"}) == "mobilevit_s"  # a run from before the tags: softmax, none
    assert cv_label({"model": "mobilevit_s", "output": "softmax", "personalise": "none"}) == "mobilevit_s"
    assert cv_label({"model": "mobilevit_s", "output": "ordinal_coral"}) == "mobilevit_s ordinal_coral"
    assert cv_label({"model": "mobilevit_s", "personalise": "baseline_k2"}) == "mobilevit_s baseline_k2"
    def label(*overrides: str) -> str:
        return config_label(CvConfig.from_config(load_config(list(overrides))))

    assert label("model=mobilevit_s") == "mobilevit_s"
    assert label("model=mobilevit_s", "model/output=ordinal") == "mobilevit_s ordinal_coral"
    assert label("model=mobilevit_s", "personalise=baseline", "personalise.k=2") == "mobilevit_s baseline_k2"


def five_class_videos(seed: int) -> pd.DataFrame:
    """A five-class CV's pooled test videos: 6 subjects, one video per level, called within a level or two."""
    rng = np.random.default_rng(seed)
    rows = []
    for subject in range(6):
        for level in range(5):
            called = int(np.clip(level + rng.integers(-2, 3), 0, 4))
            probs = np.full(5, 0.05)
            probs[called] = 0.8
            rows.append({"subject_name": f"s{subject}", "sample_name": f"s{subject}-l{level}", "label": level,
                         **{f"prob_{name}": p for name, p in zip(("BL1", "PA1", "PA2", "PA3", "PA4"), probs,
                                                                   strict=True)},
                         "pred": called, "decision": called})
    return pd.DataFrame(rows)


def test_compare_pairs_on_a_graded_metric_when_asked(store, tmp_path) -> None:
    """compare.metric=mae: each subject's MAE over levels joins the subject tests as the primary metric; the
    default comparison's family is unchanged (no mae row); an unknown metric is refused, listing the choices."""
    client, experiment_id = store["client"], store["experiment_id"]
    tables = {}
    for model, seed in (("vit", 50), ("cvt", 51)):
        run_id = make_cv(client, experiment_id, model, random_scores(seed), 7_000, dataset="graded",
                         task="five_class")
        path = tmp_path / run_id / "predictions_videos_all_folds.csv"
        path.parent.mkdir()
        tables[model] = five_class_videos(seed)
        tables[model].to_csv(path, index=False)
        client.log_artifact(run_id, str(path))
    where = ("graded", "loso", "five_class", tmp_path)
    plain = compare(*where, tracking_uri=store["uri"], experiment=EXPERIMENT)
    assert "mae" not in set(plain["subjects_paired"]["metric"])
    graded = compare(*where, tracking_uri=store["uri"], experiment=EXPERIMENT, primary="mae")
    paired = graded["subjects_paired"]
    assert paired.loc[paired["primary"], "metric"].tolist() == ["mae"]
    assert len(paired) == len(plain["subjects_paired"]) + 1  # the graded metric joins the tests, as the primary
    subjects = graded["subjects"].set_index(["model", "metric"])
    for model, table in tables.items():
        assert subjects.loc[(model, "mae"), "value"] == pytest.approx((table["label"] - table["decision"]).abs().mean())
    per_subject = {model: (table["label"] - table["decision"]).abs().groupby(table["subject_name"]).mean()
                   for model, table in tables.items()}
    mae = paired.set_index("metric").loc["mae"]
    assert mae["mean_diff"] == pytest.approx((per_subject[mae["model_a"]] - per_subject[mae["model_b"]]).mean())
    family = client.get_run(graded["run_id"]).data.tags["correction_family"]
    assert "Holm over 1 test(s): the primary metric mae" in family
    with pytest.raises(ComparisonError, match="compare.metric='kappa': expected one of accuracy_at_threshold"):
        compare(*where, tracking_uri=store["uri"], experiment=EXPERIMENT, primary="kappa")


def kfold_videos(seed: int, shift: float, with_fold: bool = True) -> pd.DataFrame:
    """A kfold5 CV's pooled test videos: 15 subjects, three a fold, 2 BL1 and 2 PA4 videos each (balanced), each
    fold's model shifting the pain probability of all of its subjects by a draw of its own (and `shift`)."""
    rng = np.random.default_rng(seed)
    fold_shift = rng.normal(shift, 0.1, 5)
    rows = []
    for subject in range(15):
        for index, label in enumerate((0, 0, 1, 1)):
            pain = float(np.clip(0.5 + 0.4 * (label - 0.5) + fold_shift[subject // 3] + rng.normal(0, 0.2), 0, 1))
            rows.append({"subject_name": f"s{subject:02d}", "sample_name": f"s{subject}-v{index}", "label": label,
                         "prob_BL1": 1 - pain, "prob_PA4": pain, "decision": int(pain >= 0.5), "threshold": 0.5,
                         **({"fold": subject // 3} if with_fold else {})})
    return pd.DataFrame(rows)


def test_one_primary_test_a_pair_corrected_the_secondary_beside_it_and_the_unit_said(store, tmp_path, capsys) -> None:
    """Three kfold5 CVs: Holm runs over the three pairs' primary tests alone ("Holm over 3"); the within-subject
    AUROC is reported beside them uncorrected; balanced accuracy at the threshold, on every subject the same number as
    the accuracy (balanced videos), is not tested twice. Each test groups the subjects by the fold that tested them,
    its p-value and interval from one t statistic (the interval excludes 0 exactly when p < 0.05); the unit is in
    the table, the printed report and the run's tag. A CV logged before its videos carried their fold is grouped the
    same way from the fold file's subjects (`test_folds`)."""
    from pipeline.analysis.comparison_report import print_report
    from pipeline.evaluation.statistics import holm, paired_test, subject_scores

    client, experiment_id = store["client"], store["experiment_id"]
    tables = {}
    for model, seed, shift in (("vit", 60, 0.1), ("cvt", 61, 0.0), ("mobilevit", 62, -0.05)):
        run_id = make_cv(client, experiment_id, model, random_scores(seed), 8_000, dataset="family",
                         protocol="kfold5")
        path = tmp_path / run_id / "predictions_videos_all_folds.csv"
        path.parent.mkdir()
        tables[model] = kfold_videos(seed, shift)
        tables[model].to_csv(path, index=False)
        client.log_artifact(run_id, str(path))
    result = compare("family", "kfold5", "bl1_vs_pa4", tmp_path, tracking_uri=store["uri"], experiment=EXPERIMENT)
    paired = result["subjects_paired"]
    primary = paired[paired["primary"]]
    assert len(primary) == 3 and set(primary["metric"]) == {"accuracy_at_threshold"}
    np.testing.assert_allclose(primary["p_holm"], holm(primary["p_value"].to_numpy()))
    secondary = paired[~paired["primary"]].set_index("metric")
    assert secondary["p_holm"].isna().all()
    assert (secondary.loc["within_subject_auroc", "family"] == "secondary: not corrected").all()
    repeated = secondary.loc["balanced_accuracy_at_threshold"]
    assert repeated["p_value"].isna().all() and repeated["family"].str.contains(
        "same number as accuracy_at_threshold").all()
    assert (paired["unit"] == "fold (5 folds: each fold's test subjects share its trained models)").all()
    row = primary.set_index(["model_a", "model_b"]).loc[("cvt", "vit")]
    accuracy = {m: subject_scores(t, ("BL1", "PA4")).set_index("subject_name")["accuracy_at_threshold"]
                for m, t in tables.items()}
    expected = paired_test((accuracy["cvt"] - accuracy["vit"]).to_numpy(), np.arange(15) // 3)
    assert (row["p_value"], row["diff_ci95_low"], row["diff_ci95_high"], row["n_units"]) == pytest.approx(
        (expected.p_value, expected.ci95_low, expected.ci95_high, 5))
    for r in paired.dropna(subset=["p_value"]).itertuples():
        assert (r.diff_ci95_low > 0 or r.diff_ci95_high < 0) == (r.p_value < 0.05)
    tags = client.get_run(result["run_id"]).data.tags
    assert tags["correction_family"].startswith("Holm over 3 test(s): the primary metric accuracy_at_threshold")
    assert "not tested twice (on every subject the same number as another): balanced_accuracy_at_threshold = " \
           "accuracy_at_threshold" in tags["correction_family"]
    assert tags[tracking.TEST_UNIT_TAG] == "fold (5 folds: each fold's test subjects share its trained models)"
    capsys.readouterr()
    print_report(result)
    out = capsys.readouterr().out
    assert "Holm over 3 test(s)" in out and "one t-test over fold (5 folds" in out and "in 5 units)" in out
    written = pd.read_csv(result["paths"]["subjects_paired"])
    assert {"unit", "n_units", "family"} <= set(written.columns)

    older = {model: table.drop(columns="fold") for model, table in tables.items()}
    from pipeline.analysis.comparison_statistics import subject_tables

    _, _, without = subject_tables(older)
    assert without["unit"].str.startswith("subject (folds unknown").all()
    _, _, from_file = subject_tables(older, test_folds={f"s{s:02d}": s // 3 for s in range(15)})
    pd.testing.assert_frame_equal(from_file, paired.reset_index(drop=True))
