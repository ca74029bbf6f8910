"""`make embed MODEL=... [WEIGHTS=...]`: build the embedding cache of a frozen backbone explicitly, with a progress bar.

The entry is the one a frozen cross-validation with the same settings reads (`pipeline.models.embedding_cache`): the
backbone is built with the planned weights exactly as a fold job builds it (seeded the same way, so a randomly
initialised backbone has the same weights), and the crops a loader with these settings reads are embedded.
"""

from __future__ import annotations

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf

from pipeline.data.datamodule import LoaderConfig
from pipeline.data.prepare import DataSettings, prepare_data
from pipeline.data.tasks import get_task
from pipeline.models.embedding_cache import CacheSettings, ensure_embeddings
from pipeline.models.ordinal import OutputConfig
from pipeline.runs.jobs.fold_decisions import plan_decisions
from pipeline.runs.jobs.fold_job import build_network
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.utils.paths import resolve_path


def run_embed(cfg: DictConfig) -> None:
    _, fold_file = prepare_data(DataSettings.from_config(cfg))
    decisions = plan_decisions(TrainingSettings.from_config(cfg), fold_file)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)  # as build_fold: the same random init, if random
    net = build_network(cfg.model.name, cfg.model.img_size, OutputConfig.from_config(cfg.model.get("output")),
                        get_task(cfg.task.name).n_classes, decisions)
    loader = LoaderConfig.from_config(cfg.loader)
    processed_dir = resolve_path(cfg.data.processed_dir)
    entry = ensure_embeddings(net.backbone, processed_dir, crop_fraction=loader.crop_fraction,
                              from_s=loader.from_s, frames_per_video=loader.frames_per_video,
                              augment=OmegaConf.to_container(cfg.augment),
                              settings=CacheSettings.from_config(cfg.cache), progress=True, workers=loader.num_workers)
    table = entry.table
    what = "built" if entry.built else "already there, checked"
    print(f"embeddings of {cfg.model.name}: {len(table.rows)} crops x {table.plain.shape[1]} features, "
          f"{len(table.views)} augmented view(s) each, {what} in {entry.seconds:.1f} s: {entry.path}")
