"""What the two benchmark scripts share (scripts/bench_data.py, scripts/bench_train.py).

A benchmark measures what `make cv` trains with: its config is composed by `pipeline.utils.config.load_config` from the
same key=value overrides as every command (data_model specialisation included: synthetic + vit_b16 is 64 px, batch 16,
bf16), and its model and data are built by `make cv`'s own `pipeline.runs.jobs.fold_job.build_fold`. Only what a
benchmark alone decides (steps, threads, which crops it lists, random weights) is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from pipeline.data.biovid import load_samples
from pipeline.data.datamodule import PainDataModule, SubjectRoles, evenly_spaced_frames, frames_from
from pipeline.data.face_crops import PreprocessConfig, preprocess
from pipeline.data.fold_files import MIN_SUBJECTS, make_folds, write_folds
from pipeline.data.prepare import DataSettings
from pipeline.models.backbone_adapter import family_traits
from pipeline.models.backbones import backbone_names, model_family
from pipeline.models.lightning_module import (
    PainLightningModule,
    fused_adamw_supported,
    parameter_groups,
    warmup_cosine,
)
from pipeline.runs.jobs.fold_decisions import plan_decisions
from pipeline.runs.jobs.fold_job import build_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.utils.accelerator import training_device
from pipeline.utils.atomic_io import atomic_write_csv, atomic_write_text
from pipeline.utils.config import load_config
from pipeline.utils.cpus import available_cpus
from pipeline.utils.devices import precision_for
from pipeline.utils.paths import PROJECT_ROOT, git_commit, resolve_path

DEFAULT_OUT = PROJECT_ROOT / "reports" / "bench"
DEFAULT_WORK = PROJECT_ROOT / "data" / "bench"


# --- settings: the config of `make cv` -------------------------------------------------------------------------------


def check_model_names(names: Sequence[str]) -> None:
    """Fail in a second, before any data is generated, on a backbone name that does not exist."""
    import timm


    known = backbone_names()
    unknown = [name for name in names if name not in known and not timm.is_model(name)]
    if unknown:
        raise SystemExit(
            f"unknown backbone(s) {', '.join(unknown)}: use one of {', '.join(known)} or any timm model name"
        )


def load_configs(
    overrides: Sequence[str], models: Sequence[str] | None, default_models: Sequence[str]
) -> list[DictConfig]:
    """One composed config per backbone, as `make cv MODEL=<name> ARGS='<overrides>'` composes it.

    The backbones are `models`, else the one the overrides pick (model=... or model.name=...), else `default_models`.
    """
    picks_model = any(override.split("=", 1)[0].strip() in ("model", "model.name") for override in overrides)
    if models and picks_model:
        raise SystemExit("pick the backbones with --models or with a model= override, not both")
    if picks_model:
        configs = [load_config(overrides)]
    else:
        configs = [load_config([f"model={name}", *overrides]) for name in models or default_models]
    check_model_names([cfg.model.name for cfg in configs])
    return configs


def listed(training: TrainingSettings, dataset: Mapping[str, Any]) -> TrainingSettings:
    """`training` reading the crops `loader_dataset` listed, with random weights (speed does not depend on them)."""
    config = copy.deepcopy(training.config)
    config["data"]["processed_dir"] = str(dataset["processed_dir"])
    config["model"].update(pretrained=False, weights=None)
    return dataclasses.replace(training, processed_dir=resolve_path(dataset["processed_dir"]), pretrained=False,
                               weights=None, config=config)


def build(training: TrainingSettings, dataset: Mapping[str, Any]) -> tuple[PainLightningModule, PainDataModule]:
    """The LightningModule and the data of fold 0 over `dataset`, built by `make cv`'s own `build_fold`."""
    training = listed(training, dataset)
    fold_file = Path(dataset["fold_file"])
    built = build_fold(training, WhatTrains.of(training).check(), SubjectRoles.of_fold(fold_file, 0),
                       plan_decisions(training, fold_file))
    module, datamodule = built.module, built.datamodule
    return module, datamodule


def precision(training: TrainingSettings) -> str:
    """The precision a fold of `make cv` would train at on this machine's device (resolved the way the fold job
    resolves it)."""
    return precision_for(training.trainer.precision, training_device(training.trainer.accelerator).kind,
                         family_traits(model_family(training.model_name, training.img_size)))


