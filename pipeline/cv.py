"""`make cv`: participant-grouped cross-validation of one backbone, tracked in MLflow, resumable, on any launcher.

plan -> launch -> aggregate:
- **plan**: compose the config, prepare the data, read the fold file, resolve the weights (a missing checkpoint fails
  in seconds), then find the parent run of an unfinished cross-validation with the same identity (model, dataset,
  protocol, task, subject set, seed, fold file and the resolved config's hash) or create one; folds that have a
  FINISHED child run are done.
- **launch** the pending folds as `FoldJob`s on the configured launcher (`pipeline.launchers`).
- **aggregate** once every fold has a finished child run: mean and spread over folds, pooled metrics, plots, onto
  the parent run, which is then FINISHED. A finished cross-validation with the same identity is not trained again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from omegaconf import DictConfig, OmegaConf

from pipeline import PROJECT_ROOT, launchers, registry, resolve_path, tracking
from pipeline.backbones import weights_source
from pipeline.calc import backbone_cost
from pipeline.devices import cpu_description, precision_for
from pipeline.fold import FoldJob, FoldResult, fold_runs, result_from_run
from pipeline.folds import fold_file_sha256
from pipeline.metrics import classification_metrics, evaluate_predictions, plot_confusion, plot_roc, summarize_folds
from pipeline.prepare import prepare_data, read_fold_file, subject_set_tags
from pipeline.tasks import get_task
from pipeline.weights import WeightsSource

log = logging.getLogger(__name__)
REPORTED = ("auroc", "accuracy", "balanced_accuracy", "f1")
# Settings that change where or how fast a cross-validation runs, not what it computes: not part of its identity.
NOT_IDENTITY = ("launcher", "mlflow", "cv", "reports_dir", "preprocess.workers", "preprocess.device",
                "data.synthetic.workers", "final", "predict")
IDENTITY_TAGS = ("model", "dataset", "protocol", "task", "subject_set", "seed", "fold_file_sha256", "config_sha256")


def git_commit() -> str:
    """HEAD's commit (suffixed -dirty with uncommitted changes), or 'unknown' outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def warn_from_scratch(model_name: str, source: WeightsSource) -> None:
    if source.kind != "random":
        return
    message = (f"{model_name} is training FROM SCRATCH (no pretrained weights). Transformers need far more data than "
               f"87 (or a few synthetic) people to learn from random weights: the ViT paper's lesson is that a ViT "
               f"only beats convolutional nets after large-scale pretraining, and hybrids like CvT and MobileViT "
               f"cope better with little data. Scores are not comparable with fine-tuned runs; provide weights "
               f"with WEIGHTS=/path or pretrained=true to fine-tune.")
    log.warning(message)


