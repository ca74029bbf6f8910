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

from pipeline.data.fold_files import fold_file_sha256
from pipeline.data.personalise import PersonaliseConfig
from pipeline.data.tasks import Task, get_task
from pipeline.models.backbones import weights_source
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.ordinal import OutputConfig, graded_scoring
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


@dataclass(frozen=True)
class WhatTrains:
    """What a run trains, read once from its config: the task, the fine-tuning strategy, the head, the embedding
    cache's augmented views, the output and the personalisation protocol. It answers whether `augment.*` is applied
    and whether the calls are scored as levels too (`graded`), and says so as tags (`tags`, `protocol_tags`) and in
    words (`augmentation_label`)."""

    task: Task
    finetune: FinetuneConfig
    head: HeadConfig
    cache_views: int  # cache.views: augmented views per crop in the embedding cache (0: the plain embedding)
    output: OutputConfig
    personalise: PersonaliseConfig

    @classmethod
    def from_config(cls, cfg: DictConfig) -> WhatTrains:
        return cls(get_task(cfg.task.name), FinetuneConfig.from_config(cfg), HeadConfig.from_config(cfg.model.head),
                   int(cfg.cache.views), OutputConfig.from_config(cfg.model.get("output")),
                   PersonaliseConfig.from_config(cfg.get("personalise")))

    @property
    def graded(self) -> bool:
        """Whether the calls are scored as levels too (`ordinal.graded_scoring`: MAE, kappa, ...)."""
        return bool(graded_scoring(self.task, self.output))

    @property
    def augmentation_applied(self) -> bool:
        """Whether training applies the `augment.*` settings. Not for a frozen head on cached embeddings without
        augmented views (`cache.views=0`: the plain embedding every epoch), nor for a frozen backbone's two-stage head
        (it trains on plain embeddings); the settings stay in the run's params, as part of its identity."""
        if self.finetune.backbone_fixed and self.head.two_stage:
            return False
        return not (self.finetune.reads_cache and self.cache_views == 0)

    @property
    def augmentation_label(self) -> str:
        """What augmentation training saw, in words: the `augmentation` tag and the fold's and the CV's lines."""
        views = self.cache_views
        if self.finetune.backbone_fixed and self.head.two_stage:
            return "none (frozen backbone: the two-stage head trains on plain embeddings; augment.* not applied)"
        if self.finetune.reads_cache:
            return ("none (frozen embeddings, cache.views=0; augment.* not applied)" if views == 0 else
                    f"{views} augmented view(s) per crop (frozen embeddings, cache.views={views}, drawn with "
                    f"augment.*)")
        if self.head.two_stage:
            return "augment.* on the frame model's images (the two-stage head trains on plain embeddings)"
        return "augment.* on the images"

    def tags(self) -> dict[str, str]:
        """What trains, as tags: the strategy's label (full, frozen, top_blocks2, lora_r8), whether embeddings fed
        it, and whether the `augment.*` settings (logged as params either way) were applied, in words."""
        return {"finetune": self.finetune.label, "embedding_cache": str(self.finetune.reads_cache).lower(),
                "augment_applied": str(self.augmentation_applied).lower(), "augmentation": self.augmentation_label}

    def protocol_tags(self) -> dict[str, str]:
        """The output and personalisation protocol as tags (`tracking.OUTPUT_TAG`, `PERSONALISE_TAG`): descriptive,
        not identity tags, on every new CV; `cv_label` names a CV by them when they are not softmax / none."""
        return {tracking.OUTPUT_TAG: self.output.label, tracking.PERSONALISE_TAG: self.personalise.label}


def identity_config(cfg: DictConfig) -> dict:
    """The resolved config without the settings in NOT_IDENTITY."""
    config = OmegaConf.to_container(cfg, resolve=True)
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


def config_sha256(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(identity_config(cfg), sort_keys=True, default=str).encode()).hexdigest()


def run_key(cfg: DictConfig, store_uri: str, kind: str = "") -> str:
    """A name for one cross-validation on this machine: `[<kind>-]<model>-<data>-<protocol>-<task>-<16 hex>`, the hex
    a SHA-256 of its full identity (`config_sha256`: every setting but NOT_IDENTITY's, cv.seeds included) and of the
    store it is recorded in (its URI without a password). Its driver's lock and its epoch checkpoints' folder are
    named by it, so that CVs that differ in any identity setting, or are recorded in other stores, never share them."""
    digest = hashlib.sha256(f"{config_sha256(cfg)}\n{tracking.redact_uri(store_uri)}".encode()).hexdigest()[:16]
    prefix = f"{kind}-" if kind else ""
    return f"{prefix}{cfg.model.name}-{cfg.data.name}-{cfg.protocol.name}-{cfg.task.name}-{digest}"


