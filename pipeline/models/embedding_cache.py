"""The embedding cache: a frozen backbone's per-crop embeddings, computed once and read by every fold, seed and run.

A frozen backbone maps a crop to the same embedding in every fold (no fold's training touches it), so a frozen run
(`model.finetune=frozen`) trains its head on embeddings computed once instead of running the backbone on every crop
of every epoch. An entry is data with a key: its name is the SHA-256 of everything that made it

- the backbone (name, architecture) and the SHA-256 of its weights as built (a weights file, a hub checkpoint, or
  the seeded random init: the state dict's tensors are hashed, so any other weights are another entry),
- the input size and preprocessing (mean, std, interpolation), the evaluation transform as albumentations
  serialises it and the crop fraction,
- the crops: the processed folder's `preprocess.json` (detector, alignment, margin, size, ...), the SHA-256 of its
  `frames.csv`, and which of its rows are used (`loader.from_s`, `loader.frames_per_video`),
- `cache.views` (K augmented views per crop), the training augmentation and `cache.seed` they are drawn with;

so an entry with another key is never read: a changed key part builds a new entry. Entries live next to the crops
(`<processed_dir>/embeddings/<backbone>-<key>.npz`, with `.json` beside it: the key and the SHA-256 of the arrays),
are written atomically (arrays first, the JSON last), and are checked on read: a file whose hash differs from its
JSON is refused with its name, never used.

Without views (`cache.views=0`, the default) a frozen head trains on the plain embedding every epoch: no training
augmentation at all, whatever `augment.*` says. Its runs keep those settings as params (identity) and say that they
were not applied (tags `augment_applied=false`, `augmentation`: `pipeline.runs.jobs.what_trains.WhatTrains`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from pipeline.data.augment import build_eval_transform, build_train_transform
from pipeline.data.datamodule import default_num_workers, evenly_spaced_frames, read_frame_table
from pipeline.data.embeddings import EmbeddingTable
from pipeline.data.frame_dataset import FrameDataset
from pipeline.models.backbone_adapter import Backbone
from pipeline.utils.atomic_io import atomic_path, atomic_write_text
from pipeline.utils.digests import file_sha256
from pipeline.utils.seeds import derived_seed

log = logging.getLogger(__name__)
FORMAT = "painvit.embeddings/1"
CACHE_DIR = "embeddings"


class CorruptEmbeddings(RuntimeError):
    """A cache entry whose arrays do not match their record: refused, with the file named."""


@dataclass(frozen=True)
class CacheSettings:
    """The `cache` config group: K augmented views per crop, the seed they are drawn with, the batch that builds."""

    views: int
    seed: int
    batch_size: int

    @classmethod
    def from_config(cls, cache: Any) -> CacheSettings:
        settings = cls(int(cache["views"]), int(cache["seed"]), int(cache["batch_size"]))
        if settings.views < 0 or settings.batch_size < 1:
            raise ValueError(f"cache.views must be >= 0 and cache.batch_size >= 1, got {settings}")
        return settings


def state_dict_sha256(module: torch.nn.Module) -> str:
    """SHA-256 over the module's tensors (names, shapes, dtypes, values), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def used_rows(frames: pd.DataFrame, from_s: float | None, frames_per_video: int | None) -> pd.DataFrame:
    """The frame-table rows a loader with these settings reads (of every class: any task's rows are among them)."""
    if from_s is not None:
        frames = frames[frames["time_s"] >= from_s]
    if frames_per_video is not None:
        frames = evenly_spaced_frames(frames, frames_per_video)
    return frames


def cache_key(backbone: Backbone, weights_sha256: str, processed_dir: Path, crop_fraction: float,
              from_s: float | None, frames_per_video: int | None, augment: Any, settings: CacheSettings) -> dict:
    """Everything that makes the entry (module docstring): a plain dict, hashed for the entry's name."""
    data = backbone.data_config
    preprocess = processed_dir / "preprocess.json"
    eval_transform = build_eval_transform(data, crop_fraction)
    key = {
        "format": FORMAT, "backbone": backbone.name, "architecture": backbone.architecture,
        "weights_sha256": weights_sha256, "input_size": list(data.input_size), "mean": list(data.mean),
        "std": list(data.std), "interpolation": data.interpolation, "crop_fraction": crop_fraction,
        "eval_transform": A.to_dict(eval_transform),
        "crops": json.loads(preprocess.read_text()) if preprocess.is_file() else None,
        "frames_csv_sha256": file_sha256(processed_dir / "frames.csv"),
        "from_s": from_s, "frames_per_video": frames_per_video, "views": settings.views,
    }
    if settings.views:
        key["view_transform"] = A.to_dict(build_train_transform(data, augment, crop_fraction))
        key["view_seed"] = settings.seed
    return key


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def entry_paths(processed_dir: Path, backbone_name: str, key: dict) -> tuple[Path, Path]:
    stem = processed_dir / CACHE_DIR / f"{backbone_name}-{key_digest(key)[:20]}"
    return stem.with_suffix(".npz"), stem.with_suffix(".json")


