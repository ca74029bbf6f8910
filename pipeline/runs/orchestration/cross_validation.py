"""`make cv`: participant-grouped cross-validation of one backbone, tracked in MLflow, resumable, on any launcher.

plan -> launch -> aggregate:
- **plan**: compose the config, prepare the data, read the fold file, resolve the weights (a missing checkpoint fails
  in seconds), then find the parent run of an unfinished cross-validation with the same identity (model, dataset,
  protocol, task, subject set, seed, fold file and the resolved config's hash) or create one; folds that have a
  FINISHED child run are done.
- **launch** the pending folds as `FoldJob`s on the configured launcher (`pipeline.runs.orchestration.launchers`).
- **aggregate** once every fold has a finished child run: mean and spread over folds, pooled metrics, plots
  (`pipeline.runs.orchestration.cv_summary`), onto the parent run, which is then FINISHED, and the folds' work
  folders (checkpoints, local copies of the artifacts) are removed. A finished cross-validation with the same
  identity is not trained again, unless a fold's artifacts have gone from the store since
  (`sealing.retire_unreadable`): that fold is trained again and the CV aggregated anew.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run
from omegaconf import DictConfig

from pipeline.data.exclusions import (
    exclusion_tables,
    folds_without_test_subjects,
    lost_share_warning,
    unusable_for_task,
)
from pipeline.data.prepare import prepare_data, read_fold_file
from pipeline.data.tasks import Task
from pipeline.evaluation.thresholds import parse_rule
from pipeline.models.cost import backbone_cost
from pipeline.models.fold_result import FoldResult
from pipeline.models.weights import WeightsSource, weights_provenance
from pipeline.runs.jobs.fold_decisions import FoldDecisions, plan_decisions
from pipeline.runs.jobs.fold_run import FoldJob, result_from_run, run_seconds
from pipeline.runs.jobs.sealing import retire_unreadable
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.cv_settings import CvRunSettings
from pipeline.runs.orchestration.cv_summary import (
    HEADLINE,
    calibration_line,
    log_aggregate,
    print_table,
    record_precisions,
)
from pipeline.runs.store import cv_runs, fold_lease, registry, tracking
from pipeline.runs.store.environment import library_versions, log_environment
from pipeline.runs.store.unreachable import is_unreachable
from pipeline.utils.accelerator import announce_device, training_device
from pipeline.utils.devices import cpu_description
from pipeline.utils.paths import PROJECT_ROOT, git_commit, resolve_path

log = logging.getLogger(__name__)
# A fold failure whose reason holds one of these is a property of the data: a retry fails the same way.
DATA_ERRORS = ("has no frames of task", "have no frames in", "have no usable videos")


def warn_from_scratch(model_name: str, source: WeightsSource) -> None:
    if source.kind != "random":
        return
    message = (f"{model_name} is training FROM SCRATCH (no pretrained weights). Transformers need far more data than "
               f"87 (or a few synthetic) people to learn from random weights: the ViT paper's lesson is that a ViT "
               f"only beats convolutional nets after large-scale pretraining, and hybrids like CvT and MobileViT "
               f"cope better with little data. Scores are not comparable with fine-tuned runs; provide weights "
               f"with WEIGHTS=/path or pretrained=true to fine-tune.")
    log.warning(message)


def check_pretraining_people(weights: WeightsSource, folds: pd.DataFrame, fold_file: Path) -> dict[str, str]:
    """A WEIGHTS= file's provenance (`make pretrain`'s `<file>.json`) names the people it was trained on; one of them
    among the fold file's subjects is refused, named with both files, before anything trains: a fold would test
    someone its starting point has seen. A file without provenance, or with one that names nobody, is used with a
    warning that nothing could be checked. Returns the `pretraining_people` tag that says which it was."""
    if weights.kind != "file":
        return {}
    sidecar, provenance = weights_provenance(weights.ref)
    identities = ((provenance or {}).get("pool") or {}).get("identities")
    if identities is None:
        why = f"no provenance file {sidecar}" if provenance is None else f"{sidecar} names no pool identities"
        log.warning("WEIGHTS=%s: %s, so nothing could be checked about the people these weights were trained on; "
                    "make sure none of them is among the subjects of %s", weights.ref, why, fold_file)
        return {tracking.PRETRAINING_PEOPLE_TAG: f"unchecked: {why}"}
    subjects = set(folds["subject_name"])
    shared = sorted({str(name) for name in identities} & subjects)
    if shared:
        raise SystemExit(
            f"error: the starting weights {weights.ref} were trained on {len(shared)} of the subjects of {fold_file} "
            f"({', '.join(shared[:10])}{', ...' if len(shared) > 10 else ''}; listed in their provenance {sidecar}): "
            f"a fold would test people its starting point has seen. Pretrain on a pool apart from this dataset "
            f"(make pretrain DATA=<this dataset> checks it) or start from other weights")
    return {tracking.PRETRAINING_PEOPLE_TAG: f"checked: none of the {len(identities)} identities in {sidecar.name} "
                                             f"is among the {len(subjects)} subjects of {fold_file.name}"}


@dataclass
class Plan:
    """A cross-validation ready to launch: its parent run and the folds still to do."""

    config: dict  # the resolved config each fold job gets
    launcher: launchers.LauncherSettings
    model_name: str
    decisions: FoldDecisions  # fold file, precision, backbone family, weights: decided here, once
    trains: WhatTrains  # what trains (strategy, head, output, protocol), read once from `cfg`
    fold_ids: list[int]
    class_names: tuple[str, ...]
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    work_dir: Path
    done: list[tuple[int, int | None]] = field(default_factory=list)  # (fold, seed) with a finished child run
    finished: bool = False  # aggregated before: nothing to do
    seeds: list[int | None] = field(default_factory=lambda: [None])  # cv.seeds, or [None]: the config's seed
    identity: dict[str, str] = field(default_factory=dict)  # the parent's identity tags (fold runs copy some)

    def pending(self, seed: int | None = None) -> list[int]:
        """The folds of `seed` without a finished child run."""
        return [fold for fold in self.fold_ids if (fold, seed) not in self.done]

    @property
    def units(self) -> list[tuple[int, int | None]]:
        return [(fold, seed) for seed in self.seeds for fold in self.fold_ids]

    def job(self, fold: int, tracking_uri: str | None = None, seed: int | None = None) -> FoldJob:
        folder = f"fold_{fold}" + (f"_seed_{seed}" if seed is not None else "")
        return FoldJob(copy.deepcopy(self.config), int(fold), self.parent_run_id,
                       tracking_uri or self.tracking_uri, str(self.work_dir / folder), self.decisions, seed,
                       store_uri=tracking.redact_uri(self.tracking_uri), experiment_id=self.experiment_id,
                       parent_tags={name: self.identity.get(name, "") for name in tracking.INHERITED_TAGS})


@contextlib.contextmanager
def identity_lock(work_dir: Path, key: str, what: str) -> Iterator[None]:
    """One driver per cross-validation on this machine: `key` (`cv_runs.run_key`: its full identity and its store)
    names the lock, so CVs that differ in any identity setting run side by side, and a second driver of the same one
    refuses, naming the first (its pid and `what` it is), instead of training the same folds twice. An OS lock, so
    a killed driver releases it."""
    path = work_dir / "locks" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not said what it is yet"
            raise SystemExit(f"error: the same cross-validation is already running: {holder}; wait for it to "
                             f"finish or stop it, then run the command again to resume") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, {what}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def driver_description(command: str, run: CvRunSettings, tracking_uri: str) -> str:
    """What a CV's driver is, in its lock file (what a second one of the same CV is told): the command, the backbone,
    dataset, protocol, task, strategy, config hash and store."""
    return (f"`{command}` of {run.training.model_name} on {run.data.name} {run.protocol} {run.training.task.name} "
            f"({run.training.finetune.label}, config {cv_runs.config_sha256(run.cv)[:12]}, store "
            f"{tracking.redact_uri(tracking_uri)})")


def plan_cv(run: CvRunSettings, client: MlflowClient, tracking_uri: str) -> Plan:
    """The CV's plan: the data prepared and checked, the folds this task can test, the decisions every fold uses
    (`plan_decisions`), and the parent run: the unfinished one of the same identity (resumed), or a new one."""
    training = run.training  # what every fold trains, read once
    parse_rule(training.threshold_rule)  # a wrong setting fails before any data or training
    trains = WhatTrains.of(training).check()
    frames_result, fold_file = prepare_data(run.data)
    folds = read_fold_file(fold_file, sorted(set(frames_result.frames.subject_name)))
    task = training.task
    trainer = training.trainer
    requested = None if trainer.folds is None else [int(fold) for fold in trainer.folds]
    fold_ids, unusable, skipped = usable_folds(requested, frames_result.frames, folds, task)
    # Where the weights come from, before any training: a missing checkpoint fails in seconds, not after fold 1.
    decisions = plan_decisions(training, fold_file)
    weights = decisions.weights_source
    warn_from_scratch(training.model_name, weights)
    people_checked = check_pretraining_people(weights, folds, fold_file)  # a WEIGHTS= file's people: none tested

    artifact_root = resolve_path(run.artifact_root) if run.artifact_root else tracking.artifact_root(PROJECT_ROOT)
    experiment_id = tracking.get_or_create_experiment(run.experiment, artifact_root, client=client)
    cv = run.cv  # what identifies this CV, read once
    tags = cv_runs.identity_tags(cv, fold_file, weights)  # the weights file hashed once, by plan_decisions()
    plan = Plan(training.config, run.launcher, training.model_name, decisions, trains, fold_ids, task.classes,
                tracking_uri, experiment_id, "", Path(), identity=tags)
    parent = cv_runs.newest_cv(client, experiment_id, tags) if run.resume == "auto" else None
    if parent is None and run.resume == "auto":
        why = cv_runs.why_not_resumed(client, experiment_id, tags, cv)
        if why:
            print(why)
    if parent is None:
        complete = (len(fold_ids) + len(skipped) == folds.fold.nunique() and trainer.limit_train_batches is None
                    and trainer.limit_val_batches is None)
        device = device_tags(run.launcher.name, trainer.accelerator)
        described = {**new_parent_tags(plan, fold_file, complete, unusable, skipped, device), **people_checked}
        parent = create_parent(run, client, experiment_id, tags, described, fold_file, frames_result)
    else:
        # a finished fold whose artifacts have gone from the store is not done: marked FAILED, trained again
        lost = retire_unreadable(client, tracking.fold_runs(client, parent.info.run_id))
        plan.finished = parent.info.status == tracking.FINISHED and not lost
        if not plan.finished:
            client.update_run(parent.info.run_id, status=tracking.RUNNING)
    plan.parent_run_id = parent.info.run_id
    plan.work_dir = run.work_dir / cv_runs.run_key(run.cv, tracking_uri) / plan.parent_run_id
    plan.seeds = list(run.seeds) if run.seeds else [None]
    plan.done = [(fold, seed) for seed in plan.seeds
                 for fold in tracking.finished_fold_runs(client, plan.parent_run_id, seed) if fold in fold_ids]
    return plan


def usable_folds(requested: list[int] | None, frames: pd.DataFrame, folds: pd.DataFrame,
                 task: Task) -> tuple[list[int], dict[str, str], list[int]]:
    """The folds to run (`requested`: `trainer.folds`, or None: every fold of the file), the participants whose kept
    videos cannot serve this task (named, with the reason), and the folds left out because none of their test
    subjects is usable."""
    fold_ids = sorted(int(f) for f in folds.fold.unique()) if requested is None else list(requested)
    unusable = unusable_for_task(frames, task)
    skipped = folds_without_test_subjects(folds, unusable, fold_ids)
    for name, reason in unusable.items():
        print(f"not usable for {task.name}: {name} ({reason})")
    if skipped:
        print(f"fold(s) {', '.join(map(str, skipped))} left out: no test subject there is usable for {task.name}")
        fold_ids = [fold for fold in fold_ids if fold not in skipped]
    return fold_ids, unusable, skipped


def new_parent_tags(plan: Plan, fold_file: Path, complete: bool, unusable: dict[str, str], skipped: list[int],
                    device: dict[str, str]) -> dict[str, str]:
    """What a new parent run is tagged with besides its identity: the commit, the fold file, whether it is a full
    CV, the plan's decisions, the machine (`device`: `device_tags`) and libraries, the strategy and protocol, the
    subject set, the task's unusable subjects and skipped folds, and the standard tags."""
    decisions = plan.decisions
    return {tracking.RUN_KIND_TAG: tracking.CV_RUN, tracking.GIT_COMMIT_TAG: git_commit(),
            tracking.FOLD_FILE_PATH_TAG: str(fold_file), tracking.N_FOLDS_TAG: str(len(plan.fold_ids)),
            # a smoke run (some folds, limited batches) is marked so nobody mistakes it for a full CV
            tracking.COMPLETE_TAG: str(complete).lower(),
            tracking.PRECISION_ASKED_TAG: decisions.precision, tracking.MODEL_FAMILY_TAG: decisions.model_family,
            tracking.CPU_TAG: cpu_description(), **device, **library_versions(),
            **tracking.weights_tags(decisions.weights_source),
            **plan.trains.tags(),  # with whether augment.* was applied (a frozen head on plain embeddings)
            **plan.trains.protocol_tags(),  # output and personalisation protocol (descriptive: not identity)
            **cv_runs.subject_set_tags(fold_file),
            tracking.TASK_UNUSABLE_TAG: ",".join(unusable),
            tracking.TASK_SKIPPED_FOLDS_TAG: ",".join(map(str, skipped)),
            **registry.standard_tags("make cv")}