def flat_params(config: dict) -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, values cut to MLflow's 500 characters."""
    flat = pd.json_normalize(config, sep=".").iloc[0].to_dict()
    return {k: str(v)[:500] for k, v in flat.items()}


def identity_params(cfg: DictConfig) -> dict[str, str]:
    """The identity config as the flat parameters a CV (and a final model) logs."""
    return flat_params(identity_config(cfg))


def chunks(items: list, size: int) -> Iterator[list]:
    """`items` in lists of at most `size` (MLflow's log_batch takes 100 params or 1000 metrics at a time)."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def identity_tags(cfg: DictConfig, fold_file: Path, weights: WeightsSource | None = None) -> dict[str, str]:
    """The tags that identify a cross-validation (tracking.IDENTITY_TAGS): what resume and `make table` look for.
    `weights`: the initial weights as the plan already resolved them (resolved, and a weights file hashed, here
    otherwise)."""
    weights = weights or weights_source(cfg.model.name, cfg.model.pretrained, cfg.model.weights)
    trains = WhatTrains.from_config(cfg)
    return {"model": cfg.model.name, "dataset": cfg.data.name, "protocol": cfg.protocol.name, "task": cfg.task.name,
            "subject_set": cfg.data.subject_set, "seed": str(cfg.seed),
            "fold_file_sha256": fold_file_sha256(fold_file), "config_sha256": config_sha256(cfg),
            # what trains (full, frozen, top_blocks2, lora_r8) and the SHA-256 of the weights it starts from
            "finetune": trains.finetune.label,
            "initial_weights": weights.sha256 or "random",
            "head": trains.head.label}  # linear, or a temporal head and its mode


class CvSettings(NamedTuple):
    """What a CV parent run records of its settings: its tags and its (flat) parameters."""

    tags: Mapping[str, str]
    params: Mapping[str, str]


def planned_settings(cfg: DictConfig, fold_file: Path, weights: WeightsSource | None = None) -> CvSettings:
    """The identity tags and parameters a complete CV of `cfg` on `fold_file` would log, before it runs: what
    `make compare` checks, asked of configs (tests/test_compare.py runs the default backbones' configs through it)."""
    return CvSettings({**identity_tags(cfg, fold_file, weights), **WhatTrains.from_config(cfg).protocol_tags(),
                       tracking.COMPLETE_TAG: "true"}, identity_params(cfg))


def cv_label(tags: Mapping[str, str]) -> str:
    """How a comparison names a CV: the backbone, then what trained when it is not every weight (`frozen`,
    `top_blocks2`, `lora_r8`), the weights file it started from when there was one (`weights 1a2b3c4d`) and a
    temporal head when there is one (`gru_h64x1_two_stage`), then its output when it is not softmax
    (`ordinal_coral`) and its personalisation protocol when there is one (`baseline_k2`), so that strategies,
    starting points, heads, outputs and protocols of one backbone are compared with each other (a run without the
    tags: softmax, none)."""
    label = tags["model"]
    if tags.get("finetune", "full") not in ("", "full"):
        label += f" {tags['finetune']}"
    if tags.get("weights_source") == "file" and tags.get("weights_sha256"):
        label += f" weights {tags['weights_sha256'][:8]}"
    if tags.get("head", "linear") not in ("", "linear"):
        label += f" {tags['head']}"
    if tags.get(tracking.OUTPUT_TAG, "softmax") not in ("", "softmax"):
        label += f" {tags[tracking.OUTPUT_TAG]}"
    if tags.get(tracking.PERSONALISE_TAG, "none") not in ("", "none"):
        label += f" {tags[tracking.PERSONALISE_TAG]}"
    return label


def config_label(cfg: DictConfig) -> str:
    """`cv_label` of the CV a config describes (what `source_cv` looks for)."""
    source = weights_source(cfg.model.name, cfg.model.pretrained, cfg.model.weights)
    trains = WhatTrains.from_config(cfg)
    return cv_label({"model": cfg.model.name, "finetune": trains.finetune.label,
                     "weights_source": source.kind, "weights_sha256": source.sha256 or "",
                     "head": trains.head.label, **trains.protocol_tags()})


def crop_settings(cfg: DictConfig) -> dict[str, str]:
    """The config's crop settings as the CV's parent run logs them (parameter name -> value)."""
    return {key: value for key, value in identity_params(cfg).items() if key.startswith(CROP_PREFIXES)}


def current_fold_file_sha256(cfg: DictConfig) -> str | None:
    """The SHA-256 of the config's fold file, or None where there is none yet."""
    fold_file = resolve_path(cfg.fold_file)
    return fold_file_sha256(fold_file) if fold_file.is_file() else None


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


def why_not_resumed(client: MlflowClient, experiment_id: str, tags: Mapping[str, str], cfg: DictConfig) -> str | None:
    """Where no CV has these identity tags but one of the same backbone, data, protocol and task does: which of its
    settings differ (what a person wonders when a CV starts afresh); None where there is no such older CV."""
    similar = " and ".join(_identity_query(tags, ("model", "dataset", "protocol", "task")))
    older = client.search_runs([experiment_id], similar, order_by=["attribute.start_time DESC"], max_results=1)
    if not older:
        return None
    previous = older[0]
    changes = [f"{key}: {previous.data.tags.get(key)} -> {tags[key]}" for key in tracking.IDENTITY_TAGS
               if key != "config_sha256" and previous.data.tags.get(key) != tags[key]]
    # a fold's lease is bookkeeping of the older CV's jobs, logged beside its settings, not a setting
    old = {k: v for k, v in previous.data.params.items() if not k.startswith(tracking.LEASE_TAG)}
    new = identity_params(cfg)
    changes += [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)]
    return (f"not resuming {previous.info.run_name!r} ({previous.info.run_id}): its settings differ "
            f"({'; '.join(changes[:8]) or 'config hash'}{' ...' if len(changes) > 8 else ''}); "
            f"starting a new cross-validation")


