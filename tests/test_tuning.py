"""`make tune` on the tiny synthetic twin: a real Optuna journal, real Lightning trials, a real sqlite MLflow store.

One search is killed with SIGKILL in its first trial and run again; the resumed search then serves every check of the
per-fold study (what it logged, where, what it chose) and is repeated on a copy of the data whose test labels are
flipped, which must change nothing the study saw.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import optuna
import pandas as pd
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from pipeline.analysis.compare import compare
from pipeline.analysis.comparison_runs import VERSUS_UNTUNED
from pipeline.data.fold_files import fold_subjects, read_folds
from pipeline.runs.jobs.fold_decisions import settings_here
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration import search_space
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.orchestration.search_workers import TuneWorker, objective, run_worker
from pipeline.runs.orchestration.studies import TuneSettings, make_pruner, open_storage, prepare_studies
from pipeline.runs.orchestration.tuning import CHOSEN_ARTIFACT, run_tune
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import CvConfig
from pipeline.runs.store.cv_runs import latest_finished_cvs as latest_cvs
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT
from tests.conftest import planned, tiny_overrides, training_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# validation loss: a score that moves with every label, so "unchanged" below means the labels were never read
FAST = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
        "loader.batch_size=8", "trainer.max_epochs=1", "trainer.patience=1", "trainer.folds=[0]", "augment=light",
        "trainer.monitor=val/loss", "trainer.monitor_mode=min", "cv.log_models=false", "tune.trials=2")


def load_space(cfg) -> search_space.SearchSpace:
    """The search space of a composed config, as `make tune` and a worker load it."""
    tune = TuneSettings.from_config(cfg)
    return search_space.load_space(tune.space, tune.model, WhatTrains.of(TrainingSettings.from_config(cfg)),
                                   OmegaConf.to_container(cfg, resolve=True))


def tune_config(data: Path, *changes: str):
    """The search's config over the tiny data in `data`, with `changes` (key=value) replacing what they name."""
    keys = {change.split("=", 1)[0] for change in changes}
    kept = [o for o in tiny_overrides(data, *FAST) if o.split("=", 1)[0] not in keys]
    return load_config([*kept, *changes], groups=("tune=default",))


def journal_trials(path: Path) -> list[optuna.trial.FrozenTrial]:
    if not path.is_file():
        return []
    storage = open_storage(path)
    return [t for study in storage.get_all_studies() for t in storage.get_all_trials(study._study_id)]


def flipped_copy(base: Path, fold_file: Path, out: Path, role: str) -> Path:
    """The processed data of `base` with every video of fold 0's `role` subjects given the other class."""
    processed = out / "processed"
    processed.mkdir(parents=True)
    (processed / "crops").symlink_to(base / "processed" / "crops")
    frames = pd.read_csv(base / "processed" / "frames.csv", dtype=str, keep_default_na=False)
    members = fold_subjects(read_folds(fold_file), 0)[role]
    swap = {"BL1": "PA4", "PA4": "BL1"}
    chosen = frames["subject_name"].isin(members) & frames["class_name"].isin(swap)
    frames.loc[chosen, "class_name"] = frames.loc[chosen, "class_name"].map(swap)
    frames.to_csv(processed / "frames.csv", index=False)
    return processed


def test_a_trial_owner_is_judged_by_its_process_on_this_machine() -> None:
    """A RUNNING trial's worker: alive while its process is; dead once gone, or where it was killed between writing
    its host and its pid (seen in CI: the pid missing read as 0, and os.kill(0, 0) answered for this process group,
    so the trial was never retried and the search stopped one trial short)."""
    from pipeline.runs.orchestration.studies import owner_alive
    from pipeline.runs.store import fold_lease

    here = fold_lease.machine_identity()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert owner_alive({"host": here, "pid": str(child.pid)})
    finally:
        child.kill()
        child.wait()
    assert not owner_alive({"host": here, "pid": str(child.pid)})
    assert not owner_alive({"host": here})  # killed before its pid was written
    assert not owner_alive({"host": here, "pid": "0"}) and not owner_alive({"host": here, "pid": "x"})
    assert not owner_alive({})  # killed before its host was written
    assert owner_alive({"host": "another-host boot=1 pidns=2", "pid": "1"})  # elsewhere: not judged by a number


