"""A search's studies: Optuna's journal storage (an append-only file beside the CV work folder; on shared disk a
journal serves many workers), each study's sampler and pruner, the lock workers take to count and ask, and trials left
RUNNING by a dead worker (failed, their settings queued again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.storages.journal import JournalFileBackend

from pipeline.runs.orchestration import launchers
from pipeline.runs.orchestration.search_space import TuneError
from pipeline.runs.store import fold_lease
from pipeline.utils.paths import resolve_path

FINISHED_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


@dataclass(frozen=True)
class TuneSettings:
    """The `tune` section (configs/tune/default.yaml) and what a study reads beside it, read once where a search or a
    worker starts: the config's seed, the study's direction (`trainer.monitor_mode`), the backbone and task."""

    trials: int
    scope: str  # per_fold | shared
    space: str  # the search space's file (auto: the backbone's, else default)
    sampler: dict  # name (tpe | random), seed (None: the config's), n_startup_trials, multivariate
    pruner: dict  # name (median | none), n_startup_trials, n_warmup_steps
    storage_dir: Path
    max_failures: int
    seed: int
    monitor_mode: str  # max | min
    model: str
    task: str

    @classmethod
    def from_config(cls, cfg: DictConfig) -> TuneSettings:
        tune = OmegaConf.to_container(cfg.tune, resolve=True)
        return cls(int(tune["trials"]), str(tune["scope"]), str(tune["space"]), dict(tune["sampler"]),
                   dict(tune["pruner"]), resolve_path(tune["storage_dir"]), int(tune["max_failures"]), int(cfg.seed),
                   str(cfg.trainer.monitor_mode), str(cfg.model.name), str(cfg.task.name))


def storage_path(tune: TuneSettings, search_key: str) -> Path:
    return tune.storage_dir / f"{tune.model}-{tune.task}-{search_key[:12]}.journal"


def open_storage(path: str | Path) -> optuna.storages.JournalStorage:
    """Optuna's journal storage: an append-only file with a lock beside it, safe for many workers on a shared disk."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def make_sampler(sampler: dict, seed: int) -> optuna.samplers.BaseSampler:
    name = sampler["name"]
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=sampler["n_startup_trials"],
                                          multivariate=sampler["multivariate"])
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise TuneError(f"unknown tune.sampler.name {name!r}; known: tpe, random")


def make_pruner(pruner: dict) -> optuna.pruners.BasePruner:
    name = pruner["name"]
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=pruner["n_startup_trials"],
                                           n_warmup_steps=pruner["n_warmup_steps"])
    if name == "none":
        return optuna.pruners.NopPruner()
    raise TuneError(f"unknown tune.pruner.name {name!r}; known: median, none")


def open_study(tune: TuneSettings, storage: optuna.storages.BaseStorage, name: str, fold: int | None,
               worker: int) -> optuna.Study:
    """The study `name` (created if new), with this worker's sampler: seeded by (seed, fold, worker), so a rerun draws
    the same trials and two workers do not draw the same ones."""
    seed = tune.sampler["seed"] if tune.sampler["seed"] is not None else tune.seed
    direction = "maximize" if tune.monitor_mode == "max" else "minimize"
    return optuna.create_study(storage=storage, study_name=name, direction=direction, load_if_exists=True,
                               sampler=make_sampler(tune.sampler, int(seed) + 1000 * worker + (fold or 0)),
                               pruner=make_pruner(tune.pruner))


def owner_alive(attrs: dict) -> bool:
    """Whether the worker that started a RUNNING trial may still run it: on this host, its process is alive; on
    SLURM, its job is still queued; on another host without SLURM we cannot tell, and it is left alone."""
    if attrs.get("slurm_job"):
        return attrs["slurm_job"] in launchers.slurm_states([attrs["slurm_job"]])
    if "host" not in attrs:  # the owner is written right after the ask, under the same lock: abandoned between
        return False
    if fold_lease.on_this_machine(attrs.get("host")):  # host name, boot id, PID namespace: the pid means that process
        pid = str(attrs.get("pid", ""))
        if not pid.isdigit() or int(pid) == 0:  # killed between writing its host and its pid (and os.kill(0, 0)
            return False                         # would ask this process's own group: "alive")
        try:
            os.kill(int(pid), 0)
        except OSError:
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


def prepare_studies(tune: TuneSettings, storage_file: Path, names: list[tuple[str, int | None]],
                    defaults: dict) -> dict[str, optuna.Study]:
    """Create or load the studies; a new study gets today's settings (`defaults`: `SearchSpace.defaults`) as its
    first trial; a trial left RUNNING by a dead worker is failed and retried."""
    storage = open_storage(storage_file)
    studies = {}
    with study_lock(storage_file):
        for name, fold in names:
            study = open_study(tune, storage, name, fold, 0)
            if not study.get_trials(deepcopy=False):
                study.enqueue_trial(defaults, user_attrs={"default": True})
            failed = retry_stale_trials(study, storage)
            if failed:
                print(f"{name}: trial(s) {', '.join(map(str, failed))} were left running by a stopped worker: "
                      f"marked failed, their settings queued again", flush=True)
            studies[name] = study
    return studies