def finished_cv(client: MlflowClient, cfg: DictConfig) -> Run | None:
    """The newest FINISHED parent run of the cross-validation `cfg` describes (its identity tags), or None."""
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        return None
    tags = identity_tags(cfg, resolve_path(cfg.fold_file))
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
    conditions = [CV_QUERY, FINISHED_QUERY, f"tags.dataset = {quoted(dataset, 'dataset')}",
                  f"tags.protocol = {quoted(protocol, 'protocol')}", f"tags.task = {quoted(task, 'task')}"]
    if subject_set is not None:
        conditions.append(f"tags.subject_set = {quoted(subject_set, 'subject_set')}")
    if fold_file_sha256 is not None:
        conditions.append(f"tags.fold_file_sha256 = {quoted(fold_file_sha256, 'fold_file_sha256')}")
    for key, value in (params or {}).items():
        conditions.append(f"params.`{key}` = {quoted(value, key)}")
    runs = search_all(client, experiment_ids, " and ".join(conditions))
    if tuned == "latest":
        newest = max((r for r in runs if tracking.tune_budget(r)), key=lambda r: r.info.start_time or 0, default=None)
        tuned = tracking.tune_budget(newest) if newest is not None else {"trials": "none"}
    runs = [r for r in runs if tracking.tune_budget(r) == dict(tuned or {})]
    latest: dict[str, Run] = {}
    for run in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.end_time or 0), reverse=True):
        model = run.data.tags.get("model")
        if not model:
            log.warning("CV run %s has no 'model' tag; ignored", run.info.run_id)
            continue
        latest.setdefault(cv_label(run.data.tags), run)
    return dict(sorted(latest.items()))


def source_cv(client: MlflowClient, cfg: DictConfig, run_id: str | None = None) -> Run:
    """The cross-validation a command works from (`make inspect`, `make final`): RUN=<parent run id>, else the
    newest finished CV of the config's backbone on its data, protocol, task and subject set, on the current fold
    file and crop settings. Raises CvNotFound saying what is missing."""
    if run_id:
        run = client.get_run(run_id)
        if run.data.tags.get(tracking.RUN_KIND_TAG) != tracking.CV_RUN:
            raise CvNotFound(f"run {run_id} is not a cross-validation's parent run")
        return run
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        raise CvNotFound(f"no MLflow experiment {cfg.mlflow.experiment!r}: run `make cv` first")
    # Only a CV trained on crops made as the current ones: its test videos are read from those crops.
    runs = latest_finished_cvs(client, [experiment.experiment_id], cfg.data.name, cfg.protocol.name, cfg.task.name,
                               cfg.data.subject_set, current_fold_file_sha256(cfg), crop_settings(cfg))
    label = config_label(cfg)
    if label not in runs:
        raise CvNotFound(f"no finished cross-validation of {label} on {cfg.data.name} / {cfg.protocol.name} "
                         f"/ {cfg.task.name} with the current fold file and crop settings (preprocess.*, "
                         f"data.synthetic.*): run `make cv MODEL={cfg.model.name}` first, or name one with "
                         f"RUN=<parent run id>")
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
    query = f"tags.`{tracking.PARENT_TAG}` = {quoted(parent_run_id, 'run id')} and attributes.status = 'RUNNING'"
    return list(client.search_runs([experiment_id], query))