def create_parent(run: CvRunSettings, client: MlflowClient, experiment_id: str, identity: dict[str, str],
                  described: dict[str, str], fold_file: Path, frames_result) -> Run:
    """A new parent run, tagged with its `identity` and what `described` adds, with the identity params, the resolved
    config, the environment, the backbone's cost, the fold file, what face detection lost and the subjects; where
    another machine's `make cv` of the same CV created its parent meanwhile, the first of the two
    (`fold_lease.first_of_twins`)."""
    task, model_name = run.training.task, run.training.model_name
    run_name = f"{model_name} {run.data.name} {run.protocol} {task.name}"
    parent = client.create_run(experiment_id, run_name=run_name, tags={**identity, **described})
    run_id = parent.info.run_id
    for chunk in cv_runs.chunks(list(cv_runs.identity_params(run.cv).items()), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
    client.log_text(run_id, run.config_yaml, "config.yaml")
    log_environment(client, run_id)
    now = int(time.time() * 1000)  # what the backbone costs, for `make compare`'s accuracy-against-cost plot
    cost = backbone_cost(model_name, run.training.img_size, task.n_classes)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in cost.items()])
    client.log_artifact(run_id, str(fold_file), "folds")
    log_exclusions(client, run_id, frames_result, run.data.preprocess.frames_per_video)
    registry.log_subjects(client, run_id, registry.cv_subjects(fold_file, frames_result.frames, task.classes),
                          f"{run.data.name}-{task.name}-{fold_file.stem}")
    # another machine's `make cv` of the same CV may have created its parent meanwhile: one of the two goes on
    if run.resume == "auto":
        parent = fold_lease.first_of_twins(client, experiment_id,
                                           {tracking.RUN_KIND_TAG: tracking.CV_RUN, **identity}, parent)
    return parent


