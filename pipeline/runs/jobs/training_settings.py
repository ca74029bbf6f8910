"""What one training reads of its configuration, read once where it starts (a fold job, a tuning trial, the final
model) and handed down as a value (`TrainingSettings`): the training path below it (`fold_job`, `head_modes`,
`fold_fit`, `two_stage`) takes these typed settings, never the config. `make pretrain` reads its own
(`PretrainSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.data.datamodule import LoaderConfig
from pipeline.data.personalise import PersonaliseConfig
from pipeline.data.prepare import DataSettings
from pipeline.data.tasks import Task, get_task
from pipeline.models.embedding_cache import CacheSettings
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.lightning_module import OptimConfig
from pipeline.models.ordinal import OutputConfig
from pipeline.models.temporal_heads import HeadConfig
from pipeline.utils.paths import resolve_path


@dataclass(frozen=True)
class TrainerSettings:
    """The `trainer` group (configs/trainer/default.yaml holds every default), every key given."""

    max_epochs: int
    patience: int
    monitor: str
    monitor_mode: str
    accelerator: str
    devices: int
    precision: str
    channels_last: bool | str
    gradient_clip_val: float | None
    label_smoothing: float
    class_weights: str | list[float] | None
    aggregation: str
    topk: int
    deterministic: bool
    log_every_n_steps: int
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    folds: list[int] | None

    @classmethod
    def from_config(cls, trainer: dict[str, Any]) -> TrainerSettings:
        names = {field.name for field in fields(cls)}
        unknown, missing = sorted(set(trainer) - names), sorted(names - set(trainer))
        if unknown or missing:
            raise ValueError(f"trainer: unknown setting(s) {unknown}, missing {missing}")
        return cls(**trainer)

    @property
    def limits(self) -> dict[str, int | float]:
        """The batch limits that are set (`limit_train_batches`, `limit_val_batches`): a smoke run's."""
        return {name: value for name, value in (("limit_train_batches", self.limit_train_batches),
                                                ("limit_val_batches", self.limit_val_batches)) if value is not None}


@dataclass(frozen=True)
class TrainingSettings:
    """What one training reads of its config (see the module docstring)."""

    task: Task
    finetune: FinetuneConfig  # the strategy, and whether a fixed backbone's head reads the embedding cache
    head: HeadConfig
    output: OutputConfig
    personalise: PersonaliseConfig
    trainer: TrainerSettings
    optim: OptimConfig
    loader: LoaderConfig
    clip_frames: int  # loader.clip_frames: crops per clip of a temporal head
    loader_record: dict  # the `loader` section as a kept model records it
    head_record: dict  # the `model.head` section as a kept clip model records it
    augment: dict  # the `augment` section
    cache: CacheSettings  # the embedding cache's views, seed and batch size
    model_name: str
    img_size: int | None
    pretrained: bool | str  # model.pretrained: true | false | auto
    weights: str | None  # model.weights: a weights file or folder
    seed: int
    dataset: str
    processed_dir: Path
    threshold_rule: str | float  # eval.threshold
    fold_plots: bool  # cv.fold_plots
    log_models: bool  # cv.log_models
    config: dict  # the resolved config, for what records it whole (a kept MLflow model's crop settings)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> TrainingSettings:
        """The settings of a composed (or a job's resolved) config, checked."""
        loader = OmegaConf.to_container(cfg.loader, resolve=True)
        return cls(get_task(cfg.task.name), FinetuneConfig.from_config(cfg.model, cfg.cache),
                   HeadConfig.from_config(cfg.model.head), OutputConfig.from_config(cfg.model.get("output")),
                   PersonaliseConfig.from_config(cfg.get("personalise")),
                   TrainerSettings.from_config(OmegaConf.to_container(cfg.trainer, resolve=True)),
                   OptimConfig(**OmegaConf.to_container(cfg.model.optim, resolve=True)),
                   LoaderConfig.from_config(cfg.loader), int(cfg.loader.clip_frames), loader,
                   OmegaConf.to_container(cfg.model.head, resolve=True),
                   OmegaConf.to_container(cfg.augment, resolve=True), CacheSettings.from_config(cfg.cache),
                   str(cfg.model.name), cfg.model.img_size, cfg.model.pretrained, cfg.model.weights, int(cfg.seed),
                   str(cfg.data.name),
                   resolve_path(cfg.data.processed_dir), cfg.eval.threshold, bool(cfg.cv.fold_plots),
                   bool(cfg.cv.log_models), OmegaConf.to_container(cfg, resolve=True))

    def with_seed(self, seed: int) -> TrainingSettings:
        """The same training under another seed (one of `cv.seeds`)."""
        return replace(self, seed=int(seed), config={**self.config, "seed": int(seed)})


@dataclass(frozen=True)
class PretrainSettings:
    """What `make pretrain` reads of its config, read once by `run_pretrain`: the `pretrain` group, the CV dataset
    the pool is kept apart from (and whose crop settings it shares), the backbone, and how it trains."""

    target: str  # au | identity
    pool: str  # synthetic | folder
    pool_dir: Path
    out_dir: Path
    epochs: int  # pretrain.epochs, else the backbone's preset, else default_epochs
    batch_size: int  # pretrain.batch_size, else loader.batch_size
    lr: float
    backbone_lr: float
    weight_decay: float
    held_out_share: float
    synthetic: dict  # pretrain.synthetic: the synthetic pool's generator section
    folder: dict  # pretrain.folder: crops_dir, labels_csv, target_columns
    record: dict  # the `pretrain` group, resolved, as the provenance records it
    data: DataSettings  # the CV dataset
    model_name: str
    pretrained: bool | str
    weights: str | None
    img_size: int | None
    augment: dict
    crop_fraction: float
    num_workers: int | None
    accelerator: str
    precision: str
    seed: int
