"""Shared fixtures: one tiny synthetic twin in BioVid's layout, generated and preprocessed once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.utils.config import load_config
from pipeline.utils.permissions import private_umask

# What the tests create in this process (stores, crops, runs) is made as every command of the project makes it (the
# CLI sets umask 077): a command that a test then starts over those folders would refuse them otherwise.
private_umask()


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test`'s workers (pytest-xdist, `-n 2`): one torch thread in each worker process, so the two
    workers share the two cores rather than four threads fighting for them; and one OpenMP thread in every program a
    test starts (`pipeline cv`, fold jobs, make, SLURM jobs: they inherit the environment), which runs on its
    worker's share too. A second OpenMP thread that waits for a core the other worker holds makes every tensor call
    wait for it: a tiny model's training step measured 30 ms with one thread and 1-2 s with two on a busy 2-core
    machine. What a program sets for itself still wins (a job slot's OMP_NUM_THREADS, SLURM_CPUS_PER_TASK)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
    if getattr(config.option, "loadgroup", False):
        config.pluginmanager.register(GroupsInNodeIds(), "painvit-xdist-groups")


class GroupsInNodeIds:
    """`--dist loadgroup` tells the scheduler a test's group by a suffix of its node id (`<id>@<group>`), which
    pytest-xdist 3.8's worker writes to `item._nodeid`. pytest 9.2 keeps the id in `item._id` (a NodeId) and no
    longer reads `_nodeid`: the suffix is lost and every group silently falls apart, its tests spread over both
    workers (pytest-xdist issue 1386). This writes the suffix where pytest keeps the id, after xdist's own hook, for
    the items whose id still lacks it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        from _pytest.nodeid import NodeId

        for item in items:
            names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                     for mark in item.iter_markers("xdist_group")}
            suffix = "@" + "_".join(sorted(names))
            if names and not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), NodeId):
                item._id = NodeId.parse(item.nodeid + suffix)


# The longest tests that are scheduled one by one (`make test`, measured with --durations), longest first: started
# first, they run beside the rest, where one started last would hold up the end of the run while the other worker
# idles. An order only: a test missing here (renamed, new) still runs, in its place among the others.
LONG_FIRST = (
    "tests/test_server_restart.py::test_a_server_killed_mid_cv_and_started_again_loses_no_fold",
    "tests/test_side_by_side.py::test_two_strategies_of_one_backbone_run_at_once_and_an_identical_cv_refuses",
    "tests/test_launchers.py::test_kill_9_at_two_points_then_resume_gives_the_uninterrupted_results",
    "tests/test_launchers.py::test_a_parallel_worker_trains_fold_after_fold_and_a_killed_one_resumes_exactly",
    "tests/test_server_restart.py::test_a_server_that_stays_away_stops_the_job_and_the_driver_with_one_line",
    "tests/test_postgres_store.py::test_a_parallel_cv_through_make_server_on_postgresql_and_no_password_anywhere",
    "tests/test_launchers.py::test_a_two_stage_fold_killed_in_its_second_stage_resumes_with_the_uninterrupted_results",
    "tests/test_fold_lease.py::test_a_job_whose_fold_is_taken_over_stops_and_does_not_finish_its_run",
    "tests/test_fold_lease.py::test_two_make_cv_at_once_through_one_server_train_every_fold_once",
    "tests/test_tuning.py::test_two_parallel_workers_share_one_study_without_a_lost_trial",
    "tests/test_launchers.py::test_parallel_runs_two_folds_at_once_through_a_server",
    "tests/test_launchers.py::test_the_cvs_of_one_command_share_one_server_and_one_worker",
    "tests/test_gpu_check.py::test_every_step_runs_on_the_cpu_at_test_sizes_and_writes_its_figures",
    "tests/test_accelerator.py::test_make_cv_with_accelerator_gpu_and_no_gpu_stops_before_training",
    "tests/test_lock.py::test_loading_and_scoring_a_served_model_imports_only_what_the_serving_lock_holds",
    "tests/test_model_trust.py::test_make_serve_refuses_a_changed_model_before_loading_it",
    "tests/test_power.py::test_make_power_repeats_a_comparison_over_twins_and_resumes",
    "tests/test_power.py::test_make_power_aa_resamples_a_population_onto_the_fold_files_slots_and_resumes",
    "tests/test_store_open.py::test_processes_opening_a_fresh_sqlite_store_at_once_all_succeed",
    "tests/test_tracking.py::test_make_ui_asks_for_a_password_made_for_it",
    "tests/test_bench.py::test_bench_data_quick",
    "tests/test_tuning.py::test_a_killed_search_resumes_and_the_study_never_sees_test_subjects",
    "tests/test_cli.py::test_data_command_on_a_fresh_folder",
    "tests/test_cv.py::test_the_three_default_cvs_then_compare_need_no_args",
    "tests/test_model_trust.py::test_mlflow_models_serve_of_a_model_with_a_code_path_does_not_start",
    "tests/test_results_table.py::test_table_has_five_task_rows_and_the_published_ones_apart",
    "tests/test_fidelity.py::test_the_calibrated_twin_keeps_the_published_curve",
)


