"""Where MLflow records live: one sqlite store and one local artifact folder per project, unless overridden.

MLflow 3 refuses the old `./mlruns` file store, so the default is a sqlite database in the project root; the
experiment is created with its artifacts in `<project>/mlartifacts` so runs never write into the working directory.

`python -m pipeline ui-url --port 5000` prints the address of the experiment's runs page, which `make ui` shows
before it starts the server. MLflow 3's UI opens in its GenAI mode (traces, an assistant) unless the address asks for
the model-training mode, so that address is the way in for a new user.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit
from urllib.request import url2pathname

from omegaconf import DictConfig, OmegaConf

from pipeline.utils.paths import PROJECT_ROOT, resolve_path

if TYPE_CHECKING:  # mlflow takes seconds to import; `python -m pipeline ui-url` must answer at once
    from mlflow import MlflowClient
    from mlflow.entities import Run

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_EXPERIMENT = "pain-cv"
# MLflow's experiment-type tag: the UI's "Machine learning" type (runs, metrics, models) as opposed to
# "genai_development" (traces, evaluations). MLflow 3.17's UI takes the type of page from its own GenAI /
# Model training switch instead, so the tag alone does not choose the page; the runs URL below does.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# The UI's switch, as a URL parameter: `machine_learning` = "Model training" (Runs, Models, Traces in the sidebar).
UI_WORKFLOW = "machine_learning"

# The store's rules, written once. A cross-validation is a parent run tagged RUN_KIND_TAG=CV_RUN with one child run
# per fold attempt (RUN_KIND_TAG=FOLD_RUN, FOLD_TAG=<fold>, MLflow's PARENT_TAG); a fold is done when one of its
# attempts is FINISHED, and the newest such attempt is the one that counts.
RUN_KIND_TAG = "painvit.run_kind"
CV_RUN, FOLD_RUN, FINAL_RUN, COMPARISON_RUN = "cv", "fold", "final", "comparison"
# A hyper-parameter search (`make tune`, pipeline.runs.orchestration.tuning) is a parent run tagged TUNING_RUN with one
# child per (fold, trial) tagged TRIAL_RUN: never a CV_RUN or FOLD_RUN, so no CV view or comparison takes a trial for a
# fold. The tuned cross-validation it leads to is a CV_RUN with TUNED_TAG=true and its budget tags (TUNE_BUDGET_TAGS).
TUNING_RUN, TRIAL_RUN = "tuning", "trial"
POWER_RUN = "power"  # `make power`'s summary of one effect's repeated comparisons (pipeline.analysis.power)
TRIAL_TAG = "painvit.trial"  # the Optuna trial number of a trial run
TUNED_TAG = "painvit.tuned"  # "true" on a tuned CV's parent; absent on a CV of the hand-picked settings
TUNE_TAG_PREFIX = "painvit.tune_"  # a tuned CV's budget tags (and a comparison's copy of them): trials, scope, ...
TUNE_SCOPE_TAG = f"{TUNE_TAG_PREFIX}scope"  # also on a trial run: the study's scope (per_fold | shared)
TUNE_BUDGET_TAGS = (f"{TUNE_TAG_PREFIX}trials", TUNE_SCOPE_TAG, f"{TUNE_TAG_PREFIX}space_sha256")
TUNE_NOTE_TAG = f"{TUNE_TAG_PREFIX}note"  # a shared study's optimism, said on the tuned CV, its search, a comparison
TUNING_RUN_TAG = "painvit.tuning_run_id"  # on a tuned CV's parent: its search
TUNED_CV_RUN_TAG = "painvit.tuned_cv_run_id"  # on a search (TUNING_RUN): the tuned CV it chose settings for
STUDY_STORAGE_TAG, SEARCH_SPACE_TAG = "painvit.study_storage", "painvit.search_space"  # on a search: its journal, space
TRIAL_STATE_TAG, STUDY_TAG = "painvit.trial_state", "painvit.study"  # on a trial run: Optuna's state, its study
# A final model (`make final`): a FINAL_RUN keyed by its source CV and final settings, with the registered version.
FINAL_KEY_TAG, SOURCE_CV_RUN_TAG = "painvit.final_key", "painvit.source_cv_run"
REGISTERED_MODEL_TAG, REGISTERED_VERSION_TAG = "painvit.registered_model", "painvit.registered_version"
ENSEMBLE_VERSION_TAG = "painvit.ensemble_version"  # on a final run: the registered version of its fold ensemble
# On a logged MLflow model: what it is (FINAL_MODEL, FOLD_MODEL, ENSEMBLE_MODEL) and, for a fold's, which fold.
MODEL_KIND_TAG, MODEL_FOLD_TAG = "painvit.kind", "painvit.fold"
FINAL_MODEL, FOLD_MODEL, ENSEMBLE_MODEL = "final", "fold", "fold_ensemble"
TABLE_RUN = "table"  # `make table`'s run of the papers' comparison (pipeline.analysis.results_table)
INSPECT_IMAGES_TAG = "painvit.inspect_images"  # on an inspected CV: where `make inspect` put its face images
FOLD_FILE_TAG = "fold_file_sha256"  # on a CV's parent: the SHA-256 of its fold file (CVs compare on one file only)
# A fold's lease (pipeline.runs.store.fold_lease): its owner and heartbeat on the child run, claims as parent params.
LEASE_TAG, HEARTBEAT_TAG = "painvit.lease", "painvit.heartbeat"
LEASE_PARAM = "painvit.lease"  # prefix of the parent run's claim parameters
PARENT_TAG = "mlflow.parentRunId"
FOLD_TAG = "fold"
SEED_TAG = "seed"  # the training seed a fold run used (the config's, or one of cv.seeds)
FINISHED = "FINISHED"
RESUMED_AFTER_EPOCH_TAG = "painvit.resumed_after_epoch"
ATTEMPT_TAG = "painvit.attempt"
SLURM_JOBS_TAG = "painvit.slurm_jobs"  # on the parent: fold -> SLURM job id of its submitted task
JOB_TRACKING_URI_TAG = "painvit.tracking_uri"  # on a fold run: the store it logged to (redact_uri)
# where a fold attempt runs: lets a later driver tell a live attempt from a dead one (the host tag holds the host
# name, boot id and PID namespace: pipeline.runs.store.fold_lease.machine_identity)
HOST_TAG, PID_TAG, SLURM_JOB_TAG = "painvit.host", "painvit.pid", "painvit.slurm_job_id"
# On a fold run: what it stored, read back before it was marked FINISHED (JSON: artifact path -> size and sha256); a
# FINISHED fold run whose files are no longer there at those sizes is marked FAILED with FAILED_REASON_TAG and its
# fold trained again. LEASE_LOST_TAG: why an attempt stopped unfinished (another job took its fold over).
STORED_ARTIFACTS_TAG, FAILED_REASON_TAG = "painvit.stored_artifacts", "painvit.failed_reason"
LEASE_LOST_TAG = "painvit.lease_lost"
# precision: on a fold run, what it trained in (resolved on its device); on a parent, the folds' values (comma-joined
# when they differ). precision_asked: trainer.precision as planned (auto or an explicit value).
PRECISION_TAG, PRECISION_ASKED_TAG = "precision", "precision_asked"
# What identifies a cross-validation (pipeline.runs.store.cv_runs): resume continues the newest CV with these equal.
IDENTITY_TAGS = ("model", "dataset", "protocol", "task", "subject_set", "seed", "fold_file_sha256", "config_sha256",
                 "finetune", "initial_weights", "head")
# Descriptive, not identity (a run made before outputs and personalisation existed lacks them: resume's query must
# still find it; the config_sha256 already differs): a CV's output (softmax, ordinal_coral, regression_huber) and
# personalisation protocol (none, subject_normalised, baseline_k2). Absent: softmax, none.
OUTPUT_TAG, PERSONALISE_TAG = "output", "personalise"
COMPLETE_TAG = "complete"  # "true" when every fold of the fold file ran, without batch limits
HEADLINE_TAG = "headline_metric"
NOTE_TAG = "mlflow.note.content"  # a run's description: the UI renders it as Markdown on the run's Overview
# A saved view of an experiment's runs table, as MLflow's UI writes one (Views > Save view, or Share): the experiment
# tag <SHARED_VIEW_TAG_PREFIX><key> holds its name and state (the columns, in order, as JSON); the UI's Views list
# offers it by name, and the runs address with ?viewStateShareKey=<key> opens it. HEADLINE_VIEW is this project's:
# the headline metrics as the table's columns.
SHARED_VIEW_TAG_PREFIX, SHARED_VIEW_PARAM, HEADLINE_VIEW = "mlflow.sharedViewState.", "viewStateShareKey", "headline"
HEADLINE_VIEW_NAME = "Headline figures"
DURATION_COLUMN = "attributes.`Duration`"  # the runs table's column of a run's wall time
RUN_NAME_COLUMN, RUN_NAME_WIDTH = "attributes.`Run Name`", 380  # its run names, wide enough to tell them apart
MAX_VIEW_COLUMNS = 60  # a view's columns at most (a comparisons experiment gathers every pair's): the newest kept


def tracking_uri(project_root: Path) -> str:
    """`MLFLOW_TRACKING_URI` when set, else `sqlite:///<project>/mlflow.db` (absolute path)."""
    from_env = os.environ.get(TRACKING_URI_ENV, "").strip()
    if from_env:
        return from_env
    return f"sqlite:///{(Path(project_root).resolve() / 'mlflow.db').as_posix()}"


def store_uri(configured: str | None = None) -> str:
    """The tracking URI a command uses: the config's `mlflow.tracking_uri` when set, else `tracking_uri` of the
    project; its store opened through `open_store` (created and migrated once, whoever else opens it now)."""
    return open_store(configured or tracking_uri(PROJECT_ROOT))


_OPENED: set[str] = set()  # the stores this process has opened through open_store


def open_store(uri: str) -> str:
    """`uri`, its store ready for runs: a sqlite store is created and migrated to MLflow's schema once, under an OS
    lock on `<database>.lock` beside it, before anything of this process uses it; returns `uri`.

    MLflow creates a missing sqlite store's tables the moment a client first opens it, without a lock: two processes
    opening a new store in the same second both migrate it, and one stops with `table _alembic_tmp_experiments
    already exists` (or another table, or a duplicate column). Under the lock the first creates it; the others wait,
    then find it complete. A server URI (or another database) has nothing to do here: its server migrates it.
    """
    database = sqlite_file(uri)
    if database is None or uri in _OPENED:
        return uri
    from mlflow import MlflowClient

    database.parent.mkdir(parents=True, exist_ok=True)
    with store_lock(database):
        MlflowClient(uri)  # MLflow builds the store (kept for this process): tables created and migrated if missing
    _OPENED.add(uri)
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for any other store and for an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if not path or path == ":memory:" else Path(path)


@contextlib.contextmanager
def store_lock(database: Path) -> Iterator[None]:
    """An exclusive OS lock on `<database>.lock` (released when this process dies). Without the right to create the
    lock file beside a store that exists (a store read from someone else's folder) there is nothing this process
    could create or migrate there, and it goes on without the lock."""
    lock = database.with_name(database.name + ".lock")
    try:
        handle = open(lock, "a")
    except PermissionError:
        if not database.is_file():
            raise
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fold_runs(client: MlflowClient, parent_run_id: str, fold: int | None = None,
              seed: int | None = None, experiment_id: str | None = None) -> list[Run]:
    """The fold runs (every attempt) of a cross-validation's parent run, of one of its folds, of one training seed
    (cv.seeds; None: any), newest first. `experiment_id`: the parent's, where the caller knows it (one request less:
    the parent run is not read for it)."""
    if experiment_id is None:
        experiment_id = client.get_run(parent_run_id).info.experiment_id
    query = f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{RUN_KIND_TAG}` = '{FOLD_RUN}'"
    if fold is not None:
        query += f" and tags.`{FOLD_TAG}` = '{fold}'"
    if seed is not None:
        query += f" and tags.`{SEED_TAG}` = '{seed}'"
    return client.search_runs([experiment_id], query, order_by=["attribute.start_time DESC"], max_results=10_000)


def finished_fold_runs(client: MlflowClient, parent_run_id: str, seed: int | None = None,
                       experiment_id: str | None = None) -> dict[int, Run]:
    """fold -> the run that counts for it (of one training seed; None: any): its newest FINISHED attempt. Folds with
    none are absent. `experiment_id` as for `fold_runs`."""
    finished: dict[int, Run] = {}
    for run in fold_runs(client, parent_run_id, seed=seed, experiment_id=experiment_id):
        if run.info.status == FINISHED:
            finished.setdefault(int(run.data.tags[FOLD_TAG]), run)
    return finished


def tune_budget(run: Run) -> dict[str, str]:
    """A tuned CV's search budget (trials, scope, search-space hash) from its parent's tags; {} for an untuned CV.
    Two CVs are compared only when their budgets are equal (`make compare`)."""
    if run.data.tags.get(TUNED_TAG) != "true":
        return {}
    return {tag.removeprefix(TUNE_TAG_PREFIX): run.data.tags.get(tag, "") for tag in TUNE_BUDGET_TAGS}


def parse_tune_budget(text: str) -> dict[str, str]:
    """`trials=20,scope=per_fold,space_sha256=<16 hex>` (as `make compare TUNED=...` takes it) as a budget."""
    budget = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    expected = {tag.removeprefix(TUNE_TAG_PREFIX) for tag in TUNE_BUDGET_TAGS}
    if set(budget) != expected:
        raise ValueError(f"a tuning budget names {', '.join(sorted(expected))} (key=value, comma-separated), "
                         f"not {text!r}; or say `latest`")
    return budget


def artifact_root(project_root: Path) -> str:
    """The file:// URI of `<project>/mlartifacts`, the artifact location given to experiments this project creates."""
    return artifact_folder(project_root).as_uri()


