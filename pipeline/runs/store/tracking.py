"""Where MLflow records live: one sqlite store and one local artifact folder per project, unless overridden.

MLflow 3 refuses the old `./mlruns` file store, so the default is a sqlite database in the project root; the
experiment is created with its artifacts in `<project>/mlartifacts` so runs never write into the working directory.
Every MLflow tag name and run status the project writes or reads is named here; the UI's pages a person opens are
`ui_pages`'.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit
from urllib.request import url2pathname

from pipeline.utils.paths import PROJECT_ROOT, resolve_path

if TYPE_CHECKING:  # mlflow takes seconds to import; `python -m pipeline ui-url` must answer at once
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from pipeline.models.weights import WeightsSource
    from pipeline.utils.accelerator import TrainingDevice
    from pipeline.utils.devices import DeviceSettings

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
# on a comparison: what one unit of its paired tests is (the fold that tested a group of subjects, or the subject)
TEST_UNIT_TAG = "test_unit"
# A fold's lease (pipeline.runs.store.fold_lease): its owner and heartbeat on the child run, claims as parent params.
LEASE_TAG, HEARTBEAT_TAG = "painvit.lease", "painvit.heartbeat"
LEASE_PARAM = "painvit.lease"  # prefix of the parent run's claim parameters
PARENT_TAG = "mlflow.parentRunId"
# MLflow's own tags (mlflow.utils.mlflow_tags): the run description (Markdown), who ran it, from what and which commit.
NOTE_TAG, USER_TAG = "mlflow.note.content", "mlflow.user"
SOURCE_TYPE_TAG, SOURCE_NAME_TAG = "mlflow.source.type", "mlflow.source.name"
SOURCE_COMMIT_TAG = "mlflow.source.git.commit"
FOLD_TAG = "fold"
SEED_TAG = "seed"  # the training seed a fold run used (the config's, or one of cv.seeds)
# A run's status (MLflow's RunStatus names) and an Optuna trial's state on a trial run (TRIAL_STATE_TAG).
FINISHED, FAILED, KILLED, RUNNING = "FINISHED", "FAILED", "KILLED", "RUNNING"
TRIAL_COMPLETE, TRIAL_PRUNED, TRIAL_FAIL = "COMPLETE", "PRUNED", "FAIL"
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
MODEL_TAG, DATASET_TAG, PROTOCOL_TAG, TASK_TAG, SUBJECT_SET_TAG = "model", "dataset", "protocol", "task", "subject_set"
CONFIG_SHA256_TAG = "config_sha256"  # the identity config's SHA-256
INITIAL_WEIGHTS_TAG = "initial_weights"  # the initial weights' SHA-256, or random
FINETUNE_TAG = "finetune"  # the strategy's label: full, frozen, top_blocks2, lora_r8
HEAD_TAG = "head"  # the head's label: linear, gru_h64x1_two_stage, ...
IDENTITY_TAGS = (MODEL_TAG, DATASET_TAG, PROTOCOL_TAG, TASK_TAG, SUBJECT_SET_TAG, SEED_TAG, FOLD_FILE_TAG,
                 CONFIG_SHA256_TAG, FINETUNE_TAG, INITIAL_WEIGHTS_TAG, HEAD_TAG)
# What a CV's fold, final model and trial runs copy of their parent's tags (`inherited_tags`; a trial: no seed).
INHERITED_TAGS = (MODEL_TAG, DATASET_TAG, PROTOCOL_TAG, TASK_TAG, SUBJECT_SET_TAG, SEED_TAG)
# What trains, on a CV's parent and every fold, trial and final run (`what_trains.WhatTrains.tags`): whether
# embeddings fed the head, whether augment.* was applied, and in words what augmentation training saw.
EMBEDDING_CACHE_TAG, AUGMENT_APPLIED_TAG, AUGMENTATION_TAG = "embedding_cache", "augment_applied", "augmentation"
# The initial weights (`weights_tags`): hub, file or random, where from, their SHA-256.
WEIGHTS_SOURCE_TAG, WEIGHTS_REF_TAG, WEIGHTS_SHA256_TAG = "weights_source", "weights_ref", "weights_sha256"
# The device a run trained on (`training_device_tags`) and the settings it decided there (`device_settings_tags`).
DEVICE_TAG, CPU_TAG, GPU_TAG, GPU_DRIVER_TAG, CUDA_RUNTIME_TAG = "device", "cpu", "gpu", "gpu_driver", "cuda_runtime"
CHANNELS_LAST_TAG = "channels_last"
# On a CV's parent: its commit, fold file and number of folds, the backbone's family, what the task could not use,
# the people check of a WEIGHTS= file, what face detection lost, the subject set's exclusions, the calibration note.
GIT_COMMIT_TAG, FOLD_FILE_PATH_TAG, N_FOLDS_TAG = "git_commit", "fold_file", "n_folds"
MODEL_FAMILY_TAG = "model_family"
TASK_UNUSABLE_TAG, TASK_SKIPPED_FOLDS_TAG = "task_unusable_subjects", "task_skipped_folds"
PRETRAINING_PEOPLE_TAG, DATA_WARNING_TAG = "pretraining_people", "data_warning"
CALIBRATION_NOTE_TAG = "calibration_note"
N_EXCLUDED_TAG, EXCLUDED_TAG, EXCLUDED_REASONS_TAG = ("n_excluded_subjects", "excluded_subjects",
                                                      "excluded_subjects_reasons")
SUBJECT_SET_DESCRIPTION_TAG = "subject_set_description"  # on `make table`'s run
MAX_TAG_CHARS = 5000  # MLflow's limit on a tag value
# On a fold run: the rule its threshold was chosen by, and why it fell back to 0.5 where it did.
THRESHOLD_RULE_TAG, THRESHOLD_FALLBACK_TAG = "threshold_rule", "threshold_fallback"
# On a comparison run (`make compare`): the family of its tests' correction, settings that differed, the videos paired.
CORRECTION_FAMILY_TAG, COMPARED_DESPITE_TAG, PAIRED_ON_TAG = "correction_family", "compared_despite", "paired_on"
# On `make power`'s run: the planted effect, what it measures, the comparison it repeats.
EFFECT_TAG, MEASURES_TAG, COMPARISON_TAG = "effect", "measures", "comparison"
POWER_STUDY_TAG = "study"  # a resampled power study: the hash of its settings (its rows in the record)
INTERVAL_KIND_TAG = "interval_kind"  # on a CV's parent: how its pooled intervals were drawn
# On a registered model version: the CV its settings came from, its threshold, the folds of a fold ensemble.
VERSION_SOURCE_CV_TAG, VERSION_THRESHOLD_TAG, VERSION_FOLDS_TAG = "source_cv_run", "threshold", "folds"
# Descriptive, not identity (a run made before outputs and personalisation existed lacks them: resume's query must
# still find it; the config_sha256 already differs): a CV's output (softmax, ordinal_coral, regression_huber) and
# personalisation protocol (none, subject_normalised, baseline_k2). Absent: softmax, none.
OUTPUT_TAG, PERSONALISE_TAG = "output", "personalise"
# How a CV's videos were called from their class or level probabilities (`eval.decoding`: argmax, median, expected),
# the same rule for every output. Absent (a CV made before the setting): its output's own rule, argmax for softmax
# and the median level for an ordinal or regression output (`cv_runs.decoding_of`).
DECODING_TAG = "decoding"
COMPLETE_TAG = "complete"  # "true" when every fold of the fold file ran, without batch limits
HEADLINE_TAG = "headline_metric"
# A saved view of an experiment's runs table, as MLflow's UI writes one (Views > Save view, or Share): the experiment
# tag <SHARED_VIEW_TAG_PREFIX><key> holds its name and state (the columns, in order, as JSON); the UI's Views list
# offers it by name, and the runs address with ?viewStateShareKey=<key> opens it. HEADLINE_VIEW is this project's:
# the headline metrics as the table's columns.
SHARED_VIEW_TAG_PREFIX, SHARED_VIEW_PARAM, HEADLINE_VIEW = "mlflow.sharedViewState.", "viewStateShareKey", "headline"
HEADLINE_VIEW_NAME = "Headline figures"
DURATION_COLUMN = "attributes.`Duration`"  # the runs table's column of a run's wall time
RUN_NAME_COLUMN, RUN_NAME_WIDTH = "attributes.`Run Name`", 380  # its run names, wide enough to tell them apart
MAX_VIEW_COLUMNS = 60  # a view's columns at most (a comparisons experiment gathers every pair's): the newest kept


def inherited_tags(parent: Run, names: tuple[str, ...] = INHERITED_TAGS) -> dict[str, str]:
    """What a child run (a fold's, a trial's, a final model's) copies of its parent's tags."""
    return {name: parent.data.tags.get(name, "") for name in names}


def is_complete(tags: Mapping[str, str]) -> bool:
    """Whether a CV ran every fold of its fold file without batch limits (`COMPLETE_TAG`); a CV without the tag, from
    before it existed, is taken as complete, by `make compare` and `make table` alike."""
    return tags.get(COMPLETE_TAG, "true") == "true"


def weights_tags(source: WeightsSource) -> dict[str, str]:
    """Where the initial weights came from, as tags (and as a kept model's `weights` record)."""
    return {WEIGHTS_SOURCE_TAG: source.kind, WEIGHTS_REF_TAG: source.ref, WEIGHTS_SHA256_TAG: source.sha256 or ""}


def training_device_tags(device: TrainingDevice) -> dict[str, str]:
    """The device a run trains on, as tags: its kind, and the GPU, CPU, driver and CUDA runtime it knows of."""
    facts = {GPU_TAG: device.gpu, CPU_TAG: device.cpu, GPU_DRIVER_TAG: device.gpu_driver,
             CUDA_RUNTIME_TAG: device.cuda_runtime}
    return {DEVICE_TAG: device.kind, **{name: value for name, value in facts.items() if value is not None}}


def device_settings_tags(settings: DeviceSettings) -> dict[str, str]:
    """What the device a fold trains on decided (precision, channels-last), and the precision asked, as tags."""
    return {PRECISION_TAG: settings.precision, PRECISION_ASKED_TAG: settings.precision_asked,
            CHANNELS_LAST_TAG: str(settings.channels_last).lower()}


def failure_status(error: BaseException) -> str:
    """How a run that `error` ended is marked: KILLED when stopped (Ctrl-C, SystemExit), FAILED otherwise."""
    return KILLED if isinstance(error, KeyboardInterrupt | SystemExit) else FAILED


@contextlib.contextmanager
def run_lifecycle(run_id: str, client: MlflowClient | None = None, *, finish: bool = True,
                  stopped: tuple[type[BaseException], ...] = (),
                  left_running: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """The one life of a run a command opened (a fold's, a trial's, a final model's, a CV's parent, a search, a
    comparison, a table, a power study): when the block raises, the run ends KILLED (Ctrl-C, SystemExit, or one of
    `stopped`, such as a fold lease another job took over) or FAILED, with the traceback as `traceback.txt` (not for
    `stopped`), unless `left_running` says the error leaves it as it is (a store that does not answer,
    `unreachable.is_unreachable`: nothing can be written, and the run resumes from there); when it returns, FINISHED,
    unless `finish` is false (the block ends the run itself: a CV aggregates it, or leaves it RUNNING for folds
    queued on SLURM). The active run (`mlflow.start_run`) ends through `mlflow.end_run`, so that the next one can
    start; any other through the client."""
    import mlflow

    active = mlflow.active_run()
    fluent = active is not None and active.info.run_id == run_id
    client = client or mlflow.MlflowClient()

    def end(status: str) -> None:
        if fluent:
            mlflow.end_run(status)
        else:
            client.set_terminated(run_id, status)

    try:
        yield
    except stopped:
        end(KILLED)
        raise
    except BaseException as error:
        if left_running is not None and left_running(error):
            raise
        client.log_text(run_id, traceback.format_exc(), "traceback.txt")
        end(failure_status(error))
        raise
    if finish:
        end(FINISHED)


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


# The settings that name where a command writes its records and crops (`store_paths`)
STORE_SETTINGS = ("mlflow.tracking_uri", "mlflow.artifact_root", "cv.work_dir", "tune.storage_dir",
                  "data.processed_dir")


def store_paths(settings: Mapping[str, str | None]) -> list[Path]:
    """What a command writes its records and crops into, from the values of `STORE_SETTINGS` (None where the
    command's config has none): the sqlite store (mlflow.tracking_uri), the artifact folder (mlflow.artifact_root;
    None: the project's), the runs folder (checkpoints, job files, submitit's pickles), the Optuna journals and the
    face crops. Each must be this user's alone (`pipeline.utils.permissions.refuse_open_stores`); the raw twin and
    committed fold files are not stores."""
    paths = [sqlite_file(store_uri(settings.get("mlflow.tracking_uri")))]
    artifacts = str(settings.get("mlflow.artifact_root") or artifact_root(PROJECT_ROOT))
    if artifacts.startswith("file://"):
        paths.append(Path(url2pathname(urlsplit(artifacts).path)))
    elif "://" not in artifacts:
        paths.append(resolve_path(artifacts))
    paths += [resolve_path(folder) for key in STORE_SETTINGS[2:] if (folder := settings.get(key))]
    return [path for path in paths if path is not None]