@pytest.hookimpl(tryfirst=True)  # the marks in place before any other hook (xdist's worker) reads them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How `make test`'s two workers (`--dist loadgroup`) share the tests. Every test that uses the real SLURM
    cluster (or starts one of its own) runs on one worker: one session cluster, started once, and never two clusters
    starting side by side. The tests of a module that share a fixture of that module's own (module or session
    scope: a trained CV, a model chain, a server) run on one worker too, so that it is made once, not once on each
    worker. The rest go one at a time to whichever worker is free, the longest first (LONG_FIRST)."""
    users: dict[str, list[pytest.Item]] = {}
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) or item.path.name == "test_slurm_cluster.py":
            item.add_marker(pytest.mark.xdist_group("slurm"))
            continue
        for name in own_shared_fixtures(item):
            users.setdefault(f"{item.nodeid.split('::')[0]}::{name}", []).append(item)
    for fixture, sharing in users.items():
        if len(sharing) > 1:
            for item in sharing:
                if item.get_closest_marker("xdist_group") is None:
                    item.add_marker(pytest.mark.xdist_group(fixture.split("::")[0]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and orders, the same way
        rank = {nodeid: i for i, nodeid in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(rank)))


def own_shared_fixtures(item: pytest.Item) -> list[str]:
    """The module- or session-scoped fixtures that `item` uses and that its own module defines."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    module = item.nodeid.split("::")[0]
    return [name for name in getattr(item, "fixturenames", ())
            if (defs := info.name2fixturedefs.get(name)) and defs[-1].scope in ("module", "session")
            and defs[-1].baseid == module]


def tiny_overrides(base: Path, *extra: str) -> list[str]:
    """Config overrides that point every path of a run at `base` and shrink everything to test size."""
    return [
        "data=synthetic",
        f"data.root={base / 'raw'}",
        f"data.processed_dir={base / 'processed'}",
        f"data.manifest_dir={base / 'manifests'}",
        "data.synthetic.preset=tiny",
        "data.synthetic.workers=1",
        "preprocess.frames_per_video=3",
        # every crop of the tiny twin's three (the twin's own two from 3.5 s would leave the tests one or two)
        "data.loader.frames_per_video=null",
        "data.loader.from_s=null",
        "preprocess.crop_size=64",
        "preprocess.workers=1",
        f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}",
        f"mlflow.artifact_root={base / 'mlartifacts'}",
        f"reports_dir={base / 'reports'}",
        f"cv.work_dir={base / 'runs'}",
        "trainer.precision=32-true",  # the same numbers on every CPU (auto picks bf16 where AMX runs it)
        *extra,
    ]


def loader_config(**changes):
    """The `loader` section of configs/config.yaml as a LoaderConfig, with test-sized changes. Composed (its crop
    settings refer to the dataset's `data.loader`) with BioVid's data config, whose every-crop setting keeps the
    tests' tiny folders whole."""
    from pipeline.data.datamodule import LoaderConfig

    return LoaderConfig.from_config(load_config(["data=biovid"]).loader, **changes)


def planned(cfg, fold_file=None):
    """The plan's decisions for a config (`fold_decisions.plan_decisions`), on its fold file unless one is given."""
    from pipeline.runs.jobs.fold_decisions import plan_decisions
    from pipeline.runs.jobs.training_settings import TrainingSettings

    return plan_decisions(TrainingSettings.from_config(cfg), fold_file or Path(cfg.fold_file))


def training_of(cfg):
    """A config's typed training settings and what they train (checked): what `fold_job.build_fold` takes."""
    from pipeline.runs.jobs.training_settings import TrainingSettings
    from pipeline.runs.jobs.what_trains import WhatTrains

    training = TrainingSettings.from_config(cfg)
    return training, WhatTrains.of(training).check()


def head_config(**changes):
    """The `model.head` group of configs/model/timm.yaml as a HeadConfig, with test-sized changes."""
    from omegaconf import OmegaConf

    from pipeline.models.temporal_heads import HeadConfig
    from pipeline.utils.paths import PROJECT_ROOT

    return HeadConfig.from_config({**OmegaConf.load(PROJECT_ROOT / "configs" / "model" / "timm.yaml").head, **changes})


