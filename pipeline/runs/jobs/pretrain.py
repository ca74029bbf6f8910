"""`make pretrain MODEL=...`: a starting point made here, on faces of people who are not in the dataset the backbone
will be fine-tuned on, with a target other than pain.

The mission's recipe starts from pretrained weights, and a machine without a model hub has none. This command trains
the backbone (from whatever `model.pretrained` / `model.weights` give it: the hub cache, a file, or random weights)
on a *pool* of faces, then writes the backbone's weights as a file that `WEIGHTS=` reads like any other, with its
provenance beside it (`<file>.json`: the pool and its identities, the target, epochs, losses, SHA-256).

Pools (`pretrain.pool`):

- `synthetic`: identities drawn by the twin's generator from a seed of their own (`pretrain.synthetic.seed`), so no
  person of the twin is among them. That is checked, not assumed: a pool whose roster shares a name or a look with
  the twin's (same seed, or a chance collision) is refused before anything is generated. Videos and crops are made
  like `make data` makes the twin's (same preprocessing), under `pretrain.pool_dir`.
- `folder`: face crops a lab holds (`pretrain.folder.crops_dir`) with a labels CSV (`pretrain.folder.labels_csv`:
  `crop_path` relative to the crops folder, `identity`, and the target columns). Identities that are subjects of the
  CV dataset are refused by name.

Either way the CV dataset's participants must be known (`dataset_roster`: its frame table, samples table, committed
subject list or generator); a dataset whose participants cannot be read is refused with the reason. The identities
go into the provenance, and `make cv WEIGHTS=<file>` refuses weights whose pool shares a person with its fold file
(`pipeline.runs.orchestration.cross_validation.check_pretraining_people`), whatever `DATA` was at `make pretrain`.

Targets (`pretrain.target`): `au`, the per-frame action-unit intensities (the twin's ground truth under
`synthetic_regions/`: AU4, AU6/7, AU9/10, AU43, read on the resting clips (BL1) only, `AU_CLASSES`: on its pain
clips they are the pain intensity under another name; a folder's numeric columns, or `pretrain.folder.target_columns`),
learnt by mean squared error, or `identity`, who it is, learnt by cross-entropy. Expressions are the pain signal's
neighbours: the best video-only BioVid results pretrain on faces and expressions before fine-tuning on pain.

A fifth of the pool's identities (at least one) are held out; their loss after each epoch, and the loss of always
answering the training mean (or the most common identity's share), say whether the backbone learnt anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from pipeline.data.augment import build_eval_transform, build_train_transform
from pipeline.data.biovid import SAMPLES_CSV, load_samples
from pipeline.data.datamodule import default_num_workers
from pipeline.data.face_crops import preprocess
from pipeline.data.frame_dataset import FrameDataset
from pipeline.data.prepare import DataSettings, synthetic_config, synthetic_fingerprint
from pipeline.models.backbone_adapter import Backbone, family_traits
from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.weights import provenance_path
from pipeline.runs.jobs.training_settings import PretrainSettings
from pipeline.runs.store import tracking
from pipeline.utils.accelerator import announce_device
from pipeline.utils.atomic_io import atomic_path, atomic_write_text
from pipeline.utils.devices import precision_for
from pipeline.utils.digests import file_sha256
from pipeline.utils.paths import git_commit, resolve_path

log = logging.getLogger(__name__)
AU_COLUMNS = ("au4", "au6_7", "au9_10", "au43")  # the twin's per-frame action units (synthetic_regions/)
# The clips a twin's AU target is read on: the resting face (BL1) only. On the pain clips the twin's action units
# are the pain intensity times a weight plus noise, so an AU target there is the pain target under another name; at
# rest they are what the face does unprompted (fidgeting of brows, cheeks and nose, blinks).
AU_CLASSES = ("BL1",)
TARGETS = ("au", "identity")
POOLS = ("synthetic", "folder")
# what makes a synthetic person recognisable: every drawn trait but the running number and the pain response
LOOK_FIELDS = ("skin", "face_aspect", "face_scale", "hair_style", "hair", "hairline", "glasses", "beard", "iris",
               "eye_spacing", "eye_width", "mouth_width", "brow_thickness")


class PretrainError(SystemExit):
    """A pool that cannot be used (shares people with the CV dataset, lacks files or columns): what to change."""


@dataclass
class Pool:
    """Face crops and their targets: one row per crop (`crop_path` under `crops_dir`, `identity`, target columns)."""

    rows: pd.DataFrame
    crops_dir: Path
    targets: list[str]  # the target columns (au), or ["identity"]
    provenance: dict[str, Any]


def pool_config(settings: PretrainSettings) -> Any:
    """The pool's generator config: `pretrain.synthetic` over the twin's look (difficulty) when the CV dataset is a
    twin; over the preset's own look for a recorded dataset (BioVid has no `data.synthetic`)."""
    difficulty = (settings.data.synthetic or {}).get("difficulty")
    return synthetic_config(settings.synthetic, **({"difficulty": difficulty} if difficulty else {}))


