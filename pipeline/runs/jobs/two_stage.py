"""Two-stage clip training of one fold: the fold's frame model, fixed, embeds the fold's videos once; a temporal head
(`model.head`) trains on the training clips, stops early and gets its threshold on the validation clips, and is
tested once on the test clips.

Which frame model embeds, and what it has seen:

- fine-tuned in this fold (`model.finetune` other than frozen): the best checkpoint of the fold's first stage, which
  trained on the fold's training subjects only. It embeds only this fold's rows (its training, validation and test
  videos of the task), into an embedding-cache entry in the fold's own work folder whose key holds the SHA-256 of
  those weights and the subjects they trained on: no other fold can read it, and a fold resumed after a kill in the
  second stage reads it back (checked) instead of embedding again.
- a frozen pretrained backbone (`model.finetune=frozen`): the first stage is skipped; the backbone trained on no
  subject of the dataset, so the shared embedding cache next to the crops (the frozen probe's) serves every fold.

`two_stage.json` (an artifact of the fold run) records both facts: the frame model's weights SHA-256, the subjects it
trained on, the cache entry and the subjects of each split it embedded.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipeline.data.datamodule import PainDataModule
from pipeline.data.embeddings import EmbeddingDataModule, EmbeddingDataset, EmbeddingTable
from pipeline.data.fold_checks import ROLES
from pipeline.evaluation.metrics import evaluate_predictions
from pipeline.models.embedding_cache import (
    cache_key,
    ensure_embeddings,
    read_or_build,
    state_dict_sha256,
)
from pipeline.models.factory import clip_model
from pipeline.models.fold_result import FoldResult
from pipeline.models.head_training import HeadTraining, clip_predictions, embedded_clips, train_head
from pipeline.models.lightning_module import PainLightningModule
from pipeline.models.ordinal import LevelHead
from pipeline.models.temporal_heads import build_temporal_head, head_parameters
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.utils.atomic_io import atomic_write_text

log = logging.getLogger(__name__)
RECORD = "two_stage.json"


@dataclass(frozen=True)
class EmbeddingsSource:
    table: EmbeddingTable
    path: Path  # the cache entry's arrays file


def fold_embeddings(training: TrainingSettings, fold: int, module: PainLightningModule, datamodule: PainDataModule,
                    fine_tuned: bool, work_dir: Path) -> tuple[EmbeddingsSource, dict]:
    """The fold's crops embedded by its frame model (module docstring) and the record of who embedded what."""
    backbone = module.model.backbone
    loader, augment, processed_dir = training.loader, training.augment, training.processed_dir
    plain = replace(training.cache, views=0)
    weights_sha256 = state_dict_sha256(backbone)
    trained_on = sorted(datamodule.frames("train")["subject_name"].unique()) if fine_tuned else []
    started = time.time()
    read_back = None  # fine-tuned: whether an earlier attempt of this fold had embedded (a resume in this stage)
    if fine_tuned:  # the fold's own entry, in its work folder: a fold resumed in its second stage reads it back
        rows = pd.concat([datamodule.frames(role) for role in ROLES]).sort_index()
        key = cache_key(backbone, weights_sha256, processed_dir, loader.crop_fraction, loader.from_s,
                        loader.frames_per_video, augment, plain)
        key.update({"frame_model_fold": fold, "frame_model_trained_on": trained_on,
                    "rows": [int(row) for row in rows.index]})
        entry = read_or_build(backbone, key, work_dir, lambda: rows, processed_dir, crop_fraction=loader.crop_fraction,
                              augment=augment, settings=plain, progress=sys.stderr.isatty())  # <work_dir>/embeddings/
        read_back = not entry.built
        cache_identity = {name: key[name] for name in ("weights_sha256", "frame_model_fold", "frame_model_trained_on")}
    else:
        entry = ensure_embeddings(backbone, processed_dir, crop_fraction=loader.crop_fraction, from_s=loader.from_s,
                                  frames_per_video=loader.frames_per_video, augment=augment, settings=plain,
                                  progress=sys.stderr.isatty())
        cache_identity = {"weights_sha256": weights_sha256}  # the shared entry's key holds the backbone as built
    source, record = EmbeddingsSource(entry.table, entry.path), entry.path.with_suffix(".json")
    log.info("fold %d: embeddings of its frame model in %.1f s (%s)", fold, time.time() - started, source.path)
    facts = {"fold": fold, "frame_model": "fine-tuned in this fold" if fine_tuned else "frozen, as built",
             "frame_model_weights_sha256": weights_sha256, "frame_model_trained_on": trained_on,
             "cache_record": record.name, "cache_key": cache_identity, "embeddings_read_back": read_back,
             "embedded": {role: sorted(datamodule.frames(role)["subject_name"].unique()) for role in ROLES}}
    return source, facts