def identity_config(cfg: DictConfig) -> dict:
    """The resolved config without the settings in NOT_IDENTITY."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for key in NOT_IDENTITY:
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    return config


def config_sha256(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(identity_config(cfg), sort_keys=True, default=str).encode()).hexdigest()


def flat_params(config: dict) -> dict[str, str]:
    flat = pd.json_normalize(config, sep=".").iloc[0].to_dict()
    return {k: str(v)[:500] for k, v in flat.items()}


@dataclass
class Plan:
    """A cross-validation ready to launch: its parent run and the folds still to do."""

    cfg: DictConfig
    fold_file: Path
    fold_ids: list[int]
    class_names: tuple[str, ...]
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    work_dir: Path
    done: list[int] = field(default_factory=list)
    finished: bool = False  # aggregated before: nothing to do

    @property
    def pending(self) -> list[int]:
        return [fold for fold in self.fold_ids if fold not in self.done]

    def job(self, fold: int, tracking_uri: str | None = None) -> FoldJob:
        return FoldJob(OmegaConf.to_container(self.cfg, resolve=True), int(fold), self.parent_run_id,
                       tracking_uri or self.tracking_uri, str(self.work_dir / f"fold_{fold}"))


def _differences(old: dict[str, str], new: dict[str, str]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in keys if old.get(k) != new.get(k)]


def find_parent(client: MlflowClient, experiment_id: str, tags: dict[str, str], cfg: DictConfig):
    """The newest parent run with these identity tags; if there is none, say why an older CV is not resumed."""
    query = " and ".join(["tags.`painvit.run_kind` = 'cv'"]
                         + [f"tags.`{key}` = '{tags[key]}'" for key in IDENTITY_TAGS])
    runs = client.search_runs([experiment_id], query, order_by=["attribute.start_time DESC"], max_results=1)
    if runs:
        return runs[0]
    similar = " and ".join(["tags.`painvit.run_kind` = 'cv'"]
                           + [f"tags.`{key}` = '{tags[key]}'" for key in ("model", "dataset", "protocol", "task")])
    older = client.search_runs([experiment_id], similar, order_by=["attribute.start_time DESC"], max_results=1)
    if older:
        previous = older[0]
        changes = [f"{key}: {previous.data.tags.get(key)} -> {tags[key]}" for key in IDENTITY_TAGS
                   if key != "config_sha256" and previous.data.tags.get(key) != tags[key]]
        changes += _differences({k: v for k, v in previous.data.params.items()},
                                flat_params(identity_config(cfg)))
        print(f"not resuming {previous.info.run_name!r} ({previous.info.run_id}): its settings differ "
              f"({'; '.join(changes[:8]) or 'config hash'}{' ...' if len(changes) > 8 else ''}); "
              f"starting a new cross-validation")
    return None


@contextlib.contextmanager
def identity_lock(work_dir: Path, identity: str) -> Iterator[None]:
    """One driver per cross-validation identity on this machine: a second one refuses instead of training the
    same folds twice. An OS lock, so a killed driver releases it."""
    path = work_dir / "locks" / f"{identity}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise SystemExit(f"error: the same cross-validation is already running ({holder}); wait for it to "
                             f"finish or stop it, then run the command again to resume") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def plan_cv(cfg: DictConfig, client: MlflowClient, tracking_uri: str) -> Plan:
    frames_result, fold_file = prepare_data(cfg)
    folds = read_fold_file(fold_file, sorted(set(frames_result.frames.subject_name)))
    fold_ids = sorted(int(f) for f in folds.fold.unique()) if cfg.trainer.folds is None else list(cfg.trainer.folds)
    task = get_task(cfg.task.name)
    # Where the weights come from, before any training: a missing checkpoint fails in seconds, not after fold 1.
    weights = weights_source(cfg.model.name, cfg.model.pretrained, cfg.model.weights)
    warn_from_scratch(cfg.model.name, weights)

    artifact_root = resolve_path(cfg.mlflow.artifact_root) if cfg.mlflow.artifact_root else tracking.artifact_root(
        PROJECT_ROOT)
    experiment_id = tracking.get_or_create_experiment(cfg.mlflow.experiment, artifact_root, client=client)
    tags = {"model": cfg.model.name, "dataset": cfg.data.name, "protocol": cfg.protocol.name, "task": task.name,
            "subject_set": cfg.data.subject_set, "seed": str(cfg.seed),
            "fold_file_sha256": fold_file_sha256(fold_file), "config_sha256": config_sha256(cfg)}
    plan = Plan(cfg, fold_file, fold_ids, task.classes, tracking_uri, experiment_id, "", Path())
    parent = find_parent(client, experiment_id, tags, cfg) if cfg.cv.resume == "auto" else None
    if parent is None:
        run_tags = {**tags, "painvit.run_kind": "cv", "git_commit": git_commit(), "fold_file": str(fold_file),
                    "n_folds": str(len(fold_ids)),
                    # a smoke run (some folds, limited batches) is marked so nobody mistakes it for a full CV
                    "complete": str(len(fold_ids) == folds.fold.nunique() and cfg.trainer.limit_train_batches is None
                                    and cfg.trainer.limit_val_batches is None).lower(),
                    "precision": precision_for(cfg.trainer.precision, cfg.trainer.accelerator, cfg.model.name),
                    "cpu": cpu_description(), **weights.as_tags(), **subject_set_tags(fold_file),
                    **registry.standard_tags("make cv")}
        run_name = f"{cfg.model.name} {cfg.data.name} {cfg.protocol.name} {task.name}"
        parent = client.create_run(experiment_id, run_name=run_name, tags=run_tags)
        run_id = parent.info.run_id
        for chunk in _chunks(list(flat_params(identity_config(cfg)).items()), 100):
            client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
        client.log_text(run_id, OmegaConf.to_yaml(cfg), "config.yaml")
        now = int(time.time() * 1000)  # what the backbone costs, for `make compare`'s accuracy-against-cost plot
        cost = backbone_cost(cfg.model.name, cfg.model.img_size, task.n_classes)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in cost.items()])
        client.log_artifact(run_id, str(fold_file), "folds")
        registry.log_subjects(client, run_id, registry.cv_subjects(fold_file, frames_result.frames, task.classes),
                              f"{cfg.data.name}-{task.name}-{fold_file.stem}")
    else:
        plan.finished = parent.info.status == "FINISHED"
        if not plan.finished:
            client.update_run(parent.info.run_id, status="RUNNING")
    plan.parent_run_id = parent.info.run_id
    plan.work_dir = resolve_path(cfg.cv.work_dir) / plan.parent_run_id
    finished = {int(run.data.tags["fold"]) for run in fold_runs(client, plan.parent_run_id)
                if run.info.status == "FINISHED"}
    plan.done = [fold for fold in fold_ids if fold in finished]
    return plan


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def fold_line(result: FoldResult) -> str:
    m = result.metrics
    return (f"video AUROC {m['test/video_auroc']:.3f} acc {m['test/video_accuracy']:.3f} "
            f"bal-acc {m['test/video_balanced_accuracy']:.3f} | frame AUROC {m['test/frame_auroc']:.3f} | "
            f"{result.epochs} epochs (best {result.best_epoch}) | {result.seconds:.0f} s")


class Progress:
    """One line per fold state change, with the overall count: what a person follows in the terminal."""

    def __init__(self, plan: Plan) -> None:
        self.total, self.finished = len(plan.fold_ids), len(plan.done)

    def __call__(self, fold: int, state: str, detail) -> None:
        if state == "done":
            self.finished += 1
            text = f"fold {fold}: done, {fold_line(detail)}"
        else:
            text = f"fold {fold}: {state}" + (f" ({detail})" if detail else "")
        print(f"[{self.finished}/{self.total} folds done] {text}", flush=True)


def launch(plan: Plan, client: MlflowClient) -> launchers.LaunchOutcome:
    """Run the pending folds on the configured launcher (SLURM jobs of an earlier `launcher.wait=false` run that
    are still queued are followed, not submitted again)."""
    launcher = plan.cfg.launcher
    report = Progress(plan)

    def result_of(fold: int) -> FoldResult | None:
        runs = [run for run in fold_runs(client, plan.parent_run_id, fold) if run.info.status == "FINISHED"]
        return result_from_run(client, runs[0]) if runs else None

    def fold_status(fold: int) -> str:
        runs = fold_runs(client, plan.parent_run_id, fold)
        return "FINISHED" if any(run.info.status == "FINISHED" for run in runs) else "other"

    if launcher.name == "local":
        return launchers.launch_local([plan.job(fold) for fold in plan.pending], report)
    if launcher.name == "parallel":
        if plan.tracking_uri.startswith("sqlite:"):  # several writers: through a server, never the file itself
            artifact_root = client.get_experiment(plan.experiment_id).artifact_location
            with launchers.tracking_server(plan.tracking_uri, artifact_root) as uri:
                print(f"MLflow server for the fold jobs: {uri} (over {plan.tracking_uri})")
                return launchers.launch_parallel([plan.job(fold, uri) for fold in plan.pending], launcher.jobs,
                                                 report, result_of)
        return launchers.launch_parallel([plan.job(fold) for fold in plan.pending], launcher.jobs, report, result_of)
    # slurm
    parent = client.get_run(plan.parent_run_id)
    submitted = {int(k): v for k, v in json.loads(parent.data.tags.get("painvit.slurm_jobs", "{}")).items()}
    alive = launchers.slurm_states(list(submitted.values()))
    queued = {fold: job_id for fold, job_id in submitted.items() if fold in plan.pending and job_id in alive}
    to_submit = [fold for fold in plan.pending if fold not in queued]
    if to_submit:
        name = f"painvit-{plan.cfg.model.name}-{plan.parent_run_id[:8]}"
        new = launchers.submit_slurm([plan.job(fold) for fold in to_submit], launcher, plan.work_dir / "slurm", name)
        submitted.update(new)
        queued.update(new)
        client.set_tag(plan.parent_run_id, "painvit.slurm_jobs", launchers.job_ids_tag(submitted))
        print(f"submitted {len(new)} fold job(s) to SLURM: {', '.join(f'fold {f} -> {j}' for f, j in new.items())}")
    if not launcher.wait:
        return launchers.LaunchOutcome(submitted=queued)
    return launchers.wait_slurm(queued, report, fold_status, result_of, launcher.poll_s)


def run_cv(cfg: DictConfig) -> dict:
    """Plan, launch the pending folds, aggregate; returns the aggregate metrics (empty if folds remain)."""
    tracking_uri = cfg.mlflow.tracking_uri or tracking.tracking_uri(PROJECT_ROOT)
    launchers.check_launcher(cfg.launcher, tracking_uri)
    client = MlflowClient(tracking_uri)
    identity_dir = resolve_path(cfg.cv.work_dir)
    with identity_lock(identity_dir, f"{cfg.model.name}-{cfg.data.name}-{cfg.protocol.name}-{cfg.task.name}"):
        plan = plan_cv(cfg, client, tracking_uri)
        name = client.get_run(plan.parent_run_id).info.run_name
        if plan.finished:
            print(f"cross-validation {name!r} already finished with these settings: parent run {plan.parent_run_id} "
                  f"(`make ui` to review; RESUME=never trains a new one)")
            return dict(client.get_run(plan.parent_run_id).data.metrics)
        resumed = f", resuming: {len(plan.done)} fold(s) already done" if plan.done else ""
        precision = precision_for(cfg.trainer.precision, cfg.trainer.accelerator, cfg.model.name)
        print(f"cross-validation: {name}, {len(plan.fold_ids)} folds{resumed}, launcher {cfg.launcher.name}, "
              f"precision {precision} on {cpu_description()}")
        print(f"MLflow: {tracking_uri} (experiment {cfg.mlflow.experiment}, parent run {plan.parent_run_id}); "
              f"`make ui` to review")
        try:
            outcome = launch(plan, client) if plan.pending else launchers.LaunchOutcome()
        except BaseException:
            client.set_terminated(plan.parent_run_id, "KILLED")
            raise
        if outcome.submitted:
            print(f"{len(outcome.submitted)} fold(s) queued on SLURM; run the same command again to follow them "
                  f"and aggregate once all are done")
            return {}
        if outcome.failed:
            client.set_terminated(plan.parent_run_id, "FAILED")
            failed = ", ".join(str(fold) for fold in sorted(outcome.failed))
            raise SystemExit(f"error: fold(s) {failed} failed (traceback in each fold's run); the other folds are "
                             f"kept: run the same command again to retry only the failed ones")
        summary = aggregate(plan, client)
        url = registry.run_url(tracking_uri, plan.experiment_id, plan.parent_run_id)
        print(f"parent run {plan.parent_run_id}: {url}")
        return summary


def aggregate(plan: Plan, client: MlflowClient) -> dict[str, float]:
    """Mean and std across folds, and pooled metrics over all test videos/frames, onto the parent run."""
    results = []
    for fold in plan.fold_ids:
        runs = [r for r in fold_runs(client, plan.parent_run_id, fold) if r.info.status == "FINISHED"]
        results.append(result_from_run(client, runs[0]))
    summary = log_aggregate(client, plan.parent_run_id, results, plan.class_names, plan.cfg)
    client.set_terminated(plan.parent_run_id, "FINISHED")
    table = print_table(results, summary)
    registry.describe_run(client, plan.parent_run_id, f"Cross-validation of {plan.cfg.model.name}: video-level test "
                          f"scores per fold", table.rename_axis("").reset_index())
    return summary


def log_aggregate(client: MlflowClient, run_id: str, results: list[FoldResult], class_names,
                  cfg: DictConfig) -> dict[str, float]:
    fold_metrics = [{k.removeprefix("test/"): v for k, v in r.metrics.items() if k.startswith("test/")}
                    for r in results]
    summary = {f"cv/{k}": v for k, v in summarize_folds(fold_metrics).items()}
    videos = pd.concat([r.video_predictions for r in results], ignore_index=True)
    frames = pd.concat([r.frame_predictions for r in results], ignore_index=True)
    prob_columns = [f"prob_{c}" for c in class_names]
    pooled_video = classification_metrics(videos["label"].to_numpy(), videos[prob_columns].to_numpy())
    pooled_frame = classification_metrics(frames["label"].to_numpy(), frames[prob_columns].to_numpy())
    summary.update({f"pooled/video_{k}": v for k, v in pooled_video.items()})
    summary.update({f"pooled/frame_{k}": v for k, v in pooled_frame.items()})
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in summary.items() if np.isfinite(v)]
    for chunk in _chunks(metrics, 500):
        client.log_batch(run_id, metrics=chunk)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        table = pd.DataFrame([{"fold": r.fold, "run_id": r.run_id, **r.metrics, "seconds": round(r.seconds, 1)}
                              for r in results])
        table.to_csv(out / "folds_summary.csv", index=False)
        videos.to_csv(out / "predictions_videos_all_folds.csv", index=False)
        pooled = evaluate_predictions(frames, class_names, cfg.trainer.aggregation, cfg.trainer.topk)
        plot_confusion(pooled.confusion_video, class_names, out / "confusion_video_pooled.png", "all test videos")
        if len(class_names) == 2 and videos["label"].nunique() == 2:
            plot_roc(videos["label"].to_numpy(), videos[prob_columns[1]].to_numpy(), out / "roc_video_pooled.png",
                     "all test videos")
        pooled.per_subject.to_csv(out / "accuracy_per_subject.csv", index=False)
        client.log_artifacts(run_id, str(out))
    return summary


def print_table(results: list[FoldResult], summary: dict[str, float]) -> pd.DataFrame:
    rows = {f"fold {r.fold}": {m: r.metrics[f"test/video_{m}"] for m in REPORTED} for r in results}
    rows["mean"] = {m: summary[f"cv/video_{m}_mean"] for m in REPORTED}
    rows["std"] = {m: summary[f"cv/video_{m}_std"] for m in REPORTED}
    rows["pooled"] = {m: summary[f"pooled/video_{m}"] for m in REPORTED}
    table = pd.DataFrame(rows).T
    table.columns = [f"video {m}" for m in REPORTED]
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    return table