def artifact_folder(project_root: Path) -> Path:
    """`<project>/mlartifacts`, where the artifacts of this project's experiments live."""
    return Path(project_root).resolve() / "mlartifacts"


def get_or_create_experiment(name: str, artifact_root: str | Path, client: MlflowClient | None = None) -> str:
    """The id of experiment `name`, creating it with `artifact_root` as its artifact location if it does not exist.

    A local `Path` becomes a file:// URI. A deleted experiment of that name is restored rather than shadowed,
    since MLflow keeps deleted names reserved. The experiment carries `mlflow.experimentKind` =
    `custom_model_development` (added to an older experiment that lacks it; an existing value is left alone).
    Uses the current tracking URI unless a client is given.
    """
    from mlflow import MlflowClient
    from mlflow.entities import LifecycleStage
    from mlflow.exceptions import MlflowException

    client = client or MlflowClient()
    location = Path(artifact_root).resolve().as_uri() if isinstance(artifact_root, Path) else str(artifact_root)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=location,
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException:
            # Another process may have created it between the lookup and the create.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage == LifecycleStage.DELETED:
        client.restore_experiment(experiment.experiment_id)
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment.experiment_id


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



# Query parameters of a URI whose values are secrets (`postgresql://h/db?password=...`), lower case.
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "pass", "token", "access_token", "secret",
                               "client_secret", "api_key", "apikey", "sas_token", "sig"})