def device_tags(launcher: str, accelerator: str) -> dict[str, str]:
    """The training device's tags (`trainer.accelerator` here); under the `slurm` launcher each fold's node chooses
    its own, and its fold run carries them."""
    if launcher == "slurm":
        return {tracking.DEVICE_TAG: "chosen on each SLURM node (see the fold runs' device tags)"}
    return tracking.training_device_tags(training_device(accelerator))


def log_exclusions(client: MlflowClient, run_id: str, frames_result, frames_per_video: int) -> None:
    """The videos and frames face detection kept and lost, per class and per subject, onto the parent run."""
    per_class, per_subject = exclusion_tables(frames_result.frames, frames_result.failures, frames_per_video)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(f"data/share_lost_{row.class_name}", float(row.share_lost), now, 0)
                                      for row in per_class.itertuples()])
    warning = lost_share_warning(per_class)
    if warning:
        log.warning(warning)
        client.set_tag(run_id, tracking.DATA_WARNING_TAG, warning)
    with tempfile.TemporaryDirectory() as tmp:
        per_class.to_csv(Path(tmp) / "exclusions_per_class.csv", index=False)
        per_subject.to_csv(Path(tmp) / "exclusions_per_subject.csv", index=False)
        client.log_artifacts(run_id, tmp, "data")


