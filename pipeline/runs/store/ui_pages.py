"""The MLflow UI's pages a person opens: `python -m pipeline ui-url --port 5000` prints the address of the
experiment's runs page (and of its comparisons'), which `make ui` shows before it starts the server; MLflow 3's UI
opens in its GenAI mode (traces, an assistant) unless the address asks for the model-training mode, so that address
is the way in for a new user. A CV's and a comparison's headline figures are the columns of the experiment's saved
headline view. Answers without importing MLflow where the store is a sqlite file.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.runs.store.tracking import (
    DEFAULT_EXPERIMENT,
    HEADLINE_VIEW,
    HEADLINE_VIEW_NAME,
    MAX_VIEW_COLUMNS,
    RUN_NAME_COLUMN,
    RUN_NAME_WIDTH,
    SHARED_VIEW_PARAM,
    SHARED_VIEW_TAG_PREFIX,
    UI_WORKFLOW,
    redact_uri,
    sqlite_file,
    tracking_uri,
)
from pipeline.utils.paths import PROJECT_ROOT

if TYPE_CHECKING:  # mlflow takes seconds to import; `python -m pipeline ui-url` must answer at once
    from mlflow import MlflowClient


def find_experiment_id(uri: str, name: str = DEFAULT_EXPERIMENT) -> str | None:
    """The id of the active experiment `name` in the store at `uri`, or None (no store yet, no such experiment).

    A sqlite store is read directly, read-only, in milliseconds and without creating the file; any other store
    goes through MLflow. Never raises: a store it cannot read gives None.
    """
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        if not path or path == ":memory:" or not Path(path).is_file():
            return None
        try:
            with sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True) as connection:
                row = connection.execute(
                    "SELECT experiment_id FROM experiments WHERE name = ? AND lifecycle_stage = 'active'", (name,)
                ).fetchone()
        except sqlite3.Error:
            return None
        return None if row is None else str(row[0])
    try:
        from mlflow import MlflowClient

        experiment = MlflowClient(uri).get_experiment_by_name(name)
    except Exception:  # an address to print is not worth failing `make ui` for
        return None
    return experiment.experiment_id if experiment is not None and experiment.lifecycle_stage == "active" else None


def ui_url(host: str, port: int | str, experiment_id: str | None, view: bool = False) -> str:
    """The UI page a new user should open: the experiment's runs table (parents expand into folds) in the UI's
    "Model training" mode, or the experiment list in that mode when there is no experiment yet; `view`: opened on
    the experiment's headline view (`set_headline_view`)."""
    base = f"http://{host}:{port}/#/experiments"
    page = f"{base}/{experiment_id}/runs" if experiment_id is not None else base
    shared = f"&{SHARED_VIEW_PARAM}={HEADLINE_VIEW}" if view and experiment_id is not None else ""
    return f"{page}?workflowType={UI_WORKFLOW}{shared}"


def metric_column(name: str) -> str:
    """The runs table's column id of a metric (the UI's canonical key)."""
    return f"metrics.`{name}`"


def set_headline_view(client: MlflowClient, experiment_id: str, columns: Sequence[str], add: bool = False) -> None:
    """The experiment's headline view (HEADLINE_VIEW, named HEADLINE_VIEW_NAME in the UI's Views list): its runs
    table showing `columns` (column ids: `metric_column`, DURATION_COLUMN), in that order. `add`: the view's columns
    stay and these join them at the end (a comparisons experiment gathers every pair's; the newest MAX_VIEW_COLUMNS
    are kept). Written, as MLflow's UI saves a view, only when it changes."""
    key = SHARED_VIEW_TAG_PREFIX + HEADLINE_VIEW
    old = view_envelope(client.get_experiment(experiment_id).tags.get(key))
    shown = list(columns)
    if add:
        shown = list(json.loads(old.get("state", "{}")).get("selectedColumns", [])) + shown
    shown = list(dict.fromkeys(reversed(shown)))[:MAX_VIEW_COLUMNS][::-1]  # each once, where it was last named
    widths = {RUN_NAME_COLUMN: RUN_NAME_WIDTH, **{column: column_width(column) for column in shown}}
    state = json.dumps({"selectedColumns": shown, "columnOrder": [RUN_NAME_COLUMN, *shown], "columnWidths": widths},
                       separators=(",", ":"))  # the UI sizes the columns its order names
    if state != old.get("state"):
        now = int(time.time() * 1000)
        client.set_experiment_tag(experiment_id, key, json.dumps({
            "name": HEADLINE_VIEW_NAME, "createdAt": old.get("createdAt", now), "updatedAt": now, "state": state}))


