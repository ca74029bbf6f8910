"""A search's studies: Optuna's journal storage (an append-only file beside the CV work folder; on shared disk a
journal serves many workers), each study's sampler and pruner, the lock workers take to count and ask, and trials left
RUNNING by a dead worker (failed, their settings queued again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import optuna
from omegaconf import DictConfig
from optuna.storages.journal import JournalFileBackend

from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.search_space import SearchSpace, TuneError
from pipeline.runs.store import fold_lease
from pipeline.utils.paths import resolve_path

FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def storage_path(cfg: DictConfig, search_key: str) -> Path:
    return resolve_path(cfg.tune.storage_dir) / f"{cfg.model.name}-{cfg.task.name}-{search_key[:12]}.journal"


def open_storage(path: str | Path) -> optuna.storages.JournalStorage:
    """Optuna's journal storage: an append-only file with a lock beside it, safe for many workers on a shared disk."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def make_sampler(tune: DictConfig, seed: int) -> optuna.samplers.BaseSampler:
    name = tune.sampler.name
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=tune.sampler.n_startup_trials,
                                          multivariate=tune.sampler.multivariate)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise TuneError(f"unknown tune.sampler.name {name!r}; known: tpe, random")


def make_pruner(tune: DictConfig) -> optuna.pruners.BasePruner:
    name = tune.pruner.name
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=tune.pruner.n_startup_trials,
                                           n_warmup_steps=tune.pruner.n_warmup_steps)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise TuneError(f"unknown tune.pruner.name {name!r}; known: median, none")


def open_study(cfg: DictConfig, storage: optuna.storages.BaseStorage, name: str, fold: int | None,
               worker: int = 0) -> optuna.Study:
    """The study `name` (created if new), with this worker's sampler: seeded by (seed, fold, worker), so a rerun draws
    the same trials and two workers do not draw the same ones."""
    seed = cfg.tune.sampler.seed if cfg.tune.sampler.seed is not None else cfg.seed
    direction = "maximize" if cfg.trainer.monitor_mode == "max" else "minimize"
    return optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True,
                               sampler=make_sampler(cfg.tune, int(seed) + 1000 * worker + (fold or 0)),
                               pruner=make_pruner(cfg.tune))


def owner_alive(attrs: dict) -> bool:
    """Whether the worker that started a RUNNING trial may still run it: on this host, its process is alive; on
    SLURM, its job is still queued; on another host without SLURM we cannot tell, and it is left alone."""
    if attrs.get("slurm_job"):
        return attrs["slurm_job"] in launchers.slurm_states([attrs["slurm_job"]])
    if "host" not in attrs:  # the owner is written right after the ask, under the same lock: abandoned between
        return False
    if fold_lease.on_this_machine(attrs.get("host")):  # host name, boot id, PID namespace: the pid means that process
        try:
            os.kill(int(attrs.get("pid", 0)), 0)
        except (OSError, ValueError):
            return False
        return True
    return True


def retry_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """Trials left RUNNING by a dead worker: marked FAIL, and their parameters enqueued again (a retry). Returns the
    numbers of the failed trials."""
    failed = []
    study_id = storage.get_study_id_from_name(study.study_name)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if owner_alive(trial.user_attrs):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        if storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):
            # an enqueued trial's settings are all fixed from the start; a drawn one's are those it had drawn
            params = trial.system_attrs.get("fixed_params") or trial.params
            study.enqueue_trial(params, user_attrs={"retry_of": trial.number,
                                                          **{k: v for k, v in trial.user_attrs.items()
                                                             if k == "default"}})
            failed.append(trial.number)
    return failed


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=FINISHED_STATES)


@contextlib.contextmanager
def study_lock(storage: str | Path) -> Iterator[None]:
    """Workers take turns to count and ask, so that n trials means n, not n plus one per worker."""
    with open(f"{storage}.ask.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_studies(cfg: DictConfig, storage_file: Path, names: list[tuple[str, int | None]],
                    space: SearchSpace) -> dict[str, optuna.Study]:
    """Create or load the studies; a new study gets today's settings as its first trial; a trial left RUNNING by a
    dead worker is failed and retried."""
    storage = open_storage(storage_file)
    defaults = space.defaults(cfg)
    studies = {}
    with study_lock(storage_file):
        for name, fold in names:
            study = open_study(cfg, storage, name, fold)
            if not study.get_trials(deepcopy=False):
                study.enqueue_trial(defaults, user_attrs={"default": True})
            failed = retry_stale_trials(study, storage)
            if failed:
                print(f"{name}: trial(s) {', '.join(map(str, failed))} were left running by a stopped worker: "
                      f"marked failed, their settings queued again", flush=True)
            studies[name] = study
    return studies