def look(subject: Any) -> tuple:
    return tuple(getattr(subject, name) for name in LOOK_FIELDS)


def shared_identities(pool_subjects: list, dataset_subjects: list) -> list[str]:
    """Pool subjects who are also in the dataset: the same name or the same look."""
    names = {s.subject_name for s in dataset_subjects}
    looks = {look(s) for s in dataset_subjects}
    return [s.subject_name for s in pool_subjects if s.subject_name in names or look(s) in looks]


@dataclass(frozen=True)
class Roster:
    """The CV dataset's participants: their names, and for a twin its generated people (for the look check)."""

    names: frozenset[str]
    generated: tuple  # the twin generator's subjects; empty for a recorded dataset (BioVid)
    sources: tuple[str, ...]  # where the names were read


def dataset_roster(data: DataSettings) -> Roster:
    """Every participant of the CV dataset that can be read: its frame table, its samples table, the committed
    subject list beside its fold files (`<manifest_dir>/subjects.csv`: BioVid's 87 without BIOVID_ROOT) and, for a
    twin (a `data.synthetic` section), its generator. A dataset none of which can be read is refused with the
    reason: a pool cannot be checked apart from people nobody can name."""
    from pipeline.data.synthetic import make_subjects

    names: set[str] = set()
    sources, missing = [], []
    frames = data.processed_dir / "frames.csv"
    root = resolve_path(data.root) if data.root else None
    committed = data.manifest_dir / "subjects.csv"
    for path, separator in ((frames, ","), (root / SAMPLES_CSV if root else None, "\t"), (committed, ",")):
        if path is not None and path.is_file():
            names |= set(pd.read_csv(path, sep=separator, usecols=["subject_name"], dtype=str)["subject_name"])
            sources.append(str(path))
        elif path is not None:
            missing.append(f"no {path}")
    if root is None:
        missing.append("data.root is not set (BIOVID_ROOT=)")
    section = data.synthetic
    generated = tuple(make_subjects(synthetic_config(section))) if section is not None else ()
    if generated:
        assert section is not None
        names |= {subject.subject_name for subject in generated}
        sources.append(f"the {data.name} generator (seed {section['seed']})")
    if not names:
        raise PretrainError(f"the {data.name} dataset's participants cannot be read ({'; '.join(missing)}), so "
                            f"the pretraining pool cannot be checked apart from them: run `make data` for it first, "
                            f"or give its root (BIOVID_ROOT=)")
    return Roster(frozenset(names), generated, tuple(sources))


def check_apart(data: DataSettings, pool_subjects: list) -> Roster:
    """Refuse a synthetic pool that shares a person with the CV dataset (by name, and for a twin by look)."""
    roster = dataset_roster(data)
    shared = shared_identities(pool_subjects, list(roster.generated))
    named = roster.names & {s.subject_name for s in pool_subjects}
    shared = sorted(set(shared) | named)
    if shared:
        raise PretrainError(
            f"the pretraining pool shares {len(shared)} identit{'y' if len(shared) == 1 else 'ies'} with the "
            f"{data.name} dataset the backbone will be fine-tuned on ({', '.join(shared[:5])}"
            f"{', ...' if len(shared) > 5 else ''}): a pretrained starting point must not have seen its people. "
            f"Choose another pretrain.synthetic.seed"
            + (f" (the twin's is {(data.synthetic or {}).get('seed')})." if roster.generated else "."))
    return roster


# --- the pools -------------------------------------------------------------------------------------------------------