REDACTED = "***"


def redact_uri(uri: str) -> str:
    """`uri` as it may be printed, logged, tagged or written into a job file: the password of `user:password@` and
    the values of secret query parameters replaced by ***, whatever the scheme (postgresql, mysql, http, ...); the
    user name, host and path stay. The one place this rule lives: every URI the project shows goes through it."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # not a URI at all (an unbalanced [ in the host): show nothing of it
        return REDACTED
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{host}"
    query = "&".join(
        f"{key}={REDACTED}" if sep and key.lower() in SECRET_QUERY_KEYS else f"{key}{sep}{value}"
        for key, sep, value in (item.partition("=") for item in parts.query.split("&"))
    ) if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def uri_has_credentials(uri: str) -> bool:
    """A URI of any scheme with a password in it (`postgresql://u:pw@db/x`, `http://user:pass@host`, `?password=`)."""
    return redact_uri(uri) != uri


def store_paths(cfg: DictConfig) -> list[Path]:
    """What a command with this config writes its records and crops into: the sqlite store, the artifact folder,
    the runs folder (checkpoints, job files, submitit's pickles), the Optuna journals and the face crops. Each must be
    this user's alone (`pipeline.utils.permissions.refuse_open_stores`); the raw twin and committed fold files are not
    stores."""
    paths = [sqlite_file(store_uri(OmegaConf.select(cfg, "mlflow.tracking_uri")))]
    artifacts = str(OmegaConf.select(cfg, "mlflow.artifact_root") or artifact_root(PROJECT_ROOT))
    if artifacts.startswith("file://"):
        paths.append(Path(url2pathname(urlsplit(artifacts).path)))
    elif "://" not in artifacts:
        paths.append(resolve_path(artifacts))
    for key in ("cv.work_dir", "tune.storage_dir", "data.processed_dir"):
        value = OmegaConf.select(cfg, key)
        if value:
            paths.append(resolve_path(value))
    return [path for path in paths if path is not None]