def fold_line(done: FoldResult | Run) -> str:
    """A finished fold's line: its test scores, epochs and time, from its result or its FINISHED run."""
    m, seconds = (done.metrics, done.seconds) if isinstance(done, FoldResult) else (done.data.metrics,
                                                                                   run_seconds(done))
    decided = (f"at threshold {m['test/threshold']:.3f}: acc {m['test/video_accuracy_at_threshold']:.3f} "
               f"bal-acc {m['test/video_balanced_accuracy_at_threshold']:.3f} | " if "test/threshold" in m else "")
    return (f"video AUROC {m['test/video_auroc']:.3f} | {decided}argmax acc {m['test/video_accuracy']:.3f} "
            f"bal-acc {m['test/video_balanced_accuracy']:.3f} | frame AUROC {m['test/frame_auroc']:.3f} | "
            f"{int(m['epochs_trained'])} epochs (best {int(m['best_epoch'])}) | {seconds:.0f} s")


class Progress:
    """One line per fold state change, with the overall count: what a person follows in the terminal."""

    def __init__(self, plan: Plan) -> None:
        self.total, self.finished = len(plan.units), len(plan.done)
        self.seed: int | None = None  # the seed whose folds are running (cv.seeds)

    def __call__(self, fold: int, state: str, detail) -> None:
        name = f"fold {fold}" + (f" seed {self.seed}" if self.seed is not None else "")
        if state == "done":
            self.finished += 1
            text = f"{name}: done, {fold_line(detail)}"
        else:
            text = f"{name}: {state}" + (f" ({detail})" if detail else "")
        print(f"[{self.finished}/{self.total} folds done] {text}", flush=True)


