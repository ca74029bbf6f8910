"""What a run logs, gathered while it works and written in as few requests as the store takes (`RunRecord`).

Each `mlflow.log_params`, `set_tags` or `log_metrics` is a request of its own, and through a tracking server a round
trip through its HTTP and authentication layers: a fold of an in-memory probe (a second or two of work) made ten
`log-batch` requests that way, and as many `runs/get`. A fold job gathers its parameters, tags and metrics here and
writes them with `flush` (one `log-batch`, more only past MLflow's limits of 100 parameters, 100 tags and 1000
metrics a request) before it seals its run; its files go straight to the run's artifact store (`log_artifacts`),
whose address the run was created with, rather than through MLflow's lookup of the run for each call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mlflow takes seconds to import
    from mlflow import MlflowClient
    from mlflow.store.artifact.artifact_repo import ArtifactRepository

# MLflow's limits for one log_batch request (mlflow.utils.validation.MAX_*_PER_BATCH)
MAX_PARAMS, MAX_TAGS, MAX_METRICS, MAX_ENTRIES = 100, 100, 1000, 1000


class RunRecord:
    """The parameters, tags and metrics of one run (`run_id`, its files under `artifact_uri`), kept here until `flush`
    writes them. A parameter given twice keeps its first value (MLflow refuses to change one); a tag the last."""

    def __init__(self, client: MlflowClient, run_id: str, artifact_uri: str) -> None:
        self.client, self.run_id, self.artifact_uri = client, run_id, artifact_uri
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.metrics: list[tuple[str, float, int]] = []  # (key, value, step)

    @classmethod
    def of_active_run(cls) -> RunRecord:
        """The record of MLflow's active run (`mlflow.start_run`), through the tracking URI set now."""
        import mlflow

        run = mlflow.active_run()
        if run is None:
            raise RuntimeError("no active MLflow run to record into")
        return cls(mlflow.MlflowClient(), run.info.run_id, run.info.artifact_uri)

    def artifact_repository(self) -> ArtifactRepository:
        """The run's artifact store, reached at the address the run holds (no request to the tracking server)."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        return get_artifact_repository(self.artifact_uri, tracking_uri=self.client.tracking_uri)

    def log_artifacts(self, local_dir: Path, artifact_path: str | None = None) -> None:
        """Store the files of `local_dir` now (not gathered), under `artifact_path` of the run's artifacts."""
        self.artifact_repository().log_artifacts(str(local_dir), artifact_path)

    def log_params(self, values: Mapping[str, Any]) -> None:
        for key, value in values.items():
            self.params.setdefault(key, str(value))

    def set_tags(self, values: Mapping[str, Any]) -> None:
        self.tags.update({key: str(value) for key, value in values.items()})

    def log_metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        self.metrics += [(key, float(value), int(step)) for key, value in values.items()]

    def flush(self) -> int:
        """Write what was gathered and forget it; the number of requests it took."""
        from mlflow.entities import Metric, Param, RunTag

        stamp = int(time.time() * 1000)
        params = [Param(key, value) for key, value in self.params.items()]
        tags = [RunTag(key, value) for key, value in self.tags.items()]
        metrics = [Metric(key, value, stamp, step) for key, value, step in self.metrics]
        requests = 0
        for batch in batches(params, tags, metrics):
            self.client.log_batch(self.run_id, **batch)
            requests += 1
        self.params, self.tags, self.metrics = {}, {}, []
        return requests


def batches(params: list, tags: list, metrics: list) -> Iterator[dict[str, list]]:
    """The entries in log_batch requests within MLflow's limits, each as full as they allow."""
    while params or tags or metrics:
        batch = {"params": params[:MAX_PARAMS], "tags": tags[:MAX_TAGS]}
        room = MAX_ENTRIES - len(batch["params"]) - len(batch["tags"])
        batch["metrics"] = metrics[:min(MAX_METRICS, room)]
        params, tags, metrics = params[MAX_PARAMS:], tags[MAX_TAGS:], metrics[len(batch["metrics"]):]
        yield batch
