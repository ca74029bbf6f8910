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
