"""Where MLflow records live: one sqlite store and one local artifact folder per project, unless overridden.

MLflow 3 refuses the old `./mlruns` file store, so the default is a sqlite database in the project root; the
experiment is created with its artifacts in `<project>/mlartifacts` so runs never write into the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import LifecycleStage
from mlflow.exceptions import MlflowException

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_EXPERIMENT = "pain-cv"


def tracking_uri(project_root: Path) -> str:
    """`MLFLOW_TRACKING_URI` when set, else `sqlite:///<project>/mlflow.db` (absolute path)."""
    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if from_env:
        return from_env
    return f"sqlite:///{(Path(project_root).resolve() / 'mlflow.db').as_posix()}"


def artifact_root(project_root: Path) -> str:
    """The file:// URI of `<project>/mlartifacts`, the artifact location given to experiments this project creates."""
    return (Path(project_root).resolve() / "mlartifacts").as_uri()


def get_or_create_experiment(name: str, artifact_root: str | Path, client: MlflowClient | None = None) -> str:
    """The id of experiment `name`, creating it with `artifact_root` as its artifact location if it does not exist.

    A local `Path` becomes a file:// URI. A deleted experiment of that name is restored rather than shadowed,
    since MLflow keeps deleted names reserved. Uses the current tracking URI unless a client is given.
    """
    client = client or MlflowClient()
    location = Path(artifact_root).resolve().as_uri() if isinstance(artifact_root, Path) else str(artifact_root)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:
            # Another process may have created it between the lookup and the create.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id