def synthetic_pool(settings: PretrainSettings, progress: bool = True) -> Pool:
    """Generate (resumable) and crop the synthetic pool; targets from its ground truth."""
    from pipeline.data.synthetic import generate, make_subjects, regions_path

    data = settings.data
    config = pool_config(settings)
    subjects = make_subjects(config)
    roster = check_apart(data, subjects)  # before anything is generated
    # one folder per generator config: a pool of other settings is another folder, never a refused resume
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True).encode()).hexdigest()[:8]
    pool_dir = settings.pool_dir / f"seed{config.seed}_{settings.synthetic['preset']}_{digest}"
    raw, processed = pool_dir / "raw", pool_dir / "processed"
    print(f"pretraining pool: {len(subjects)} synthetic identities (seed {config.seed}, none of them in the "
          f"{data.name} dataset) -> {pool_dir}", flush=True)
    generate(raw, config, workers=(data.synthetic or {}).get("workers"), progress=progress)
    samples, _ = load_samples(raw, subject_set="all")
    if settings.target == "au":  # the resting clips only (AU_CLASSES): the others are not cropped for it
        samples = samples[samples["class_name"].isin(AU_CLASSES)].reset_index(drop=True)
    source = synthetic_fingerprint(raw)
    result = preprocess(samples, processed, data.preprocess, workers=data.workers, progress=progress,
                        device=data.device, source=source)
    rows = result.frames[["crop_path", "subject_name", "sample_name", "class_name", "frame_index"]].rename(
        columns={"subject_name": "identity"})
    targets = ["identity"]
    if settings.target == "au":  # each crop's frame in its video's ground truth
        clips = rows[["identity", "sample_name"]].drop_duplicates().itertuples(index=False)
        truth = pd.concat([pd.read_csv(regions_path(raw, subject, sample), usecols=["frame_index", *AU_COLUMNS])
                           .assign(identity=subject, sample_name=sample) for subject, sample in clips])
        rows = rows.merge(truth, on=["identity", "sample_name", "frame_index"], how="left", validate="m:1")
        unknown = rows[list(AU_COLUMNS)].isna().any(axis=1)
        if unknown.any():
            first = rows[unknown].iloc[0]
            raise PretrainError(f"{regions_path(raw, first.identity, first.sample_name)} has no row for frame "
                                f"{first.frame_index} ({int(unknown.sum())} crops without action units)")
        targets = list(AU_COLUMNS)
    provenance = {"kind": "synthetic", "seed": config.seed, "preset": settings.synthetic["preset"],
                  "difficulty": config.difficulty, "folder": str(pool_dir),
                  "generator_sha256": source.removeprefix("synthetic:"),
                  "classes": sorted(set(rows["class_name"])),
                  "checked_apart_from": apart_from(data, roster, "name and look" if roster.generated else "name")}
    return Pool(rows.drop(columns="class_name"), processed, targets, provenance)


def apart_from(data: DataSettings, roster: Roster, how: str) -> str:
    """What the pool was checked apart from, for its provenance: the dataset, how many people, from where."""
    return f"{data.name}: {len(roster.names)} participants by {how} ({'; '.join(roster.sources)})"