def launch(plan: Plan, client: MlflowClient, session: launchers.LaunchSession) -> launchers.LaunchOutcome:
    """Run the pending folds of every seed, one seed after the other (the launchers know folds, not seeds), with
    what `session` holds open for the command's launches (server, workers)."""
    report = Progress(plan)
    outcome = launchers.LaunchOutcome()
    for seed in plan.seeds:
        if not plan.pending(seed):
            continue
        report.seed = seed
        part = launch_seed(plan, client, seed, report, session)
        outcome.done += part.done
        outcome.failed.update({fold if seed is None else f"{fold} (seed {seed})": reason
                               for fold, reason in part.failed.items()})
        outcome.submitted.update({fold if seed is None else f"{fold} (seed {seed})": job
                                  for fold, job in part.submitted.items()})
    return outcome


def launch_seed(plan: Plan, client: MlflowClient, seed: int | None, report: Progress,
                session: launchers.LaunchSession) -> launchers.LaunchOutcome:
    """Run one seed's pending folds on the configured launcher (SLURM jobs of an earlier `launcher.wait=false` run
    that are still queued are followed, not submitted again), through `session`'s store and workers."""
    launcher = plan.launcher
    pending = plan.pending(seed)

    def result_of(fold: int) -> Run | None:  # a fold is done with its FINISHED child run, whose scores are shown
        runs = tracking.fold_runs(client, plan.parent_run_id, fold, seed, plan.experiment_id)
        return next((run for run in runs if run.info.status == tracking.FINISHED), None)

    # where the jobs write: `launchers.job_store` (as for a search's workers), kept open for the command's next CV
    uri, credentials = session.job_store(launcher.name, plan.tracking_uri, client, plan.experiment_id)
    if launcher.name != "slurm":
        jobs = [plan.job(fold, uri, seed) for fold in pending]
        if launcher.name == "local":
            return launchers.launch_local(jobs, report)
        if plan.trains.finetune.reads_cache:  # else each worker would build the same entry at once, on one core
            jobs[0].prepare_shared_embeddings()
        return launchers.launch_parallel(jobs, launcher.jobs, report, result_of, pool=session.workers(launcher.jobs))
    parent = client.get_run(plan.parent_run_id)
    jobs_tag = tracking.SLURM_JOBS_TAG + (f".seed_{seed}" if seed is not None else "")
    submitted = {int(k): v for k, v in json.loads(parent.data.tags.get(jobs_tag, "{}")).items()}
    alive = launchers.slurm_states(list(submitted.values()))
    queued = {fold: job_id for fold, job_id in submitted.items() if fold in pending and job_id in alive}
    to_submit = [fold for fold in pending if fold not in queued]
    if to_submit:
        name = f"painvit-{plan.model_name}-{plan.parent_run_id[:8]}"
        new = launchers.submit_slurm([plan.job(fold, seed=seed) for fold in to_submit], launcher,
                                     plan.work_dir / "slurm", name + (f"-seed{seed}" if seed is not None else ""),
                                     credentials)
        submitted.update(new)
        queued.update(new)
        client.set_tag(plan.parent_run_id, jobs_tag, json.dumps({str(fold): job for fold, job in submitted.items()}))
        print(f"submitted {len(new)} fold job(s) to SLURM: {', '.join(f'fold {f} -> {j}' for f, j in new.items())}")
    if not launcher.wait:
        return launchers.LaunchOutcome(submitted=queued)
    return launchers.wait_slurm(queued, report, result_of, launcher.poll_s)