def training_settings(training: TrainingSettings, module: PainLightningModule,
                      datamodule: PainDataModule) -> dict[str, Any]:
    """What a benchmark measured with, read back from the built objects (for the report, and for the test that
    they are `make cv`'s)."""
    import albumentations as A

    return {
        "model": training.model_name,
        "img_size": module.model.backbone.data_config.input_size[-1],
        "task": datamodule.task.name,
        "optim": dataclasses.asdict(module.optim),
        "train_transform": A.to_dict(datamodule.train_transform),
        "batch_size": datamodule.batch_size,
        "num_workers": datamodule.num_workers,
        "balanced_sampling": datamodule.balanced_sampling,
        "frames_per_video": datamodule.frames_per_video,
        "from_s": datamodule.from_s,
        "precision": precision(training),
        "finetune": training.finetune.label,
        "channels_last": module.channels_last,
        "gradient_clip_val": training.trainer.gradient_clip_val,
        "seed": datamodule.seed,
    }


def preprocess_settings(data: DataSettings) -> tuple[PreprocessConfig, int]:
    """How `make data` crops faces for these settings, and with how many processes."""

    return data.preprocess, data.workers or available_cpus()


# --- timing ----------------------------------------------------------------------------------------------------------


def compute_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[Callable[[], float]]:
    """`with peak_memory(device) as peak: ...` then peak() is the block's peak memory in MB: on a GPU the most the
    device held allocated by torch; on a CPU this process's peak resident set (Linux's VmHWM, reset on entry through
    /proc/self/clear_refs; loader worker processes not included). NaN where neither can be read."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device) / 2**20
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size to the current one
        readable = True
    except OSError:
        readable = False

    def peak() -> float:
        if not readable:
            return math.nan
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
        return math.nan

    yield peak


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """`with timed() as seconds: ...` then seconds() is the block's wall time."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def bare_training_throughput(training: TrainingSettings, module: PainLightningModule, batch_size: int, *, steps: int,
                             warmup_steps: int, progress: bool = True, desc: str = "bare steps") -> dict[str, float]:
    """Images/s of a plain PyTorch loop over `module`'s network: one pre-made random batch, fwd + loss + bwd + clip +
    AdamW + LR step, at the config's precision and gradient clipping.

    The optimizer groups and schedule are the real recipe's (`pipeline.models.lightning_module.parameter_groups`,
    warm-up cosine), so the only thing missing compared with training is the data loading and Lightning's bookkeeping.
    """

    device = compute_device()
    net = module.model.to(device).train()
    optimizer = torch.optim.AdamW(parameter_groups(net, module.optim), fused=fused_adamw_supported(net))
    total = warmup_steps + steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, 1, total))
    generator = torch.Generator().manual_seed(training.seed)
    images = torch.randn(batch_size, *net.backbone.data_config.input_size, generator=generator).to(device)
    if module.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, len(module.class_names), (batch_size,), generator=generator).to(device)
    bf16 = precision(training).startswith("bf16")
    clip = training.trainer.gradient_clip_val

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            logits = net(images)
        F.cross_entropy(logits.float(), labels).backward()
        if clip:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        scheduler.step()

    for _ in tqdm(range(warmup_steps), desc=f"{desc} (warm-up)", leave=False, disable=not progress):
        step()
    synchronize(device)
    with timed() as seconds:
        for _ in tqdm(range(steps), desc=desc, leave=False, disable=not progress):
            step()
        synchronize(device)
    return {"images_per_s": steps * batch_size / seconds(), "seconds_per_step": seconds() / steps}


# --- data ------------------------------------------------------------------------------------------------------------


def generate_subset(root: Path, preset: str, n_subjects: int, samples_per_class: int, workers: int,
                    progress: bool = True) -> tuple[pd.DataFrame, float]:
    """Generate a small synthetic subset of `preset` into `root`; returns its sample table and the seconds taken.

    Generation is resumable, so a folder that already holds the videos costs ~0 s: delete it first to time it.
    """
    from pipeline.data.synthetic import PRESETS, generate

    if preset not in PRESETS:
        raise SystemExit(f"unknown synthetic preset {preset!r}; known: {', '.join(PRESETS)}")
    config = dataclasses.replace(PRESETS[preset], n_subjects=n_subjects, samples_per_class=samples_per_class)
    with timed() as seconds:
        generate(root, config, workers=workers, progress=progress)
    samples, _ = load_samples(root)
    return samples, seconds()


