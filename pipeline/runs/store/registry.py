"""What makes a run readable in the MLflow UI and a model findable in the registry: the standard user / source / git
tags, a Markdown description, the data a run used (names and labels only), registered names and aliases.

A registered pain model is named `pain-<model>-<task>`; `make final` registers each final model as a new version
with the alias `candidate`, and `make promote` moves the alias `champion` to a chosen version, which `make predict`
and `make serve` use by default.
"""

from __future__ import annotations

import getpass
import sys
import time
from collections.abc import Iterable

import pandas as pd

from pipeline.data.fold_files import read_folds
from pipeline.runs.store import tracking
from pipeline.runs.store.tracking import redact_uri
from pipeline.utils.paths import git_commit

CANDIDATE, CHAMPION = "candidate", "champion"
UI_WORKFLOW = "machine_learning"  # the UI's "Model training" mode (pipeline.runs.store.tracking)


def registered_name(model: str, task: str) -> str:
    return f"pain-{model}-{task}"


def champion_uri(model: str, task: str) -> str:
    return f"models:/{registered_name(model, task)}@{CHAMPION}"


def standard_tags(source_name: str | None = None) -> dict[str, str]:
    """MLflow's own tags for who ran what from which commit: the UI's "Created by" and "Source" columns."""
    commit = git_commit()
    tags = {tracking.USER_TAG: getpass.getuser(), tracking.SOURCE_TYPE_TAG: "LOCAL",
            tracking.SOURCE_NAME_TAG: source_name or " ".join(["python -m pipeline", *sys.argv[1:2]])}
    if commit != "unknown":
        tags[tracking.SOURCE_COMMIT_TAG] = commit.removesuffix("-dirty")
    return tags


def markdown_table(table: pd.DataFrame, digits: int = 3) -> str:
    """A DataFrame as a Markdown table (the run description the UI renders)."""
    columns = [str(c) for c in table.columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in table.iterrows():
        cells = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe_run(client, run_id: str, title: str, table: pd.DataFrame | None = None, lines: Iterable[str] = ()) -> None:
    """Set the run's description (`mlflow.note.content`): a title, free lines and a result table."""
    parts = [f"### {title}", *lines]
    if table is not None:
        parts.append(markdown_table(table))
    client.set_tag(run_id, tracking.NOTE_TAG, "\n\n".join(parts))


def subjects_dataset(subjects: pd.DataFrame, name: str):
    """An MLflow dataset of subject names, videos and labels (never frames): what `mlflow.log_input` records."""
    import mlflow

    return mlflow.data.from_pandas(subjects.reset_index(drop=True), name=name, targets="label")


def log_subjects(client, run_id: str, subjects: pd.DataFrame, name: str, context: str = "training") -> None:
    """`mlflow.log_input` for a run that is not the active one (a CV's parent run)."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    dataset = subjects_dataset(subjects, name)._to_mlflow_entity()
    inputs = [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])]
    for attempt in range(3):
        try:
            client.log_inputs(run_id, inputs)
            return
        except MlflowException as error:
            # Two drivers of one CV (`make cv` on two machines) log the same dataset at the same moment: the store
            # looks the dataset up, finds none, and both insert it; the second insert breaks the store's unique key
            # (experiment, name, digest). Asked again, the store finds the dataset the other wrote and links it.
            if ("UNIQUE constraint" not in str(error) and "IntegrityError" not in str(error)) or attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))


def split_videos(datamodule, roles: Iterable[str] = ("train", "val", "test")) -> pd.DataFrame:
    """One row per video a fold (or the final model) used: subject, video, class, label, role. Names and labels only."""
    rows = []
    for role in roles:
        videos = datamodule.frames(role).drop_duplicates(["subject_name", "sample_name"])
        rows.append(videos[["subject_name", "sample_name", "class_name", "label"]].assign(role=role))
    return pd.concat(rows, ignore_index=True)


def cv_subjects(fold_file, frames: pd.DataFrame, classes) -> pd.DataFrame:
    """A CV's subjects and videos with their labels and each fold's role: what its parent run records as its data."""
    folds = read_folds(fold_file)
    videos = frames[frames["class_name"].isin(classes)].drop_duplicates(["subject_name", "sample_name"])
    videos = videos[["subject_name", "sample_name", "class_name"]].copy()
    videos["label"] = videos["class_name"].map({c: i for i, c in enumerate(classes)})
    roles = folds.pivot(index="subject_name", columns="fold", values="role").add_prefix("fold_")
    return videos.merge(roles, left_on="subject_name", right_index=True, how="inner")


def run_url(tracking_uri: str, experiment_id: str, run_id: str, host: str = "127.0.0.1", port: int | str = 5000) -> str:
    """A run page that opens in the UI's "Model training" view (`make ui` serves it)."""
    if tracking_uri.startswith(("http://", "https://")):
        base = redact_uri(tracking_uri).rstrip("/")
    else:
        base = f"http://{host}:{port}"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType={UI_WORKFLOW}"


def register(client, model_uri: str, name: str, run_id: str, tags: dict[str, str] | None = None):
    """A new version of `name` from `model_uri`, with the alias `candidate`."""
    import mlflow

    version = mlflow.register_model(model_uri, name, tags=tags)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    return version


def promote(client, name: str, version: str | int) -> str:
    """Move `champion` to `version` of `name`; returns the alias' previous version ('' if none)."""
    from mlflow.exceptions import MlflowException

    try:
        previous = client.get_model_version_by_alias(name, CHAMPION).version
    except MlflowException:
        previous = ""
    client.get_model_version(name, str(version))  # an unknown version is an error naming it
    client.set_registered_model_alias(name, CHAMPION, str(version))
    return str(previous)


def run_promote(cfg, version: str | None = None) -> None:
    """`make promote MODEL=... VERSION=...`."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if not version:
        raise SystemExit("promote: say which version, e.g. make promote MODEL=... VERSION=1")
    client = MlflowClient(tracking.store_uri(cfg.mlflow.tracking_uri))
    name = registered_name(cfg.model.name, cfg.task.name)
    try:
        previous = promote(client, name, version)
    except MlflowException as error:
        raise SystemExit(f"promote: {name} version {version}: {error.message}") from None
    moved = f" (was version {previous})" if previous and previous != str(version) else ""
    print(f"{name}: alias '{CHAMPION}' -> version {version}{moved}; `make predict` and `make serve` now use "
          f"models:/{name}@{CHAMPION}")