def split_embeddings(datamodule: PainDataModule, role: str, table: EmbeddingTable) -> EmbeddingTable:
    """The embeddings a split's clips are made of: the frame model's (`table`), or a personalised fold's as its
    datamodule serves them (`EmbeddingDataModule`: each crop as its protocol sees it, a baseline's reference crops
    out of the split), so a clip head sees what a frame head sees."""
    if not isinstance(datamodule, EmbeddingDataModule) or not datamodule.personalise.personal:
        return table
    dataset = datamodule.dataset(role)
    assert isinstance(dataset, EmbeddingDataset)
    return EmbeddingTable(dataset.rows, dataset.plain.numpy(), np.empty((0, *dataset.plain.shape), np.float32))


def second_stage(training: TrainingSettings, fold: int, module: PainLightningModule, datamodule: PainDataModule,
                 first: FoldResult, work_dir: Path) -> FoldResult:
    """Train and test the fold's temporal head on its frame model's embeddings: the fold's result with the head's
    selection and scores in place of the first stage's (`first`: its best checkpoint, or None where the first stage
    was skipped and the backbone is used as built; its test scores kept as `frame_model_metrics`)."""
    best_path = first.best_path
    config = training.head
    if best_path is not None:
        state = torch.load(best_path, map_location="cpu", weights_only=True)["state_dict"]
        module.load_state_dict(state, strict=module.strict_loading)
    module.eval()
    source, facts = fold_embeddings(training, fold, module, datamodule, best_path is not None, work_dir)
    clip_frames = training.clip_frames
    clips = {role: embedded_clips(datamodule.frames(role), split_embeddings(datamodule, role, source.table),
                                  clip_frames, source.path) for role in ROLES}
    torch.manual_seed(training.seed)
    head = build_temporal_head(config, clips["train"].embeddings.shape[-1], len(module.class_names),
                               training.output)  # softmax, or over levels
    facts["head"], facts["head_parameters"] = config.label, head_parameters(head)
    log.info("fold %d: temporal head %s, %d parameters, clips of %d frames", fold, config.label,
             facts["head_parameters"], clip_frames)
    settings = HeadTraining(max_epochs=config.epochs, patience=config.patience, lr=float(training.optim.head_lr),
                            weight_decay=float(training.optim.weight_decay), batch_size=training.loader.batch_size,
                            seed=training.seed, stream=fold)
    trained = train_head(head, clips["train"], clips["val"], settings)
    names = module.class_names
    # one row per video: its clip's score is the video's, called by the ordinal rule where the head is over levels
    aggregation = {"aggregation": "mean", "k": 1, "ordinal": isinstance(trained.head, LevelHead)}
    validation = evaluate_predictions(clip_predictions(trained.head, clips["val"], names), names, **aggregation)
    predictions = clip_predictions(trained.head, clips["test"], names)
    evaluation = evaluate_predictions(predictions, names, **aggregation)
    frame_model = first.evaluation.metrics(prefix="frame_model/test/") if first.evaluation is not None else {}
    return replace(first, validation=validation, frame_predictions=predictions, evaluation=evaluation,
                   best_epoch=trained.best_epoch, epochs_trained=len(trained.history), best_score=trained.best_score,
                   frame_model_metrics=frame_model, head=clip_model(module.model.backbone, trained.head),
                   head_history=trained.history, record=facts)


def write_record(facts: dict, path: Path) -> Path:
    atomic_write_text(path, json.dumps(facts, indent=1))
    return path