def folder_pool(settings: PretrainSettings) -> Pool:
    """Crops and labels a lab holds; identities that are CV subjects are refused by name."""
    folder, data = settings.folder, settings.data
    if not folder["crops_dir"] or not folder["labels_csv"]:
        raise PretrainError("pretrain.pool=folder needs pretrain.folder.crops_dir (face crops) and "
                            "pretrain.folder.labels_csv (crop_path, identity, target columns)")
    crops, labels_csv = resolve_path(folder["crops_dir"]), resolve_path(folder["labels_csv"])
    if not labels_csv.is_file():
        raise PretrainError(f"pretrain.folder.labels_csv: {labels_csv} does not exist")
    labels = pd.read_csv(labels_csv)
    missing = [c for c in ("crop_path", "identity") if c not in labels.columns]
    if missing:
        raise PretrainError(f"{labels_csv}: no column(s) {', '.join(missing)} (needs crop_path, identity, targets)")
    labels["identity"] = labels["identity"].astype(str)
    roster = dataset_roster(data)
    shared = sorted(set(labels["identity"]) & roster.names)
    if shared:
        raise PretrainError(f"{labels_csv}: identities {', '.join(shared[:5])} are subjects of the {data.name} "
                            "dataset the backbone will be fine-tuned on; a pretraining pool must not hold its people")
    paths = [crops / p for p in labels["crop_path"]]
    absent = [(i, p) for i, p in enumerate(paths) if not p.is_file()]
    if absent:
        row, path = absent[0]
        raise PretrainError(f"{labels_csv} row {row + 2}: crop {path} does not exist ({len(absent)} missing in all)")
    rows = labels[["crop_path", "identity"]]
    targets = ["identity"]
    if settings.target == "au":
        chosen = list(folder["target_columns"] or [c for c in labels.columns if c not in ("crop_path", "identity")
                                                 and pd.api.types.is_numeric_dtype(labels[c])])
        if not chosen:
            raise PretrainError(f"{labels_csv}: no numeric target column for pretrain.target=au")
        bad = labels[chosen].isna().any(axis=1)
        if bad.any():
            raise PretrainError(f"{labels_csv} row {int(np.flatnonzero(bad)[0]) + 2}: a target value is missing")
        rows = rows.join(labels[chosen].astype(float))
        targets = chosen
    return Pool(rows, crops, targets, {"kind": "folder", "crops_dir": str(crops), "labels_csv": str(labels_csv),
                                "labels_sha256": file_sha256(labels_csv),
                                "checked_apart_from": apart_from(data, roster, "name")})


# --- training --------------------------------------------------------------------------------------------------------


class PoolDataset(FrameDataset):
    """The training data's `FrameDataset` over a pool's crops, with the pool's targets as labels: action-unit
    intensities (float32 rows) or identity indices (int64)."""

    def __init__(self, rows: pd.DataFrame, crops_dir: Path, targets: np.ndarray, transform) -> None:
        super().__init__(rows.assign(label=0), crops_dir, transform)
        self.labels = targets


class PretrainModule(pl.LightningModule):
    """Backbone + Linear(D, outputs): mean squared error on action units, or cross-entropy on identity. Each epoch's
    mean train and held-out losses (Lightning's epoch reduction) go into `history`."""

    def __init__(self, net: PainNet, classify: bool, lr: float, backbone_lr: float, weight_decay: float) -> None:
        super().__init__()
        self.net = net
        self.lr, self.backbone_lr, self.weight_decay = lr, backbone_lr, weight_decay
        self.loss = nn.CrossEntropyLoss() if classify else nn.MSELoss()
        self.history: list[dict[str, float]] = []

    def _step(self, batch, stage: str) -> torch.Tensor:
        images, targets, _ = batch
        loss = self.loss(self.net(images).float(), targets)
        self.log(f"{stage}_loss", loss, on_step=False, on_epoch=True, batch_size=len(images))
        return loss

    def training_step(self, batch, batch_index: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_index: int) -> None:
        self._step(batch, "val")

    def on_train_epoch_end(self) -> None:  # after the epoch's validation
        means = {key: float(self.trainer.callback_metrics.get(f"{key}_loss", math.nan)) for key in ("train", "val")}
        self.history.append({"epoch": self.current_epoch, "train_loss": means["train"], "val_loss": means["val"]})
        print(f"pretrain epoch {self.current_epoch}: train loss {means['train']:.4f}, held-out loss "
              f"{means['val']:.4f}", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": self.net.backbone.parameters(), "lr": self.backbone_lr},
                                  {"params": self.net.head.parameters(), "lr": self.lr}],
                                 weight_decay=self.weight_decay)


