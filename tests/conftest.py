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
    workers share the two cores rather than four threads fighting for them (programs a test starts keep their own)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the real SLURM cluster (or starts one of its own) runs on one worker (`--dist
    loadgroup`): one session cluster, started once, and never two clusters starting side by side."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) or item.path.name == "test_slurm_cluster.py":
            item.add_marker(pytest.mark.xdist_group("slurm"))


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


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared tiny synthetic dataset (raw videos, crops, frame table, fold file), shared read-only by tests."""
    from pipeline.data.prepare import prepare_data

    base = tmp_path_factory.mktemp("tiny")
    prepare_data(load_config(tiny_overrides(base)), progress=False)
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