def column_width(column: str) -> int:
    """Pixels for a column whose header (the name between backticks) shows whole."""
    name = column.split("`")[1] if "`" in column else column
    return max(90, 7 * len(name) + 20)


def view_envelope(value: str | None) -> dict:
    """A saved view's tag value as the UI reads it (name, createdAt, updatedAt and the view's `state` as JSON text);
    {} for none, or one the UI wrote compressed or an older MLflow wrote bare (then replaced)."""
    try:
        envelope = json.loads(value or "{}")
        json.loads(envelope.get("state", "{}"))
    except (ValueError, AttributeError, TypeError):
        return {}
    return envelope if isinstance(envelope, dict) else {}


def has_headline_view(uri: str, experiment_id: str) -> bool:
    """Whether the experiment has its headline view; a sqlite store is read directly and read-only (as
    `find_experiment_id` reads it), any other through MLflow. Never raises: a store it cannot read gives False."""
    key = SHARED_VIEW_TAG_PREFIX + HEADLINE_VIEW
    path = sqlite_file(uri)
    if path is not None:
        if not path.is_file():
            return False
        try:
            with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as connection:
                row = connection.execute("SELECT 1 FROM experiment_tags WHERE experiment_id = ? AND key = ?",
                                         (int(experiment_id), key)).fetchone()
        except (sqlite3.Error, ValueError):
            return False
        return row is not None
    try:
        from mlflow import MlflowClient

        return key in MlflowClient(uri).get_experiment(experiment_id).tags
    except Exception:  # an address to print is not worth failing `make ui` for
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline ui-url",
                                     description="Print the MLflow UI address of the experiment's runs page.")
    parser.add_argument("--tracking-uri", default=None, help="the store (default: MLFLOW_TRACKING_URI or mlflow.db)")
    parser.add_argument("--experiment", default=DEFAULT_EXPERIMENT)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="5000")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or tracking_uri(PROJECT_ROOT)
    urls = ui_urls(uri, args.host, args.port, args.experiment)
    if find_experiment_id(uri, args.experiment) is None:
        print(f"No experiment '{args.experiment}' in {redact_uri(uri)} yet (`make cv` creates it). MLflow UI: "
              f"{urls[0]}")
    else:
        print(f"Cross-validation runs of '{args.experiment}': {urls[0]}")
    for url in urls[1:]:
        print(f"Comparisons (make compare): {url}")
    print("Open that address once the server logs 'Application startup complete'. Stop with Ctrl+C.", flush=True)


def comparisons_experiment(experiment: str) -> str:
    """The experiment `make compare` logs its comparisons of `experiment`'s CVs into: apart from the CV parents, so
    that their runs table shows the CVs alone and the comparisons' table the pairs' figures."""
    return f"{experiment}-comparisons"


def ui_urls(uri: str, host: str, port: int | str, experiment: str) -> list[str]:
    """The UI pages of the CVs' experiment (its headline view where it has one) and, once `make compare` made it, of
    its comparisons' experiment."""
    urls = []
    for name in (experiment, comparisons_experiment(experiment)):
        experiment_id = find_experiment_id(uri, name)
        if experiment_id is not None or not urls:
            urls.append(ui_url(host, port, experiment_id,
                               view=experiment_id is not None and has_headline_view(uri, experiment_id)))
    return urls