_CHECKED: dict[tuple, EmbeddingTable] = {}  # entries read and checked in this process, by file identity (2 kept)


def read_entry(arrays: Path, record: Path, key: dict) -> EmbeddingTable:
    """A stored entry, checked: the record's key and the arrays' SHA-256 must match, else CorruptEmbeddings.

    An entry this process has read and checked is served again while neither file changed (same size and
    modification time, the same key): a LOSO CV's 87 folds read and hash the arrays once, not 87 times."""
    identity = _file_identity(arrays, record, key)
    if identity is not None and identity in _CHECKED:
        return _CHECKED[identity]
    table = _read_checked(arrays, record, key)
    for array in (table.rows, table.plain, table.views):
        array.flags.writeable = False  # served to every fold of the process: no fold may change it in place
    if identity is not None:
        while len(_CHECKED) >= 2:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[identity] = table
    return table


def _file_identity(arrays: Path, record: Path, key: dict) -> tuple | None:
    try:
        stats = [path.stat() for path in (arrays, record)]
    except OSError:
        return None
    return (str(arrays), *((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats), key_digest(key))


def _read_checked(arrays: Path, record: Path, key: dict) -> EmbeddingTable:
    try:
        stored = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CorruptEmbeddings(f"embedding cache record {record} is unreadable ({error}); delete it and "
                                f"{arrays.name} to rebuild") from error
    if stored.get("key") != json.loads(json.dumps(key, default=str)):
        raise CorruptEmbeddings(f"embedding cache record {record} holds another key than its name says; delete it "
                                f"and {arrays.name} to rebuild")
    actual = file_sha256(arrays) if arrays.is_file() else "(missing)"
    if actual != stored.get("sha256"):
        raise CorruptEmbeddings(f"embedding cache file {arrays} is corrupted: SHA-256 {actual}, its record {record} "
                                f"says {stored.get('sha256')}; delete both to rebuild")
    with np.load(arrays, allow_pickle=False) as npz:
        table = EmbeddingTable(npz["rows"], npz["plain"], npz["views"])
    if table.plain.shape != (len(table.rows), stored.get("dim")) or table.views.shape[1:] != table.plain.shape:
        raise CorruptEmbeddings(f"embedding cache file {arrays}: arrays of shapes {table.plain.shape} / "
                                f"{table.views.shape} do not match its record {record}")
    return table


def _embed(backbone: Backbone, dataset: FrameDataset, keys: list, batch_size: int, description: str,
           progress: bool, workers: int) -> np.ndarray:
    """The backbone's features for the dataset items `keys` (item numbers, or (item, draw seed))."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=keys, num_workers=workers,
                        prefetch_factor=4 if workers else None)
    chunks = []
    with torch.inference_mode():
        for images, _, _ in tqdm(loader, desc=description, unit="batch", disable=not progress):
            chunks.append(backbone(images.to(torch.float32)).float().numpy())
    return np.concatenate(chunks).astype(np.float32)


def build_entry(backbone: Backbone, frames: pd.DataFrame, processed_dir: Path, crop_fraction: float, augment: Any,
                settings: CacheSettings, progress: bool, workers: int | None = None) -> EmbeddingTable:
    """Run the backbone (eval mode, float32) over the crops of `frames`: the plain view, then K augmented ones."""
    was_training = backbone.training
    backbone.eval()
    frames = frames.assign(label=0)  # FrameDataset serves a label; embeddings do not depend on it
    workers = default_num_workers() if workers is None else workers
    try:
        plain_set = FrameDataset(frames, processed_dir, build_eval_transform(backbone.data_config, crop_fraction))
        plain = _embed(backbone, plain_set, list(range(len(frames))), settings.batch_size,
                       f"embeddings {backbone.name}", progress, workers)
        views = np.zeros((0, *plain.shape), dtype=np.float32)
        if settings.views:
            view_set = FrameDataset(frames, processed_dir,
                                    build_train_transform(backbone.data_config, augment, crop_fraction))
            rows = frames.index.to_numpy()
            views = np.stack([
                _embed(backbone, view_set, [(item, derived_seed(settings.seed, view, int(row)))
                                            for item, row in enumerate(rows)],
                       settings.batch_size, f"view {view + 1}/{settings.views}", progress, workers)
                for view in range(settings.views)])
    finally:
        backbone.train(was_training)
    return EmbeddingTable(frames.index.to_numpy(dtype=np.int64), plain, views)


def write_entry(table: EmbeddingTable, key: dict, arrays: Path, record: Path, seconds: float) -> None:
    with atomic_path(arrays) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, rows=table.rows, plain=table.plain, views=table.views)
    atomic_write_text(record, json.dumps({"key": key, "sha256": file_sha256(arrays), "rows": len(table.rows),
                                          "dim": int(table.plain.shape[1]), "views": int(len(table.views)),
                                          "build_seconds": round(seconds, 2)}, indent=1, default=str))


@dataclass(frozen=True)
class CachedEmbeddings:
    table: EmbeddingTable
    path: Path  # the entry's arrays file
    built: bool  # True: computed now; False: read from the cache
    seconds: float


def ensure_embeddings(backbone: Backbone, processed_dir: Path, *, crop_fraction: float,
                      from_s: float | None, frames_per_video: int | None, augment: Any, settings: CacheSettings,
                      progress: bool = False, workers: int | None = None) -> CachedEmbeddings:
    """The shared entry for this backbone and these crops, beside them (`read_or_build`).

    The rows of the processed folder's frame table that a loader with `from_s` and `frames_per_video` reads are
    embedded, of every class (so one entry serves every task).
    """
    processed_dir = Path(processed_dir)
    key = cache_key(backbone, state_dict_sha256(backbone), processed_dir, crop_fraction, from_s, frames_per_video,
                    augment, settings)
    frames_csv = processed_dir / "frames.csv"
    return read_or_build(backbone, key, processed_dir,
                         lambda: used_rows(read_frame_table(frames_csv), from_s, frames_per_video), processed_dir,
                         crop_fraction=crop_fraction, augment=augment, settings=settings, progress=progress,
                         workers=workers)


def read_or_build(backbone: Backbone, key: dict, folder: Path, rows: Callable[[], pd.DataFrame], processed_dir: Path,
                  *, crop_fraction: float, augment: Any, settings: CacheSettings, progress: bool,
                  workers: int | None = None) -> CachedEmbeddings:
    """The one place embeddings are read or built: the entry of `key` in `folder`'s cache, read and checked where
    its record exists (`read_entry`: a corrupt one is refused), else the crops of `rows()` embedded and stored.
    The shared cache beside the crops (`ensure_embeddings`: the frozen probe, a frozen two-stage head, `make embed`)
    and a fold's own entry of its fine-tuned frame model (`pipeline.runs.jobs.two_stage`) both come through here."""
    started = time.time()
    arrays, record = entry_paths(Path(folder), backbone.name, key)
    if record.is_file():
        table = read_entry(arrays, record, key)
        log.info("embeddings of %s read from %s (%d crops, %.1f s)", backbone.name, arrays, len(table.rows),
                 time.time() - started)
        return CachedEmbeddings(table, arrays, False, time.time() - started)
    frames = rows()
    log.info("building embeddings of %s for %d crops (%s) into %s", backbone.name, len(frames),
             f"{settings.views} augmented views each" if settings.views else "plain only: training will not augment",
             arrays)
    arrays.parent.mkdir(parents=True, exist_ok=True)
    table = build_entry(backbone, frames, processed_dir, crop_fraction, augment, settings, progress, workers)
    seconds = time.time() - started
    write_entry(table, key, arrays, record, seconds)
    log.info("embeddings of %s built in %.1f s: %s", backbone.name, seconds, arrays)
    return CachedEmbeddings(table, arrays, True, seconds)