def prepared_subset(work_dir: Path, preset: str, n_subjects: int, samples_per_class: int, data: DataSettings,
                    progress: bool = True) -> Path:
    """A generated subset in `work_dir`, cropped as `make data` crops for `data` (made once, reused); returns its
    processed folder."""

    config, workers = preprocess_settings(data)
    samples, _ = generate_subset(work_dir / "raw", preset, n_subjects, samples_per_class, workers, progress)
    result = preprocess(samples, work_dir / "processed", config, workers=workers, progress=progress)
    if result.frames.empty:
        raise SystemExit(f"preprocessing {work_dir / 'raw'} produced no crops; see {result.failures_csv}")
    return work_dir / "processed"


def loader_dataset(source_dir: Path, out_dir: Path, min_train_images: int,
                   training: TrainingSettings) -> dict[str, Any]:
    """A frame table and hold-out fold file over `source_dir`'s crops with at least `min_train_images` training
    frames, counted as `training`'s loader selects them (the task's classes, loader.from_s, loader.frames_per_video).

    A small subset is listed several times, each copy as new subjects ("<name>+<copy>"): the crops are the same
    files either way and a real dataset's crops sit in the page cache after the first epoch too, so images/s is
    what the full dataset would give, while timing never crosses an epoch boundary mid-measurement.
    """
    frames_csv = source_dir / "frames.csv"
    if not frames_csv.is_file():
        raise SystemExit(f"frame table {frames_csv} not found: prepare the data first (make data)")
    text_columns = {"subject_name": str, "sample_name": str, "class_name": str, "crop_path": str}
    source = pd.read_csv(frames_csv, dtype=text_columns, keep_default_na=False)
    loader = training.loader
    source = source[source["class_name"].isin(training.task.classes)]
    if loader.from_s is not None:
        source = frames_from(source, loader.from_s, frames_csv)
    if loader.frames_per_video is not None:
        source = evenly_spaced_frames(source, loader.frames_per_video)
    if source.empty:
        raise SystemExit(f"{frames_csv}: no frames of task {training.task.name}")
    source = source.assign(crop_path=[str((source_dir / path).resolve()) for path in source["crop_path"]])

    def copies_of(n_copies: int) -> pd.DataFrame:
        parts = [source]
        for index in range(1, n_copies):
            parts.append(source.assign(subject_name=source["subject_name"] + f"+{index}",
                                       sample_name=source["sample_name"] + f"+{index}"))
        return pd.concat(parts, ignore_index=True)

    n_copies = max(1, math.ceil(MIN_SUBJECTS / source["subject_name"].nunique()))
    while True:
        table = copies_of(n_copies)
        folds = make_folds(sorted(set(table["subject_name"])), "holdout", seed=training.seed)
        train_subjects = set(folds.loc[folds["role"] == "train", "subject_name"])
        n_train = int(table["subject_name"].isin(train_subjects).sum())
        if n_train >= min_train_images:
            break
        n_copies = max(n_copies + 1, math.ceil(n_copies * min_train_images / max(1, n_train)))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out_dir / "frames.csv", table)
    fold_file = out_dir / "holdout.csv"
    write_folds(folds, fold_file)
    return {"processed_dir": out_dir, "fold_file": fold_file, "source": str(source_dir), "copies": n_copies,
            "source_frames": len(source), "train_frames": n_train}


# --- reports ---------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """What the numbers depend on: the machine, its load when the run started, and the code version."""
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": compute_device().type,
        "device_name": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
        "cpu_cores": available_cpus(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_report(out_dir: Path, stem: str, report: Mapping[str, Any]) -> Path:
    path = out_dir / f"{stem}.json"
    atomic_write_text(path, json.dumps(report, indent=2, default=str) + "\n")
    return path


def print_table(title: str, rows: Sequence[Mapping[str, Any]]) -> None:
    print(f"\n{title}")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda value: f"{value:.3g}"))


# --- command line ----------------------------------------------------------------------------------------------------


def name_list(text: str) -> list[str]:
    """argparse type: "vit_b16,cvt_13" -> ["vit_b16", "cvt_13"]."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one name")
    return names


def fill_defaults(args: argparse.Namespace, full: Mapping[str, Any], quick: Mapping[str, Any]) -> argparse.Namespace:
    """Options left unset take the full run's default, or the quick run's with --quick."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value() if callable(value) else value)
    return args
