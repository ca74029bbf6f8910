"""The run store's questions about cross-validations, answered once: what identifies a CV, and which run is meant.

Identity: a cross-validation is its resolved config without the settings that only change where or how fast it runs
(`NOT_IDENTITY`), summarised by the identity tags (`tracking.IDENTITY_TAGS`: model, dataset, protocol, task, subject
set, seed, the fold file's and the config's SHA-256) and logged in full as flat parameters.

Queries (every "find the run" of the project):
- `newest_cv`: resume's question, the newest parent with these identity tags, finished or not;
- `finished_cv`: `make table`'s, the newest FINISHED parent with the identity a config describes;
- `latest_finished_cvs`: `make compare`'s, the newest FINISHED parent per backbone on one dataset, protocol and task
  (and, when given, subject set, fold file and crop settings);
- `source_cv`: `make inspect`'s and `make final`'s, a named parent run, or the newest finished CV of the config's
  backbone on its current fold file and crop settings.
Tag names come from `pipeline.runs.store.tracking` only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run
from omegaconf import DictConfig, OmegaConf

from pipeline.data.fold_files import fold_file_sha256, parameters_path, read_fold_parameters
from pipeline.data.personalise import PersonaliseConfig
from pipeline.models.backbones import weights_source
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.ordinal import OutputConfig
from pipeline.models.temporal_heads import HeadConfig
from pipeline.models.weights import WeightsSource
from pipeline.runs.store import tracking
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
# Settings that change where or how fast a cross-validation runs, not what it computes: not part of its identity.
NOT_IDENTITY = ("launcher", "mlflow", "cv", "reports_dir", "preprocess.workers", "preprocess.device",
                "data.synthetic.workers", "data.synthetic.classes", "final", "predict", "serve", "compare",
                "cache.batch_size")  # data.synthetic.classes: which videos get truth crops, not how they are made
CROP_PREFIXES = ("preprocess.", "data.synthetic.")  # how the crops were made (twin look and size, detector, align)
CV_QUERY = f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.CV_RUN}'"
FINISHED_QUERY = f"attributes.status = '{tracking.FINISHED}'"


class CvNotFound(LookupError):
    """No cross-validation run answers the question; the message says what was looked for and what to run."""


# ---------------------------------------------------------------------------------------------------------------
# Identity


def protocol_tags(output: OutputConfig, personalise: PersonaliseConfig) -> dict[str, str]:
    """The output and personalisation protocol as tags (`tracking.OUTPUT_TAG`, `PERSONALISE_TAG`): descriptive, not
    identity tags, on every new CV; `cv_label` names a CV by them when they are not softmax / none."""
    return {tracking.OUTPUT_TAG: output.label, tracking.PERSONALISE_TAG: personalise.label}


@dataclass(frozen=True)
class CvConfig:
    """What identifies a cross-validation and finds it in the store, read once from a config (`from_config`) and
    passed down as a value: the resolved config as data (`resolved`: what is hashed and logged as parameters), the
    names its identity tags hold, the labels of what trains, and where its weights and fold file come from."""

    resolved: dict
    model: str
    dataset: str
    protocol: str
    task: str
    subject_set: str
    seed: int
    experiment: str  # mlflow.experiment
    fold_file: Path
    pretrained: bool | str
    weights: str | None  # model.weights: a weights file
    finetune_label: str
    head_label: str
    protocol_tags: dict[str, str]  # the output and personalisation protocol as tags

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CvConfig:
        return cls(OmegaConf.to_container(cfg, resolve=True), str(cfg.model.name), str(cfg.data.name),
                   str(cfg.protocol.name), str(cfg.task.name), str(cfg.data.subject_set), int(cfg.seed),
                   str(cfg.mlflow.experiment), resolve_path(cfg.fold_file), cfg.model.pretrained, cfg.model.weights,
                   FinetuneConfig.from_config(cfg.model, cfg.cache).label, HeadConfig.from_config(cfg.model.head).label,
                   protocol_tags(OutputConfig.from_config(cfg.model.get("output")),
                                 PersonaliseConfig.from_config(cfg.get("personalise"))))

    def weights_source(self) -> WeightsSource:
        """Where its initial weights come from (a weights file hashed): what the plan resolves once."""
        return weights_source(self.model, self.pretrained, self.weights)


def identity_config(cv: CvConfig) -> dict:
    """The resolved config without the settings in NOT_IDENTITY."""
    config = copy.deepcopy(cv.resolved)
    seeds = config.get("cv", {}).get("seeds")
    for key in NOT_IDENTITY:
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    if seeds is not None:  # several training seeds change what is computed; none keeps older CVs' identity
        config["cv"] = {"seeds": list(seeds)}
    if config.get("model", {}).get("head", {}).get("name", "linear") == "linear":
        # the per-frame head reads no clip settings: older CVs (before model.head) keep their identity
        config["model"].pop("head", None)
        config.get("loader", {}).pop("clip_frames", None)
    return config


def config_sha256(cv: CvConfig) -> str:
    return hashlib.sha256(json.dumps(identity_config(cv), sort_keys=True, default=str).encode()).hexdigest()


def run_key(cv: CvConfig, store_uri: str, kind: str = "") -> str:
    """A name for one cross-validation on this machine: `[<kind>-]<model>-<data>-<protocol>-<task>-<16 hex>`, the hex
    a SHA-256 of its full identity (`config_sha256`: every setting but NOT_IDENTITY's, cv.seeds included) and of the
    store it is recorded in (its URI without a password). Its driver's lock and its epoch checkpoints' folder are
    named by it, so that CVs that differ in any identity setting, or are recorded in other stores, never share them."""
    digest = hashlib.sha256(f"{config_sha256(cv)}\n{tracking.redact_uri(store_uri)}".encode()).hexdigest()[:16]
    prefix = f"{kind}-" if kind else ""
    return f"{prefix}{cv.model}-{cv.dataset}-{cv.protocol}-{cv.task}-{digest}"


def flat_params(config: dict) -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, values cut to MLflow's 500 characters."""
    flat = pd.json_normalize(config, sep=".").iloc[0].to_dict()
    return {k: str(v)[:500] for k, v in flat.items()}


def identity_params(cv: CvConfig) -> dict[str, str]:
    """The identity config as the flat parameters a CV (and a final model) logs."""
    return flat_params(identity_config(cv))


def chunks(items: list, size: int) -> Iterator[list]:
    """`items` in lists of at most `size` (MLflow's log_batch takes 100 params or 1000 metrics at a time)."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def identity_tags(cv: CvConfig, fold_file: Path, weights: WeightsSource | None = None) -> dict[str, str]:
    """The tags that identify a cross-validation (tracking.IDENTITY_TAGS): what resume and `make table` look for.
    `weights`: the initial weights as the plan already resolved them (resolved, and a weights file hashed, here
    otherwise)."""
    weights = weights or cv.weights_source()
    return {tracking.MODEL_TAG: cv.model, tracking.DATASET_TAG: cv.dataset, tracking.PROTOCOL_TAG: cv.protocol,
            tracking.TASK_TAG: cv.task, tracking.SUBJECT_SET_TAG: cv.subject_set, tracking.SEED_TAG: str(cv.seed),
            tracking.FOLD_FILE_TAG: fold_file_sha256(fold_file), tracking.CONFIG_SHA256_TAG: config_sha256(cv),
            # what trains (full, frozen, top_blocks2, lora_r8) and the SHA-256 of the weights it starts from
            tracking.FINETUNE_TAG: cv.finetune_label, tracking.INITIAL_WEIGHTS_TAG: weights.sha256 or "random",
            tracking.HEAD_TAG: cv.head_label}  # linear, or a temporal head and its mode


class CvSettings(NamedTuple):
    """What a CV parent run records of its settings: its tags and its (flat) parameters."""

    tags: Mapping[str, str]
    params: Mapping[str, str]


def planned_settings(cv: CvConfig, fold_file: Path, weights: WeightsSource | None = None) -> CvSettings:
    """The identity tags and parameters a complete CV of `cv` on `fold_file` would log, before it runs: what
    `make compare` checks, asked of configs (tests/test_compare.py runs the default backbones' configs through it)."""
    return CvSettings({**identity_tags(cv, fold_file, weights), **cv.protocol_tags, tracking.COMPLETE_TAG: "true"},
                      identity_params(cv))


def subject_set_tags(fold_file: Path) -> dict[str, str]:
    """Run tags naming the participants a fold file leaves out of its subject set, and why (its sidecar's
    `excluded_subjects`): the names comma-separated, their number, and "name: reason | ..." cut to MLflow's tag
    length (the sidecar has all). Empty values for a complete set."""
    excluded: dict[str, str] = (read_fold_parameters(fold_file) or {}).get("excluded_subjects", {})
    reasons = " | ".join(f"{name}: {reason}" for name, reason in excluded.items())
    if len(reasons) > tracking.MAX_TAG_CHARS:
        tail = f" ... (all in {parameters_path(fold_file)})"
        reasons = reasons[: tracking.MAX_TAG_CHARS - len(tail)] + tail
    return {tracking.N_EXCLUDED_TAG: str(len(excluded)), tracking.EXCLUDED_TAG: ",".join(excluded),
            tracking.EXCLUDED_REASONS_TAG: reasons}


def cv_label(tags: Mapping[str, str]) -> str:
    """How a comparison names a CV: the backbone, then what trained when it is not every weight (`frozen`,
    `top_blocks2`, `lora_r8`), the weights file it started from when there was one (`weights 1a2b3c4d`) and a
    temporal head when there is one (`gru_h64x1_two_stage`), then its output when it is not softmax
    (`ordinal_coral`) and its personalisation protocol when there is one (`baseline_k2`), so that strategies,
    starting points, heads, outputs and protocols of one backbone are compared with each other (a run without the
    tags: softmax, none)."""
    label = tags[tracking.MODEL_TAG]
    if tags.get(tracking.FINETUNE_TAG, "full") not in ("", "full"):
        label += f" {tags[tracking.FINETUNE_TAG]}"
    if tags.get(tracking.WEIGHTS_SOURCE_TAG) == "file" and tags.get(tracking.WEIGHTS_SHA256_TAG):
        label += f" weights {tags[tracking.WEIGHTS_SHA256_TAG][:8]}"
    if tags.get(tracking.HEAD_TAG, "linear") not in ("", "linear"):
        label += f" {tags[tracking.HEAD_TAG]}"
    if tags.get(tracking.OUTPUT_TAG, "softmax") not in ("", "softmax"):
        label += f" {tags[tracking.OUTPUT_TAG]}"
    if tags.get(tracking.PERSONALISE_TAG, "none") not in ("", "none"):
        label += f" {tags[tracking.PERSONALISE_TAG]}"
    return label


def config_label(cv: CvConfig) -> str:
    """`cv_label` of the CV a config describes (what `source_cv` looks for)."""
    return cv_label({tracking.MODEL_TAG: cv.model, tracking.FINETUNE_TAG: cv.finetune_label,
                     **tracking.weights_tags(cv.weights_source()), tracking.HEAD_TAG: cv.head_label,
                     **cv.protocol_tags})


def crop_settings(cv: CvConfig) -> dict[str, str]:
    """The config's crop settings as the CV's parent run logs them (parameter name -> value)."""
    return {key: value for key, value in identity_params(cv).items() if key.startswith(CROP_PREFIXES)}


def current_fold_file_sha256(cv: CvConfig) -> str | None:
    """The SHA-256 of the config's fold file, or None where there is none yet."""
    return fold_file_sha256(cv.fold_file) if cv.fold_file.is_file() else None


# ---------------------------------------------------------------------------------------------------------------
# Queries


def quoted(value: str, what: str) -> str:
    """A value for an MLflow filter string; quotes would break the filter, so they are refused."""
    if "'" in value or '"' in value or "`" in value:
        raise ValueError(f"{what} {value!r} contains a quote character, which MLflow run filters cannot hold")
    return f"'{value}'"


def search_all(client: MlflowClient, experiment_ids: Sequence[str], filter_string: str) -> list[Run]:
    """Every run matching `filter_string`, newest first, over as many pages as the store gives."""
    runs: list[Run] = []
    page_token = None
    while True:
        page = client.search_runs(list(experiment_ids), filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time DESC"], page_token=page_token)
        runs.extend(page)
        page_token = page.token
        if not page_token:
            return runs


def _identity_query(tags: Mapping[str, str], keys: Sequence[str] = tracking.IDENTITY_TAGS) -> list[str]:
    return [CV_QUERY] + [f"tags.`{key}` = {quoted(str(tags[key]), key)}" for key in keys]


def newest_cv(client: MlflowClient, experiment_id: str, tags: Mapping[str, str]) -> Run | None:
    """The newest parent run with these identity tags, finished or not (what `make cv` resumes), or None."""
    runs = client.search_runs([experiment_id], " and ".join(_identity_query(tags)),
                              order_by=["attribute.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def why_not_resumed(client: MlflowClient, experiment_id: str, tags: Mapping[str, str], cv: CvConfig) -> str | None:
    """Where no CV has these identity tags but one of the same backbone, data, protocol and task does: which of its
    settings differ (what a person wonders when a CV starts afresh); None where there is no such older CV."""
    similar = " and ".join(_identity_query(tags, (tracking.MODEL_TAG, tracking.DATASET_TAG, tracking.PROTOCOL_TAG,
                                                   tracking.TASK_TAG)))
    older = client.search_runs([experiment_id], similar, order_by=["attribute.start_time DESC"], max_results=1)
    if not older:
        return None
    previous = older[0]
    changes = [f"{key}: {previous.data.tags.get(key)} -> {tags[key]}" for key in tracking.IDENTITY_TAGS
               if key != tracking.CONFIG_SHA256_TAG and previous.data.tags.get(key) != tags[key]]
    # a fold's lease is bookkeeping of the older CV's jobs, logged beside its settings, not a setting
    old = {k: v for k, v in previous.data.params.items() if not k.startswith(tracking.LEASE_TAG)}
    new = identity_params(cv)
    changes += [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)]
    return (f"not resuming {previous.info.run_name!r} ({previous.info.run_id}): its settings differ "
            f"({'; '.join(changes[:8]) or 'config hash'}{' ...' if len(changes) > 8 else ''}); "
            f"starting a new cross-validation")


def finished_cv(client: MlflowClient, cv: CvConfig) -> Run | None:
    """The newest FINISHED parent run of the cross-validation `cv` describes (its identity tags), or None."""
    experiment = client.get_experiment_by_name(cv.experiment)
    if experiment is None:
        return None
    tags = identity_tags(cv, cv.fold_file)
    query = " and ".join([*_identity_query(tags), FINISHED_QUERY])
    runs = client.search_runs([experiment.experiment_id], query, order_by=["attribute.start_time DESC"],
                              max_results=1)
    return runs[0] if runs else None


def latest_finished_cvs(client: MlflowClient, experiment_ids: Sequence[str], dataset: str, protocol: str, task: str,
                        subject_set: str | None = None, fold_file_sha256: str | None = None,
                        params: Mapping[str, str] | None = None,
                        tuned: Mapping[str, str] | str | None = None) -> dict[str, Run]:
    """The most recently started FINISHED parent CV run per backbone, fine-tuning and head (`cv_label`: the `model`
    tag, with the strategy, weights file and temporal head where they are not the default) for this dataset, protocol
    and task
    (and, when given, subject set, fold file and logged parameter values, e.g. the crop settings).

    Untuned CVs only, unless `tuned` names a search budget (`tracking.tune_budget`): then only tuned CVs of exactly
    that budget; `"latest"`: the budget of the newest such tuned CV."""
    conditions = [CV_QUERY, FINISHED_QUERY, f"tags.`{tracking.DATASET_TAG}` = {quoted(dataset, 'dataset')}",
                  f"tags.`{tracking.PROTOCOL_TAG}` = {quoted(protocol, 'protocol')}",
                  f"tags.`{tracking.TASK_TAG}` = {quoted(task, 'task')}"]
    if subject_set is not None:
        conditions.append(f"tags.`{tracking.SUBJECT_SET_TAG}` = {quoted(subject_set, 'subject_set')}")
    if fold_file_sha256 is not None:
        conditions.append(f"tags.`{tracking.FOLD_FILE_TAG}` = {quoted(fold_file_sha256, 'fold_file_sha256')}")
    for key, value in (params or {}).items():
        conditions.append(f"params.`{key}` = {quoted(value, key)}")
    runs = search_all(client, experiment_ids, " and ".join(conditions))
    if tuned == "latest":
        newest = max((r for r in runs if tracking.tune_budget(r)), key=lambda r: r.info.start_time or 0, default=None)
        tuned = tracking.tune_budget(newest) if newest is not None else {"trials": "none"}
    runs = [r for r in runs if tracking.tune_budget(r) == dict(tuned or {})]
    latest: dict[str, Run] = {}
    for run in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.end_time or 0), reverse=True):
        model = run.data.tags.get(tracking.MODEL_TAG)
        if not model:
            log.warning("CV run %s has no 'model' tag; ignored", run.info.run_id)
            continue
        latest.setdefault(cv_label(run.data.tags), run)
    return dict(sorted(latest.items()))


def source_cv(client: MlflowClient, cv: CvConfig, run_id: str | None = None) -> Run:
    """The cross-validation a command works from (`make inspect`, `make final`): RUN=<parent run id>, else the
    newest finished CV of the config's backbone on its data, protocol, task and subject set, on the current fold
    file and crop settings. Raises CvNotFound saying what is missing."""
    if run_id:
        run = client.get_run(run_id)
        if run.data.tags.get(tracking.RUN_KIND_TAG) != tracking.CV_RUN:
            raise CvNotFound(f"run {run_id} is not a cross-validation's parent run")
        return run
    experiment = client.get_experiment_by_name(cv.experiment)
    if experiment is None:
        raise CvNotFound(f"no MLflow experiment {cv.experiment!r}: run `make cv` first")
    # Only a CV trained on crops made as the current ones: its test videos are read from those crops.
    runs = latest_finished_cvs(client, [experiment.experiment_id], cv.dataset, cv.protocol, cv.task,
                               cv.subject_set, current_fold_file_sha256(cv), crop_settings(cv))
    label = config_label(cv)
    if label not in runs:
        raise CvNotFound(f"no finished cross-validation of {label} on {cv.dataset} / {cv.protocol} / {cv.task} "
                         f"with the current fold file and crop settings (preprocess.*, data.synthetic.*): run "
                         f"`make cv MODEL={cv.model}` first, or name one with RUN=<parent run id>")
    return runs[label]


def final_runs(client: MlflowClient, experiment_id: str, key: str) -> list[Run]:
    """The final-model runs (`make final`) of one source CV and final settings (their `FINAL_KEY_TAG`), newest
    first: a finished one is what a second `make final` names, a RUNNING one a killed attempt."""
    query = (f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.FINAL_RUN}' and "
             f"tags.`{tracking.FINAL_KEY_TAG}` = {quoted(key, 'final key')}")
    return client.search_runs([experiment_id], query, order_by=["attribute.start_time DESC"])


def tuning_run_of(client: MlflowClient, experiment_id: str, cv_run_id: str) -> Run | None:
    """The newest search (`make tune`'s TUNING_RUN) of the tuned CV `cv_run_id`, or None."""
    query = (f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.TUNING_RUN}' and "
             f"tags.`{tracking.TUNED_CV_RUN_TAG}` = {quoted(cv_run_id, 'run id')}")
    runs = client.search_runs([experiment_id], query, order_by=["attribute.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def running_children(client: MlflowClient, experiment_id: str, parent_run_id: str) -> list[Run]:
    """The child runs of `parent_run_id` still marked RUNNING (a stopped worker's trials, a killed job's folds)."""
    query = (f"tags.`{tracking.PARENT_TAG}` = {quoted(parent_run_id, 'run id')} and "
             f"attributes.status = '{tracking.RUNNING}'")
    return list(client.search_runs([experiment_id], query))