def test_a_killed_search_resumes_and_the_study_never_sees_test_subjects(tiny_base: Path, tmp_path: Path) -> None:
    base = tmp_path / "store"
    changes = (f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}", f"mlflow.artifact_root={base / 'art'}",
               f"cv.work_dir={base / 'runs'}")
    overrides = [o for o in tiny_overrides(tiny_base, *FAST) if o.split("=", 1)[0] not in
                 {c.split("=", 1)[0] for c in changes}] + list(changes)
    cfg = tune_config(tiny_base, *changes)
    journals = base / "runs" / "optuna"

    # 1. `make tune` in a process of its own, killed with SIGKILL while its first trial trains
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "tune", *overrides], cwd=PROJECT_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        files = list(journals.glob("*.journal")) if journals.is_dir() else []
        if files and any(t.state == optuna.trial.TrialState.RUNNING for t in journal_trials(files[0])):
            break
        time.sleep(0.1)
    assert process.poll() is None, "the search ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    (journal,) = journals.glob("*.journal")
    assert [t.state.name for t in journal_trials(journal)] == ["RUNNING"]

    # 2. the same command again: the dead trial is failed and retried, the study ends with exactly 2 finished trials
    summary = run_tune(cfg)
    assert "pooled/video_auroc" in summary
    trials = journal_trials(journal)
    finished = [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    assert [t.state.name for t in trials][0] == "FAIL" and len(finished) == 2
    assert len({t.number for t in trials}) == len(trials)
    assert len({json.dumps(t.params, sort_keys=True) for t in finished}) == 2  # no finished trial twice
    defaults = load_space(cfg).defaults(cfg)
    assert trials[0].user_attrs["default"] and trials[0].system_attrs["fixed_params"] == defaults
    assert finished[0].params == defaults and finished[0].user_attrs["retry_of"] == 0  # today's settings, retried

    # 3. what the store holds: a tuning run with one child per (fold, trial), never taken for a fold of a CV
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    (tuning,) = client.search_runs([experiment], f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.TUNING_RUN}'")
    (cv,) = client.search_runs([experiment], f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.CV_RUN}'")
    assert cv.info.status == "FINISHED" and tuning.info.status == "FINISHED"
    assert cv.data.tags[tracking.TUNED_TAG] == "true" and cv.data.tags["painvit.tune_scope"] == "per_fold"
    assert cv.data.tags[tracking.TUNING_RUN_TAG] == tuning.info.run_id and cv.data.tags["painvit.tune_trials"] == "2"
    children = client.search_runs([experiment], f"tags.`{tracking.PARENT_TAG}` = '{tuning.info.run_id}'")
    assert {c.data.tags[tracking.RUN_KIND_TAG] for c in children} == {tracking.TRIAL_RUN}
    states = dict(sorted((c.data.tags[tracking.TRIAL_TAG], c.info.status) for c in children))
    # the killed trial's run, if it had started one, is marked KILLED; the finished trials' runs are FINISHED
    assert states.pop("0", "KILLED") == "KILLED" and states == {"1": "FINISHED", "2": "FINISHED"}
    assert all(len(client.get_metric_history(c.info.run_id, "val/loss")) == 1 for c in children if c.data.metrics)
    assert tracking.fold_runs(client, tuning.info.run_id) == []  # no CV view takes a trial for a fold
    assert len(tracking.finished_fold_runs(client, cv.info.run_id)) == 1
    chosen = json.loads(Path(client.download_artifacts(tuning.info.run_id, CHOSEN_ARTIFACT)).read_text())
    best = min(finished, key=lambda t: t.value)
    assert chosen["folds"]["0"]["params"] == best.params and chosen["folds"]["0"]["trial"] == best.number
    on_cv = json.loads(Path(client.download_artifacts(cv.info.run_id, CHOSEN_ARTIFACT)).read_text())
    assert on_cv["0"]["params"] == best.params
    # make compare: tuned CVs are compared only among themselves, of one budget; untuned views do not see them
    where = (client, [experiment], "synthetic", cfg.protocol.name, cfg.task.name)
    assert latest_cvs(*where) == {}
    assert [r.info.run_id for r in latest_cvs(*where, tuned="latest").values()] == [cv.info.run_id]
    other = {**tracking.tune_budget(cv), "trials": "3"}
    assert latest_cvs(*where, tuned=other) == {}
    plots = {a.path for a in client.list_artifacts(tuning.info.run_id, "plots")}
    assert any(p.endswith("_history.png") for p in plots)
    # ... and against its untuned twin when asked: the same backbone's plain CV on the same fold, paired over subjects
    untuned = run_cv(load_config([o for o in overrides if not o.startswith("tune.")]))  # a plain `make cv`
    assert "pooled/video_auroc" in untuned
    (plain,) = latest_cvs(*where).values()
    versus = compare("synthetic", cfg.protocol.name, cfg.task.name, tmp_path / "compare",
                     tracking_uri=cfg.mlflow.tracking_uri, tuned=VERSUS_UNTUNED, allow_incomplete=True)
    assert versus["parent_run_ids"] == {"mobilevit_xxs": plain.info.run_id, "mobilevit_xxs tuned": cv.info.run_id}
    assert set(versus["subjects_paired"][["model_a", "model_b"]].itertuples(index=False, name=None)) == {
        ("mobilevit_xxs", "mobilevit_xxs tuned")}

    # 4. the same study on data whose test labels are flipped: the same trials, values and choice
    fold_file = Path(cv.data.tags["fold_file"])
    flipped = flipped_copy(tiny_base, fold_file, tmp_path / "flipped", "test")
    again = run_study(cfg, client, experiment, flipped, tmp_path / "flipped.journal")
    assert [(t.params, t.value) for t in again] == [(t.params, t.value) for t in finished]
    # ... while flipping the validation labels does change what the study sees (the check above can fail)
    moved = run_study(cfg, client, experiment, flipped_copy(tiny_base, fold_file, tmp_path / "val", "val"),
                      tmp_path / "val.journal", trials=1)
    assert moved[0].value != finished[0].value


def run_study(cfg, client: MlflowClient, experiment: str, processed: Path, journal: Path, trials: int = 2):
    """Fold 0's study over `processed` in a journal of its own, trials logged under a tuning run of their own."""
    changed = tune_config(Path(cfg.data.root).parent, f"data.processed_dir={processed}",
                          f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}", f"tune.trials={trials}")
    decisions = planned(changed)
    run = client.create_run(experiment, tags={tracking.RUN_KIND_TAG: tracking.TUNING_RUN})
    name = [("flipped-fold0", 0)]
    prepare_studies(TuneSettings.from_config(changed), journal, name, load_space(changed).defaults(changed))
    worker = TuneWorker(OmegaConf.to_container(changed, resolve=True), name, [0], str(journal), run.info.run_id,
                        cfg.mlflow.tracking_uri, str(journal.parent / f"{journal.stem}-work"), asdict(decisions))
    run_worker(worker)
    return [t for t in journal_trials(journal) if t.state == optuna.trial.TrialState.COMPLETE]


def test_pruning_stops_a_trial_below_the_median(tiny_base: Path, tmp_path: Path) -> None:
    """A study whose earlier trial reached a validation loss of 0 after every epoch: a new trial's first epoch is
    worse than that median, so it is stopped after it, not trained for its 3 epochs. The trial trains at
    `trainer.precision=auto` (the default), resolved on the worker's device as a fold job resolves it."""
    cfg = tune_config(tiny_base, "trainer.max_epochs=3", "tune.pruner.n_warmup_steps=0", "trainer.precision=auto",
                      "tune.pruner.n_startup_trials=1", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = tracking.get_or_create_experiment("tune-tests", tmp_path / "art", client=client)
    run = client.create_run(experiment, tags={tracking.RUN_KIND_TAG: tracking.TUNING_RUN})
    study = optuna.create_study(direction="minimize", pruner=make_pruner(TuneSettings.from_config(cfg).pruner),
                                sampler=optuna.samplers.RandomSampler(seed=0))
    study.add_trial(optuna.trial.create_trial(value=0.0, intermediate_values={0: 0.0, 1: 0.0, 2: 0.0}))
    worker = TuneWorker(OmegaConf.to_container(cfg, resolve=True), [("s", 0)], [0], "", run.info.run_id,
                        cfg.mlflow.tracking_uri, str(tmp_path / "work"),
                        asdict(planned(cfg)))
    trial = study.ask()
    with pytest.raises(optuna.TrialPruned):
        objective(worker, load_space(cfg), trial, 0)
    (child,) = client.search_runs([experiment], f"tags.`{tracking.PARENT_TAG}` = '{run.info.run_id}'")
    assert child.data.tags[tracking.TRIAL_STATE_TAG] == "PRUNED" and child.data.metrics["epochs_trained"] == 1
    assert len(client.get_metric_history(child.info.run_id, "val/loss")) == 1
    here = settings_here(planned(cfg), cfg.trainer.channels_last, cfg.trainer.accelerator)
    assert (child.data.tags["precision_asked"], child.data.tags["precision"]) == ("auto", here.precision)


def test_a_two_stage_trial_trains_and_scores_the_head_the_cv_would_keep(tiny_base: Path, tmp_path: Path) -> None:
    """A tuned two-stage CV searches the head it trains: its trial runs the fold's training path, second stage
    included, and its value is the head's best validation score (higher-better, negated for a study that minimises
    the frame model's validation loss), not the frame model's."""
    cfg = tune_config(tiny_base, "loader.clip_frames=3", "model.head.name=gru", "model.head.hidden=8",
                      "model.head.epochs=3", "model.head.patience=2", "trainer.max_epochs=2",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = tracking.get_or_create_experiment("tune-tests", tmp_path / "art", client=client)
    run = client.create_run(experiment, tags={tracking.RUN_KIND_TAG: tracking.TUNING_RUN})
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0))
    worker = TuneWorker(OmegaConf.to_container(cfg, resolve=True), [("s", 0)], [0], "", run.info.run_id,
                        cfg.mlflow.tracking_uri, str(tmp_path / "work"),
                        asdict(planned(cfg)))
    value = objective(worker, load_space(cfg), study.ask(), 0)
    (child,) = client.search_runs([experiment], f"tags.`{tracking.PARENT_TAG}` = '{run.info.run_id}'")
    metrics = child.data.metrics
    assert child.data.tags[tracking.TRIAL_STATE_TAG] == "COMPLETE"
    assert metrics["tune/frame_model_epochs"] == 2  # the frame model's epochs (its val/loss fed the pruner) ...
    assert 1 <= metrics["epochs_trained"] <= 3  # ... then the head's, which the value scores
    assert len(client.get_metric_history(child.info.run_id, "val/loss")) == 2
    assert value == metrics["tune/value"] and -1.0 <= value <= 0.0  # minus the head's validation AUROC (or loss)


def test_every_backbone_has_a_search_space_that_starts_at_its_configured_settings() -> None:
    """Each model config (on the twin, and ViT-B/16 on BioVid) composes with `tune`, finds its space, and today's
    values lie inside it; a default outside its range is an error naming the file."""
    from pipeline.runs.orchestration.search_space import TuneError
    from pipeline.utils.config import CONFIG_DIR

    models = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml") if p.stem != "timm")
    for overrides in [[f"model={m}"] for m in models] + [["model=vit_b16", "data=biovid", "data.root=/nowhere"]]:
        cfg = load_config(overrides, groups=("tune=default",))
        space = load_space(cfg)
        assert set(space.defaults(cfg)) == {p.key for p in space.parameters}, overrides
        assert all(p.log for p in space.parameters if p.key.endswith("_lr")), overrides
    vit_ref = load_space(load_config(["model=vit_ref"], groups=("tune=default",)))
    assert "model.optim.layer_decay" not in {p.key for p in vit_ref.parameters}  # removed by its own file
    with pytest.raises(TuneError, match=r"spaces/default.yaml.*head_lr = 0.5"):
        cfg = load_config(["model=mobilevit_xxs", "model.optim.head_lr=0.5"], groups=("tune=default",))
        load_space(cfg).defaults(cfg)


def test_two_parallel_workers_share_one_study_without_a_lost_trial(tiny_base: Path, tmp_path: Path,
                                                                   capsys) -> None:
    """`make tune LAUNCHER=parallel JOBS=2`: two worker processes ask one study (a journal file) for trials through
    one tracking server. Four trials asked, four finished, each number once, each with one finished trial run, and
    every trial names the worker process that ran it."""
    base = tmp_path / "store"
    cfg = tune_config(tiny_base, f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}",
                      f"mlflow.artifact_root={base / 'art'}", f"cv.work_dir={base / 'runs'}", "tune.trials=4",
                      "launcher=parallel", "launcher.jobs=2")
    summary = run_tune(cfg)
    assert "pooled/video_auroc" in summary
    (journal,) = (base / "runs" / "optuna").glob("*.journal")
    trials = journal_trials(journal)
    finished = [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    assert len(finished) == len(trials) == 4 and sorted(t.number for t in trials) == [0, 1, 2, 3]
    workers = set(re.findall(r"search worker \d: pid (\d+)", capsys.readouterr().out))
    assert len(workers) == 2  # two worker processes were started ...
    # ... and they ran every trial (which of them asks first is the OS's choice), the driver none
    assert {t.user_attrs["pid"] for t in trials} <= workers
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    (tuning,) = client.search_runs([experiment], f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.TUNING_RUN}'")
    children = client.search_runs([experiment], f"tags.`{tracking.PARENT_TAG}` = '{tuning.info.run_id}'")
    assert sorted(c.data.tags[tracking.TRIAL_TAG] for c in children) == ["0", "1", "2", "3"]
    assert all(c.info.status == "FINISHED" for c in children)
    logs = sorted((base / "runs").rglob("worker_*.log"))
    assert len(logs) == 2, logs  # two workers were started, each with its log


def test_a_frozen_trial_reads_the_embedding_cache_and_still_never_the_test_subjects(tiny_base: Path) -> None:
    """`model.finetune=frozen` in a study: the trial's data are the cached embeddings (no backbone runs in training),
    with the study's roles: the fold's test subjects are not among its rows."""
    from pipeline.data.datamodule import SubjectRoles
    from pipeline.data.embeddings import EmbeddingDataModule
    from pipeline.runs.jobs.fold_job import build_fold

    cfg = tune_config(tiny_base, "model.finetune=frozen")
    decisions = planned(cfg)
    study = SubjectRoles.of_fold(Path(cfg.fold_file), 0).validation_as_test()  # a study's roles (search_workers)
    built = build_fold(*training_of(cfg), study, decisions)
    module, datamodule = built.module, built.datamodule
    assert isinstance(datamodule, EmbeddingDataModule)
    assert module.finetune.name == "frozen" and type(module.finetune).__name__ == "FrozenOnEmbeddings"
    roles = fold_subjects(read_folds(Path(cfg.fold_file)), 0)
    seen = set().union(*(set(datamodule.frames(role)["subject_name"]) for role in ("train", "val", "test")))
    assert seen == set(roles["train"]) | set(roles["val"]) and not seen & set(roles["test"])


def test_a_strategy_key_that_names_no_strategy_is_an_error(tmp_path: Path, monkeypatch) -> None:
    """A search space's `strategies` keys are `model.finetune` values (STRATEGIES): ViT-B/16's file once keyed its
    frozen override `linear_probe`, so frozen studies searched backbone settings that do nothing."""
    from pipeline.utils.config import CONFIG_DIR

    for path in (CONFIG_DIR / "tune" / "spaces").glob("*.yaml"):  # every shipped space, with every strategy's changes
        for strategy in ("full", "frozen", "top_blocks", "lora"):
            extra = ["model.finetune_blocks=1"] if strategy == "top_blocks" else []
            load_space(load_config([f"model.finetune={strategy}", f"tune.space={path.stem}", *extra],
                                   groups=("tune=default",)))
    (tmp_path / "default.yaml").write_text((CONFIG_DIR / "tune" / "spaces" / "default.yaml").read_text())
    (tmp_path / "probe.yaml").write_text("extends: default\nstrategies:\n  linear_probe:\n"
                                         "    model.optim.backbone_lr: null\n")
    monkeypatch.setattr(search_space, "SPACES_DIR", tmp_path)
    cfg = load_config(["model.finetune=frozen", "tune.space=probe"], groups=("tune=default",))
    with pytest.raises(search_space.TuneError, match=r"probe.yaml: strategies key\(s\) 'linear_probe' name no "
                                                     r"fine-tuning strategy; model.finetune is one of full, frozen, "
                                                     r"top_blocks, lora"):
        load_space(cfg)


def test_a_frozen_study_searches_neither_backbone_settings_nor_augmentation_it_does_not_apply() -> None:
    def keys(*overrides: str) -> set[str]:
        return {p.key for p in load_space(load_config(["model=vit_b16", *overrides], groups=("tune=default",)))
                .parameters}

    full, frozen = keys(), keys("model.finetune=frozen")
    assert {"model.optim.backbone_lr", "model.optim.layer_decay", "augment.affine.p"} <= full
    backbone = {"model.optim.backbone_lr", "model.optim.layer_decay", "model.optim.freeze_backbone_epochs"}
    assert not frozen & backbone and not any(key.startswith("augment.") for key in frozen)  # plain embeddings
    assert "model.optim.head_lr" in frozen
    # with augmented views in the cache, or on images, augment.* is applied and searched again
    assert "augment.affine.p" in keys("model.finetune=frozen", "cache.views=2")
    assert "augment.affine.p" in keys("model.finetune=frozen", "cache.embeddings=false")


def test_the_study_key_holds_the_weights_sha256_not_their_path(tiny_base: Path, tmp_path: Path) -> None:
    """A weights file changed in place is a new study; the same file at another path is the same study."""
    import shutil

    import torch

    from pipeline.models.backbones import create_backbone
    from pipeline.runs.jobs.pretrain import backbone_state
    from pipeline.runs.orchestration.tuning import search_key

    def save(seed: int, path: Path) -> Path:
        torch.manual_seed(seed)
        backbone, _ = create_backbone("mobilevit_xxs", pretrained=False, img_size=32)
        torch.save(backbone_state(backbone), path)
        return path

    def key_for(path: Path) -> str:
        cfg = tune_config(tiny_base, "model.pretrained=true", f"model.weights={path}")
        return search_key(CvConfig.from_config(cfg), load_space(cfg), "f" * 64, planned(cfg))

    weights = save(0, tmp_path / "start.pt")
    first = key_for(weights)
    moved = shutil.copy(weights, tmp_path / "elsewhere.pt")
    assert key_for(Path(moved)) == first  # the same file at another path: the same study
    save(1, weights)  # other weights at the same path
    assert key_for(weights) != first
