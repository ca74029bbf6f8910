"""Shared fixtures: one tiny synthetic twin in BioVid's layout, generated and preprocessed once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.utils.config import load_config


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
    """The `loader` group of configs/config.yaml as a LoaderConfig, with test-sized changes."""
    from omegaconf import OmegaConf

    from pipeline.data.datamodule import LoaderConfig
    from pipeline.utils.config import CONFIG_DIR

    return LoaderConfig.from_config(OmegaConf.load(CONFIG_DIR / "config.yaml").loader, **changes)


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

    from pipeline.models.backbones import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.runs.mlflow_model import log_mlflow_model, model_config

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