def run_cv(cfg: DictConfig, session: launchers.LaunchSession | None = None) -> dict:
    """Plan, launch the pending folds, aggregate; returns the aggregate metrics (empty if folds remain). `session`:
    what the command's CVs share (`launchers.LaunchSession`: `make table`'s, `make power`'s), else this CV's own."""
    if session is None:
        with launchers.LaunchSession() as own:
            return run_cv(cfg, own)
    tracking_uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    launchers.check_launcher(cfg.launcher.name, tracking_uri)
    client = MlflowClient(tracking_uri)
    # Said first, and a GPU that was asked for but cannot be used refused, before any data is prepared or trained
    if cfg.launcher.name == "slurm":
        print(f"device: chosen on each SLURM node (trainer.accelerator={cfg.trainer.accelerator})")
    else:
        announce_device(cfg.trainer.accelerator)
    run = CvRunSettings.from_config(cfg)  # read once
    with identity_lock(run.work_dir, cv_runs.run_key(run.cv, tracking_uri),
                       driver_description("make cv", run, tracking_uri)):
        plan = plan_cv(run, client, tracking_uri)
        name = client.get_run(plan.parent_run_id).info.run_name
        if plan.finished:
            print(f"cross-validation {name!r} already finished with these settings: parent run {plan.parent_run_id} "
                  f"(`make ui` to review; RESUME=never trains a new one)")
            return dict(client.get_run(plan.parent_run_id).data.metrics)
        resumed = f", resuming: {len(plan.done)} fold(s) already done" if plan.done else ""
        seeds = f", {len(plan.seeds)} training seeds each ({', '.join(map(str, plan.seeds))})" if cfg.cv.seeds else ""
        auto = " (each fold resolves it on its device)" if plan.decisions.precision == "auto" else ""
        print(f"cross-validation: {name}, {len(plan.fold_ids)} folds{seeds}{resumed}, launcher {cfg.launcher.name}, "
              f"precision {plan.decisions.precision}{auto}")
        print(f"MLflow: {tracking.redact_uri(tracking_uri)} (experiment {cfg.mlflow.experiment}, parent run "
              f"{plan.parent_run_id}); `make ui` to review")
        # aggregate() finishes it; a store that does not answer cannot be told either: the run stays RUNNING
        with tracking.run_lifecycle(plan.parent_run_id, client, finish=False, left_running=is_unreachable):
            outcome = launch(plan, client, session) if len(plan.done) < len(plan.units) else launchers.LaunchOutcome()
        if outcome.submitted:
            print(f"{len(outcome.submitted)} fold(s) queued on SLURM; run the same command again to follow them "
                  f"and aggregate once all are done")
            return {}
        if outcome.failed:
            client.set_terminated(plan.parent_run_id, tracking.FAILED)
            failed = ", ".join(str(fold) for fold in sorted(outcome.failed))
            message = data_error_message(outcome.failed)
            if message:
                raise SystemExit(message)
            raise SystemExit(f"error: fold(s) {failed} failed (traceback in each fold's run); the other folds are "
                             f"kept: run the same command again to retry only the failed ones")
        summary = aggregate(plan, client)
        url = registry.run_url(tracking_uri, plan.experiment_id, plan.parent_run_id)
        print(f"parent run {plan.parent_run_id}: {url}")
        return summary