def split(pool: Pool, classify: bool, share: float) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Training rows, held-out rows, held-out identities. Action units: the last `share` of the identities in
    sorted order (at least one, given two) are held out. Identity: the people are the classes, so nobody can be;
    the last crop of every clip is held out instead (the same people, frames not trained on)."""
    rows = pool.rows
    if classify:
        clip = rows["crop_path"].map(lambda path: str(Path(path).parent))
        last = rows.groupby(clip)["crop_path"].transform("max") == rows["crop_path"]
        return rows[~last], rows[last], []
    names = sorted(set(rows["identity"]))
    outside = names[-max(1, round(len(names) * share)):] if len(names) > 1 else []
    chosen = rows["identity"].isin(outside)
    return rows[~chosen], rows[chosen], outside


def baseline_loss(train_targets: np.ndarray, held_targets: np.ndarray, classify: bool) -> float:
    """The held-out loss of an answer that ignores the image: the training mean (MSE), or the training identities'
    shares (cross-entropy)."""
    if not len(held_targets):
        return math.nan
    if classify:
        share = pd.Series(train_targets).value_counts(normalize=True)
        return float(-np.log(np.clip(share.reindex(held_targets).fillna(0).to_numpy(), 1e-12, 1)).mean())
    return float(((held_targets - train_targets.mean(axis=0)) ** 2).mean())


def backbone_state(backbone: Backbone) -> dict[str, torch.Tensor]:
    """The backbone's weights in the layout `model.weights=` reads for its adapter (`Backbone.weights_state`)."""
    try:
        return backbone.weights_state()
    except NotImplementedError as error:
        raise PretrainError(f"make pretrain writes timm and CvT backbones: {error}") from None


def weights_path(settings: PretrainSettings, pool: Pool, img_size: int) -> Path:
    """`<out_dir>/<model>_<target>_<pool><seed>_<size>px.pt`: one file per starting point."""
    where = pool.provenance.get("seed", "")
    return settings.out_dir / f"{settings.model_name}_{settings.target}_{settings.pool}{where}_{img_size}px.pt"