def head_settings(**changes) -> dict:
    """`head_config` as the dict a kept model file records (`model.head`)."""
    from dataclasses import asdict

    return asdict(head_config(**changes))


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared tiny synthetic dataset (raw videos, crops, frame table, fold file), shared read-only by tests."""
    from pipeline.data.prepare import DataSettings, prepare_data

    base = tmp_path_factory.mktemp("tiny")
    prepare_data(DataSettings.from_config(load_config(tiny_overrides(base))), progress=False)
    return base


@pytest.fixture(scope="session")
def tiny_config(tiny_base: Path):
    return lambda *extra: load_config(tiny_overrides(tiny_base, *extra))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real single-node SLURM (slurmctld + slurmd + munge) for the session; SLURM_CONF points at it meanwhile."""
    from tests.slurm_cluster import SlurmCluster

    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_cluster():
    """A real PostgreSQL (Debian's package) for the session: a cluster of its own in a temporary folder, on 127.0.0.1
    and a socket there, with a role that logs in by password; each test makes the databases it needs
    (`new_database`)."""
    from tests.postgres_cluster import PostgresCluster

    with PostgresCluster(()) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of small tensors (tiny models, MTCNN as preprocessing runs it): they gain nothing
    from threads, and on a busy 2-core machine an OpenMP thread that waits for a core makes each call several times
    slower. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def untrained_model(tiny_config, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The cheapest real pain model: an untrained MobileViT-XXS at 32 px (random head, no training), kept and logged as
    the MLflow model `make final` logs, in a store of its own. For tests of what predict and the scoring server do with
    their input (exit codes, limits), not of their scores. Returns cfg, the model's URI and its local folder."""
    import mlflow

    from pipeline.models.factory import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.runs.serving.mlflow_model import log_mlflow_model, model_config

    own = tmp_path_factory.mktemp("untrained_model")
    cfg = tiny_config("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false",
                      f"mlflow.tracking_uri=sqlite:///{own / 'mlflow.db'}", f"mlflow.artifact_root={own / 'art'}",
                      f"reports_dir={own / 'reports'}")
    net, _ = create_model("mobilevit_xxs", 2, pretrained=False, img_size=32)
    class_names = ["BL1", "PA4"]
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=class_names, task=cfg.task.name,
                      loader={"crop_fraction": 1.0}, weights={"weights_source": "random"})
    path = save_model_file(net, meta, own / "model.pt")
    mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
    experiment = mlflow.create_experiment("untrained", artifact_location=str(own / "art"))
    with mlflow.start_run(experiment_id=experiment):
        info = log_mlflow_model(path, model_config(cfg, class_names, 0.5, "fixed"), {"model": "mobilevit_xxs"})
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(own / "local")))
    return {"cfg": cfg, "uri": info.model_uri, "local": local, "dir": own}


def make_finished_cv(client, experiment_id: str, model: str, task: str, protocol: str, metrics: dict[str, float],
                     subject_set: str = "all", **tags: str) -> str:
    """A FINISHED parent CV run with the tags and pooled metrics `make cv` writes, made by hand (no training): what
    `make table` and `make compare` read from a finished cross-validation."""
    from mlflow.entities import Metric

    run = client.create_run(experiment_id, run_name=f"{model} synthetic {protocol} {task}", tags={
        "painvit.run_kind": "cv", "model": model, "dataset": "synthetic", "protocol": protocol, "task": task,
        "subject_set": subject_set, "seed": "0", "fold_file_sha256": "f" * 64, "complete": "true",
        "task_unusable_subjects": "", "task_skipped_folds": "", **tags})
    client.log_batch(run.info.run_id, metrics=[Metric(key, float(value), 0, 0) for key, value in metrics.items()])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


@pytest.fixture(scope="session")
def finished_cv_store(tmp_path_factory: pytest.TempPathFactory):
    """A sqlite MLflow store with hand-made finished CVs of one backbone (BL1 vs PA4 and five classes, kfold5 and
    LOSO over the twin's 20 subjects): a finished cross-validation for tests that read one, without training."""
    from mlflow import MlflowClient

    from pipeline.runs.store.tracking import get_or_create_experiment

    root = tmp_path_factory.mktemp("finished_cv")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment_id = get_or_create_experiment("finished-cv", root / "artifacts", client=client)
    pooled = {"pooled/video_accuracy_at_threshold": 0.80, "pooled/video_accuracy_at_threshold_ci95_low": 0.70,
              "pooled/video_accuracy_at_threshold_ci95_high": 0.88, "pooled/video_accuracy_argmax": 0.75,
              "pooled/video_accuracy_argmax_ci95_low": 0.65, "pooled/video_accuracy_argmax_ci95_high": 0.85,
              "pooled/video_balanced_accuracy_at_threshold": 0.79, "pooled/within_subject_video_auroc": 0.9,
              "pooled/video_f1": 0.4, "data/subjects_tested": 20, "data/videos_tested": 240}
    runs = {}
    for protocol, train in (("kfold5", (12, 13)), ("loso", (16, 16))):
        for task in ("bl1_vs_pa4", "five_class"):
            sizes = {"data/train_subjects_min": train[0], "data/train_subjects_max": train[1]}
            runs[(protocol, task)] = make_finished_cv(
                client, experiment_id, "mobilevit_xxs", task, protocol, {**pooled, **sizes},
                task_unusable_subjects="020101_m_30" if task == "five_class" else "",
                task_skipped_folds="4" if task == "five_class" and protocol == "kfold5" else "")
    return {"client": client, "experiment_id": experiment_id, "runs": runs, "root": root}


def scorer_source(cfg):
    """Where `make predict` with this config finds its model, and how the scorer runs."""
    from pipeline.deployment.predict import ScorerSource

    return ScorerSource.of(cfg.mlflow.tracking_uri, cfg.model.name, cfg.task.name, cfg.predict)