def data_error_message(failed: dict[int, str]) -> str | None:
    """For folds that failed on the data itself: what failed and that a retry will not help; None otherwise."""
    data_errors = {fold: reason for fold, reason in failed.items() if any(marker in reason for marker in DATA_ERRORS)}
    if not data_errors:
        return None
    return ("error: fold(s) " + ", ".join(map(str, sorted(data_errors))) + " cannot run on this data, and running "
            "the same command again fails the same way: "
            + "; ".join(f"fold {fold}: {reason}" for fold, reason in sorted(data_errors.items()))
            + ". Fix the data or choose another subject set (`make data` prints which participants lost which videos)")


def aggregate(plan: Plan, client: MlflowClient) -> dict[str, float]:
    """Mean and std across folds, and pooled metrics over all test videos/frames, onto the parent run."""
    results, runs = [], []
    for seed in plan.seeds:
        finished = tracking.finished_fold_runs(client, plan.parent_run_id, seed)
        runs += [finished[fold] for fold in plan.fold_ids]
    results = [result_from_run(client, run) for run in runs]
    record_precisions(client, plan.parent_run_id, runs)
    summary = log_aggregate(client, plan.parent_run_id, results, plan.class_names, Path(plan.decisions.fold_file),
                            several_seeds=plan.seeds != [None], graded=plan.trains.graded)
    client.set_tag(plan.parent_run_id, tracking.HEADLINE_TAG, HEADLINE)  # the number to quote beside the literature
    client.set_terminated(plan.parent_run_id, tracking.FINISHED)
    remove_fold_folders(plan.work_dir)
    table = print_table(results, summary)
    calibration = calibration_line(summary, len(results))
    client.set_tag(plan.parent_run_id, tracking.CALIBRATION_NOTE_TAG, calibration)
    print(calibration)
    print(f"augmentation: {plan.trains.augmentation_label}")
    registry.describe_run(client, plan.parent_run_id, f"Cross-validation of {plan.model_name}: video-level test "
                          f"scores per fold", table.rename_axis("").reset_index())
    return summary


def remove_fold_folders(work_dir: Path) -> None:
    """The fold work folders of a FINISHED cross-validation (epoch checkpoints, the local copies of what each fold
    stored), kept until now so that a fold whose stored files went missing could still be read or resumed."""
    for folder in sorted(work_dir.glob("fold_*")):
        if folder.is_dir():
            try:
                shutil.rmtree(folder)
            except OSError as error:
                log.warning("the fold work folder %s was not removed: %s", folder, error)
