"""What a cross-validation's driver reads of its config (`make cv`, and `make tune`'s tuned CV), read once where the
command starts (`CvRunSettings.from_config`) and passed down as a value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.data.prepare import DataSettings
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.orchestration import launchers
from pipeline.runs.store import cv_runs
from pipeline.utils.paths import resolve_path


@dataclass(frozen=True)
class CvRunSettings:
    """What a cross-validation's driver reads of its config (`make cv`, and `make tune`'s tuned CV), read once where
    the command starts and passed down as a value: what every fold trains, the data, what identifies the CV, where
    its folds run, and where it is tracked."""

    training: TrainingSettings
    data: DataSettings
    cv: cv_runs.CvConfig
    launcher: launchers.LauncherSettings
    protocol: str  # protocol.name
    experiment: str  # mlflow.experiment
    artifact_root: str | None  # mlflow.artifact_root (None: the project's)
    resume: str  # cv.resume: auto | never
    work_dir: Path  # cv.work_dir
    seeds: list[int] | None  # cv.seeds: several training seeds per fold
    config_yaml: str  # the composed config as the parent run's config.yaml records it

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CvRunSettings:
        return cls(TrainingSettings.from_config(cfg), DataSettings.from_config(cfg), cv_runs.CvConfig.from_config(cfg),
                   launchers.LauncherSettings.of(cfg.launcher), str(cfg.protocol.name), str(cfg.mlflow.experiment),
                   cfg.mlflow.artifact_root, str(cfg.cv.resume), resolve_path(cfg.cv.work_dir),
                   [int(seed) for seed in cfg.cv.seeds] if cfg.cv.seeds else None, OmegaConf.to_yaml(cfg))