def run_pretrain(cfg: DictConfig, progress: bool = True) -> Path:
    """Build the pool, train, write the weights and their provenance; returns the weights file."""
    p = cfg.pretrain
    if p.target not in TARGETS or p.pool not in POOLS:
        raise PretrainError(f"pretrain.target must be one of {TARGETS} and pretrain.pool one of {POOLS}; got "
                            f"{p.target!r}, {p.pool!r}")
    settings = PretrainSettings(
        str(p.target), str(p.pool), resolve_path(p.pool_dir), resolve_path(p.out_dir),
        int(p.epochs or OmegaConf.select(p, f"presets.{cfg.model.name}.epochs", default=p.default_epochs)),
        int(p.batch_size or cfg.loader.batch_size), float(p.lr), float(p.backbone_lr), float(p.weight_decay),
        float(p.held_out_share), OmegaConf.to_container(p.synthetic, resolve=True),
        OmegaConf.to_container(p.folder, resolve=True), OmegaConf.to_container(p, resolve=True),
        DataSettings.from_config(cfg), str(cfg.model.name), cfg.model.pretrained, cfg.model.weights,
        cfg.model.img_size, OmegaConf.to_container(cfg.augment, resolve=True), float(cfg.loader.crop_fraction),
        cfg.loader.num_workers, str(cfg.trainer.accelerator), str(cfg.trainer.precision), int(cfg.seed))
    device = announce_device(settings.accelerator)
    pool = synthetic_pool(settings, progress) if settings.pool == "synthetic" else folder_pool(settings)
    if pool.rows.empty:
        raise PretrainError("the pretraining pool has no face crops")
    targets = pool_targets(pool, settings.target == "identity", settings.held_out_share)
    pl.seed_everything(settings.seed, workers=True)
    net, source = create_model(settings.model_name, targets.n_outputs, pretrained=settings.pretrained,
                               weights=settings.weights, img_size=settings.img_size)
    img_size = int(settings.img_size or net.backbone.data_config.input_size[-1])
    fit = train_on_pool(settings, net, pool, targets, device.kind, f"{img_size} px, from {source.kind} weights",
                        progress)
    path = weights_path(settings, pool, img_size)
    with atomic_path(path) as tmp:
        torch.save(backbone_state(net.backbone), tmp)
    last = fit.history[-1] if fit.history else {}
    provenance = {
        "weights": path.name, "sha256": file_sha256(path), "model": settings.model_name,
        "architecture": net.backbone.architecture, "img_size": img_size, "started_from": tracking.weights_tags(source),
        "target": settings.target, "target_names": pool.targets, "outputs": targets.n_outputs,
        "pool": {**pool.provenance, "identities": sorted(set(pool.rows["identity"])),
                 "held_out_identities": targets.outside, "crops": len(pool.rows),
                 "training_crops": fit.training_crops, "held_out_crops": fit.held_out_crops},
        "epochs": fit.epochs, "history": fit.history, "held_out_loss": last.get("val_loss", math.nan),
        "held_out_baseline_loss": targets.baseline, "seconds": round(fit.seconds, 1),
        "device": tracking.training_device_tags(device),
        "precision": fit.precision, "git_commit": git_commit(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings.record,
    }
    atomic_write_text(provenance_path(path), json.dumps(provenance, indent=2, default=str) + "\n")
    print(f"held-out loss {provenance['held_out_loss']:.4f} against {targets.baseline:.4f} for always answering the "
          f"training {'shares' if targets.classify else 'mean'}; {fit.seconds:.1f} s of training")
    print(f"weights: {path}\n         (provenance: {provenance_path(path)})\n"
          f"use it:  make cv MODEL={settings.model_name} WEIGHTS={path}")
    return path


@dataclass
class PoolTargets:
    """The pool split into training and held-out rows (`split`), with what each row is trained to answer: the index
    of its identity, or its action units; and the held-out loss of an answer that ignores the image."""

    classify: bool
    training: pd.DataFrame
    held_out: pd.DataFrame
    outside: list[str]  # the held-out identities (none for an identity target: the people are the classes)
    train: np.ndarray
    held: np.ndarray
    n_outputs: int

    @property
    def baseline(self) -> float:
        return baseline_loss(self.train, self.held, self.classify)


def pool_targets(pool: Pool, classify: bool, share: float) -> PoolTargets:
    """The pool's training and held-out rows (`split`) with their targets: identity indices (`classify`, one output
    per identity) or the pool's target columns."""
    training, held_out, outside = split(pool, classify, share)
    if classify:
        index = {name: i for i, name in enumerate(sorted(set(pool.rows["identity"])))}
        train, held = (frame["identity"].map(index).to_numpy(dtype=np.int64) for frame in (training, held_out))
        return PoolTargets(classify, training, held_out, outside, train, held, len(index))
    train, held = (frame[pool.targets].to_numpy(dtype=np.float32) for frame in (training, held_out))
    return PoolTargets(classify, training, held_out, outside, train, held, len(pool.targets))


@dataclass
class PoolFit:
    """What training on the pool did: each epoch's losses, the epochs, precision and seconds, the crops of each
    side."""

    history: list[dict[str, float]]
    epochs: int
    precision: str
    seconds: float
    training_crops: int
    held_out_crops: int


def train_on_pool(settings: PretrainSettings, net: PainNet, pool: Pool, targets: PoolTargets, device_kind: str,
                  starting: str, progress: bool) -> PoolFit:
    """The backbone and its head trained on the pool's training crops (augmented as `make cv` augments) for the
    preset's epochs, the held-out crops scored after each epoch."""
    data_config = net.backbone.data_config
    train_set = PoolDataset(targets.training, pool.crops_dir, targets.train,
                            build_train_transform(data_config, settings.augment, settings.crop_fraction))
    val_set = PoolDataset(targets.held_out, pool.crops_dir, targets.held,
                          build_eval_transform(data_config, settings.crop_fraction))
    batch = settings.batch_size
    workers = default_num_workers() if settings.num_workers is None else int(settings.num_workers)
    keep = workers > 0  # the workers live through the epochs (each start imports torch again)
    train_loader = DataLoader(train_set, batch_size=batch, shuffle=True, num_workers=workers,
                              drop_last=len(train_set) > batch, persistent_workers=keep)
    val_loader = (DataLoader(val_set, batch_size=batch, num_workers=workers, persistent_workers=keep)
                  if len(val_set) else None)
    epochs = settings.epochs
    module = PretrainModule(net, targets.classify, settings.lr, settings.backbone_lr, settings.weight_decay)
    precision = precision_for(settings.precision, device_kind, family_traits(net.backbone.family))
    trainer = pl.Trainer(max_epochs=epochs, accelerator=settings.accelerator, devices=1, precision=precision,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=progress, num_sanity_val_steps=0)
    classes = pool.provenance.get("classes")
    print(f"pretraining {settings.model_name} ({starting}) on {len(train_set)} crops of "
          f"{targets.training['identity'].nunique()} identities"
          f"{' (clips ' + ', '.join(classes) + ')' if classes else ''}, target {settings.target} ({targets.n_outputs} "
          f"outputs), {epochs} epoch(s), {precision}", flush=True)
    started = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    return PoolFit(module.history, epochs, precision, time.perf_counter() - started, len(train_set), len(val_set))
