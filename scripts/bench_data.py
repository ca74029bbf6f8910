"""Data-side benchmark: how fast videos become face crops, how often the synthetic faces are found, and whether the
training loader feeds a backbone faster than the backbone trains.

What it measures (numbers for the release notes, not a test):

1. Preprocessing throughput (`pipeline.preprocess.preprocess`): a small synthetic subset per preset (default
   320 x 240 and BioVid's full 1388 x 1038; 2 subjects x 5 classes x 2 samples = 20 videos each) is generated,
   timed, then cropped twice into fresh folders: with one worker (the per-core figure) and with all cores.
2. Detection rate of the Haar detector on those videos (`pipeline.faces.detection_rate`), overall and per class.
3. Loader throughput: images/s from `PainDataModule.train_dataloader()` with the heavy augmentation
   (configs/augment/heavy.yaml) at MobileViT-S's data config resized to 224 and 112 px, default worker count, a
   warm-up pass then timed passes. It reads the project's prepared dataset (data/processed/synthetic) if there is
   one, else the default-preset subset made in step 1 (its crops listed repeatedly, as extra subjects, until a pass
   holds enough images). Compared with fwd + bwd + AdamW steps of MobileViT-S on random tensors at the same size
   and batch: the loader should deliver >= 3x what training consumes, so data never limits training.

Run:
    make bench-data                                   # = .venv/bin/python scripts/bench_data.py
    .venv/bin/python scripts/bench_data.py --quick    # tiny smoke version (seconds)
    .venv/bin/python scripts/bench_data.py --help     # every option

Prints a results table; writes reports/bench/bench_data.json and bench_data.png (atomic writes). Works on a CPU-only
laptop and on a GPU server (device auto-detected; on CUDA bf16 autocast and channels_last for convolutional nets).
CPU training steps use all cores by default; on a shared machine OpenMP threads that wait for a busy core slow every
step several-fold (2 threads were 4-5x slower than 1 on a 2-core box with one core taken), so there pass --threads 1
and read the load average recorded with the results.
The helpers above `main` are shared with scripts/bench_train.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from pipeline import PROJECT_ROOT
from pipeline.folds import MIN_SUBJECTS, make_folds, write_folds
from pipeline.io import atomic_path, atomic_write_csv, atomic_write_text
from pipeline.tasks import CLASS_NAMES

DEFAULT_OUT = PROJECT_ROOT / "reports" / "bench"
DEFAULT_WORK = PROJECT_ROOT / "data" / "bench"
PROJECT_PROCESSED = PROJECT_ROOT / "data" / "processed" / "synthetic"  # what `make data` prepares by default
CONFIG_DIR = PROJECT_ROOT / "configs"
LOADER_TARGET_RATIO = 3.0  # loader images/s over training images/s


# ------------------------------------------------------------------------------------------------- shared helpers
def cpu_cores() -> int:
    """CPUs this process may use (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def compute_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def environment() -> dict[str, Any]:
    """What the numbers depend on: the machine, its load when the run started, and the code version."""
    from pipeline.cv import git_commit

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "device": compute_device().type,
        "device_name": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
        "cpu_cores": cpu_cores(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def positive_int_list(text: str) -> list[int]:
    """argparse type: "224,112" -> [224, 112]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


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
            setattr(args, key, value(args) if callable(value) else value)
    return args


def load_augment(name: str) -> dict[str, Any]:
    path = CONFIG_DIR / "augment" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise SystemExit(f"no augmentation config {path} (known: {known})")
    return OmegaConf.to_container(OmegaConf.load(path)) or {}


def load_optim(model_name: str):
    """The model's fine-tuning recipe (configs/model/<name>.yaml, optim), else the library defaults."""
    from pipeline.module import OptimConfig

    path = CONFIG_DIR / "model" / f"{model_name}.yaml"
    if not path.is_file():
        return OptimConfig()
    return OptimConfig(**OmegaConf.to_container(OmegaConf.load(path).optim))


def check_model_names(names: Sequence[str]) -> None:
    """Fail in a second, before any data is generated, on a backbone name that does not exist."""
    import timm

    from pipeline.backbones import BACKBONE_NAMES

    unknown = [name for name in names if name not in BACKBONE_NAMES and not timm.is_model(name)]
    if unknown:
        raise SystemExit(
            f"unknown backbone(s) {', '.join(unknown)}: use one of {', '.join(BACKBONE_NAMES)} or any timm model name"
        )


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """`with timed() as seconds: ...` then seconds() is the block's wall time."""
    start = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - start
    end.append(time.perf_counter())


def bare_training_throughput(
    model: nn.Module,
    optim,
    *,
    batch_size: int,
    img_size: int,
    n_classes: int,
    steps: int,
    warmup_steps: int,
    precision: str,
    channels_last: bool,
    gradient_clip: float | None = 1.0,
    seed: int = 0,
    progress: bool = True,
    desc: str = "bare steps",
) -> dict[str, float]:
    """Images/s of a plain PyTorch loop: one pre-made random batch, fwd + loss + bwd + clip + AdamW + LR step.

    The optimizer groups and schedule are the real recipe's (`pipeline.module.parameter_groups`, warm-up cosine),
    so the only thing missing compared with training is the data loading and Lightning's bookkeeping.
    """
    from pipeline.module import fused_adamw_supported, parameter_groups, warmup_cosine

    device = compute_device()
    model = model.to(device).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(parameter_groups(model, optim), fused=fused_adamw_supported(model))  # as the module
    total = warmup_steps + steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, 1, total))
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator).to(device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, n_classes, (batch_size,), generator=generator).to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if precision.startswith("bf16")
            else contextlib.nullcontext()
        )
        with autocast:
            logits = model(images)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        if gradient_clip:
            nn.utils.clip_grad_norm_(model.parameters(), gradient_clip)
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


def generate_subset(
    root: Path, preset: str, n_subjects: int, samples_per_class: int, workers: int, progress: bool = True
) -> tuple[pd.DataFrame, float]:
    """Generate a small synthetic subset of `preset` into `root`; returns its sample table and the seconds taken.

    Generation is resumable, so a folder that already holds the videos costs ~0 s: delete it first to time it.
    """
    from pipeline.biovid import load_samples
    from pipeline.synthetic import PRESETS, generate

    if preset not in PRESETS:
        raise SystemExit(f"unknown synthetic preset {preset!r}; known: {', '.join(PRESETS)}")
    config = dataclasses.replace(PRESETS[preset], n_subjects=n_subjects, samples_per_class=samples_per_class)
    with timed() as seconds:
        generate(root, config, workers=workers, progress=progress)
    samples, _ = load_samples(root)
    return samples, seconds()


def prepared_subset(
    work_dir: Path, preset: str, n_subjects: int, samples_per_class: int, progress: bool = True
) -> Path:
    """A generated and cropped subset in `work_dir` (made once, reused); returns its processed folder."""
    from pipeline.preprocess import preprocess

    samples, _ = generate_subset(work_dir / "raw", preset, n_subjects, samples_per_class, cpu_cores(), progress)
    processed = work_dir / "processed"
    result = preprocess(samples, processed, workers=cpu_cores(), progress=progress)
    if result.frames.empty:
        raise SystemExit(f"preprocessing {work_dir / 'raw'} produced no crops; see {result.failures_csv}")
    return processed


def loader_dataset(
    source_dir: Path, out_dir: Path, min_train_images: int, classes: Sequence[str] = CLASS_NAMES, seed: int = 0
) -> dict[str, Any]:
    """A frame table and hold-out fold file over `source_dir`'s crops, with at least `min_train_images` training
    frames of `classes`.

    A small subset is listed several times, each copy as new subjects ("<name>+<copy>"): the crops are the same
    files either way and a real dataset's crops sit in the page cache after the first epoch too, so images/s is
    what the full dataset would give, while timing never crosses an epoch boundary mid-measurement.
    """
    frames_csv = source_dir / "frames.csv"
    if not frames_csv.is_file():
        raise SystemExit(f"frame table {frames_csv} not found: prepare the data first (make data)")
    source = pd.read_csv(frames_csv, dtype=str, keep_default_na=False)
    if source.empty:
        raise SystemExit(f"{frames_csv}: no frames")
    source["crop_path"] = [str((source_dir / path).resolve()) for path in source["crop_path"]]

    def copies_of(n_copies: int) -> pd.DataFrame:
        parts = []
        for copy in range(n_copies):
            part = source.copy()
            if copy:
                part["subject_name"] = part["subject_name"] + f"+{copy}"
                part["sample_name"] = part["sample_name"] + f"+{copy}"
            parts.append(part)
        return pd.concat(parts, ignore_index=True)

    n_copies = max(1, math.ceil(MIN_SUBJECTS / source["subject_name"].nunique()))
    while True:
        table = copies_of(n_copies)
        folds = make_folds(sorted(set(table["subject_name"])), "holdout", seed=seed)
        train_subjects = set(folds.loc[folds["role"] == "train", "subject_name"])
        n_train = int((table["subject_name"].isin(train_subjects) & table["class_name"].isin(classes)).sum())
        if n_train >= min_train_images:
            break
        n_copies = max(n_copies + 1, math.ceil(n_copies * min_train_images / max(1, n_train)))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out_dir / "frames.csv", table)
    fold_file = out_dir / "holdout.csv"
    write_folds(folds, fold_file)
    return {
        "processed_dir": out_dir,
        "fold_file": fold_file,
        "source": str(source_dir),
        "copies": n_copies,
        "source_frames": len(source),
        "train_frames": n_train,
    }


def write_report(out_dir: Path, stem: str, report: Mapping[str, Any]) -> Path:
    path = out_dir / f"{stem}.json"
    atomic_write_text(path, json.dumps(report, indent=2, default=str) + "\n")
    return path


def save_figure(figure, path: Path) -> Path:
    """Save a matplotlib figure as PNG atomically (the temporary file keeps the .png suffix for matplotlib)."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def print_table(title: str, rows: Sequence[Mapping[str, Any]]) -> None:
    print(f"\n{title}")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda value: f"{value:.3g}"))


# ---------------------------------------------------------------------------------------------------- the benchmark
def bench_preprocess(samples: pd.DataFrame, work_dir: Path, workers: int, progress: bool) -> tuple[dict, Path]:
    """Crop the subset with one worker and with `workers`, each into a fresh folder; returns figures and the last
    processed folder."""
    from pipeline.preprocess import PreprocessConfig, preprocess

    figures: dict[str, Any] = {}
    processed = work_dir
    for n_workers in sorted({1, workers}):
        processed = work_dir / f"processed_{n_workers}w"
        shutil.rmtree(processed, ignore_errors=True)  # resumable: leftovers would be skipped, not timed
        with timed() as seconds:
            result = preprocess(samples, processed, PreprocessConfig(), workers=n_workers, progress=progress)
        figures[f"videos_per_s_{n_workers}w"] = len(samples) / seconds()
        figures["crops"], figures["failed_videos"] = len(result.frames), len(result.failures)
    figures["workers"] = workers
    figures["videos_per_s_per_core"] = figures["videos_per_s_1w"]
    figures["videos_per_s_all_cores"] = figures[f"videos_per_s_{workers}w"]
    figures["parallel_efficiency"] = figures["videos_per_s_all_cores"] / (workers * figures["videos_per_s_1w"])
    return figures, processed


def bench_detection(samples: pd.DataFrame, progress: bool) -> dict[str, Any]:
    """Detection rate per class (separate calls, so each class's rate is exact), and overall."""
    from pipeline.faces import build_detector, detection_rate

    detector = build_detector("haar")
    per_class, frames, detected = {}, 0, 0
    classes = [name for name in CLASS_NAMES if name in set(samples["class_name"])]
    for class_name in tqdm(classes, desc="detection rate", unit="class", leave=False, disable=not progress):
        rate = detection_rate(samples.loc[samples["class_name"] == class_name, "video_path"], detector)
        per_class[class_name] = rate["overall"]
        frames, detected = frames + rate["n_frames"], detected + rate["n_detected"]
    return {
        "overall": detected / frames if frames else 0.0,
        "n_frames": frames,
        "n_detected": detected,
        "per_class": per_class,
    }


def bench_loader(
    dataset: Mapping[str, Any], data_config, augment: Mapping[str, Any], batch_size: int, passes: int, progress: bool
) -> dict[str, Any]:
    """Images/s of the training loader over `passes` full passes after one warm-up pass (workers persist)."""
    from pipeline.datamodule import PainDataModule
    from pipeline.tasks import get_task

    datamodule = PainDataModule(
        dataset["processed_dir"],
        dataset["fold_file"],
        0,
        get_task("five_class"),
        data_config,
        augment,
        batch_size=batch_size,
    )
    datamodule.setup()
    loader = datamodule.train_dataloader()
    size = data_config.input_size[1]
    for _ in tqdm(loader, desc=f"loader {size} px (warm-up)", leave=False, disable=not progress):
        pass
    images = 0
    with timed() as seconds:
        for index in range(passes):
            for batch in tqdm(
                loader, desc=f"loader {size} px pass {index + 1}/{passes}", leave=False, disable=not progress
            ):
                images += len(batch[0])
    del loader  # shuts the persistent workers down
    return {
        "images_per_s": images / seconds(),
        "images": images,
        "passes": passes,
        "workers": datamodule.num_workers,
        "batch_size": batch_size,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.backbones import create_backbone, create_model
    from pipeline.cv import precision_for, use_channels_last
    from pipeline.synthetic import PRESETS

    check_model_names([args.train_model])
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    cores = cpu_cores()
    report: dict[str, Any] = {
        "environment": environment(),
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
    }
    report["settings"]["torch_threads"] = torch.get_num_threads()
    print(
        f"bench_data on {report['environment']['device']} ({report['environment']['device_name']}), {cores} cores, "
        f"load {report['environment']['load_average_1min']}, torch threads {torch.get_num_threads()}"
    )

    # 1 + 2: preprocessing throughput and detection rate, per preset.
    report["preprocess"], report["detection"] = {}, {}
    processed_by_preset: dict[str, Path] = {}
    for preset in args.presets:
        preset_dir = args.work_dir / preset
        shutil.rmtree(preset_dir, ignore_errors=True)  # generation is resumable: start empty so it is timed
        samples, generate_seconds = generate_subset(
            preset_dir / "raw", preset, args.subjects, args.samples_per_class, args.workers, progress
        )
        figures, processed_by_preset[preset] = bench_preprocess(samples, preset_dir, args.workers, progress)
        report["preprocess"][preset] = {
            "width": PRESETS[preset].width,
            "height": PRESETS[preset].height,
            "videos": len(samples),
            "generate_s_per_video": generate_seconds / len(samples),
            "generate_core_s_per_video": generate_seconds * min(args.workers, len(samples)) / len(samples),
            **figures,
        }
        report["detection"][preset] = bench_detection(samples, progress)
    print_table(
        "Preprocessing (face crops) and synthetic detection rate",
        [
            {
                "preset": preset,
                "size": f"{p['width']}x{p['height']}",
                "videos": p["videos"],
                "gen s/video": p["generate_s_per_video"],
                "videos/s/core": p["videos_per_s_per_core"],
                f"videos/s ({p['workers']} workers)": p["videos_per_s_all_cores"],
                "efficiency": p["parallel_efficiency"],
                "detected": report["detection"][preset]["overall"],
                **{f"det {k}": v for k, v in report["detection"][preset]["per_class"].items()},
            }
            for preset, p in report["preprocess"].items()
        ],
    )

    # 3: loader throughput against training throughput.
    if args.loader_data == "auto" and (PROJECT_PROCESSED / "frames.csv").is_file():
        source, source_kind = PROJECT_PROCESSED, "project"
    else:
        preset = "default" if "default" in processed_by_preset else args.presets[0]
        source, source_kind = processed_by_preset[preset], f"subset:{preset}"
    dataset = loader_dataset(source, args.work_dir / "loader", args.batch_size * args.loader_batches)
    report["loader_dataset"] = {
        "kind": source_kind,
        **{k: v for k, v in dataset.items() if k not in ("processed_dir", "fold_file")},
    }
    augment = load_augment(args.augment)
    base_config = create_backbone(args.train_model, pretrained=False)[0].data_config
    device = compute_device()
    precision = precision_for("auto")
    channels_last = use_channels_last("auto", args.train_model)
    report["loader"] = {}
    for size in args.img_sizes:
        loader = bench_loader(
            dataset, base_config.with_image_size(size), augment, args.batch_size, args.passes, progress
        )
        torch.manual_seed(0)
        model, _ = create_model(args.train_model, n_classes=2, pretrained=False, img_size=size)
        training = bare_training_throughput(
            model,
            load_optim(args.train_model),
            batch_size=args.batch_size,
            img_size=size,
            n_classes=2,
            steps=args.train_steps,
            warmup_steps=args.train_warmup,
            precision=precision,
            channels_last=channels_last,
            progress=progress,
            desc=f"{args.train_model} {size} px",
        )
        del model
        report["loader"][str(size)] = {
            **loader,
            "training_images_per_s": training["images_per_s"],
            "training_seconds_per_step": training["seconds_per_step"],
            "ratio": loader["images_per_s"] / training["images_per_s"],
            "model": args.train_model,
            "precision": precision,
            "channels_last": channels_last,
            "device": device.type,
        }
    report["loader_target_ratio"] = LOADER_TARGET_RATIO
    print_table(
        f"Training loader ({args.augment} augmentation, {report['loader_dataset']['kind']} data) against "
        f"{args.train_model} training on {device.type}",
        [
            {
                "img px": int(size),
                "batch": entry["batch_size"],
                "workers": entry["workers"],
                "loader img/s": entry["images_per_s"],
                "train img/s": entry["training_images_per_s"],
                "loader/train": entry["ratio"],
                "target": f">= {LOADER_TARGET_RATIO:g}: {'ok' if entry['ratio'] >= LOADER_TARGET_RATIO else 'LOW'}",
            }
            for size, entry in report["loader"].items()
        ],
    )
    return report


def plot(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    presets = list(report["preprocess"])
    x = np.arange(len(presets))
    left.bar(x - 0.2, [report["preprocess"][p]["videos_per_s_per_core"] for p in presets], 0.4, label="1 worker")
    left.bar(x + 0.2, [report["preprocess"][p]["videos_per_s_all_cores"] for p in presets], 0.4, label="all cores")
    left.set_xticks(
        x, [f"{p}\n{report['preprocess'][p]['width']}x{report['preprocess'][p]['height']}" for p in presets]
    )
    left.set_ylabel("videos / s")
    left.set_title("preprocessing throughput")
    left.legend(fontsize="small")
    sizes = list(report["loader"])
    x = np.arange(len(sizes))
    right.bar(x - 0.2, [report["loader"][s]["images_per_s"] for s in sizes], 0.4, label="training loader")
    right.bar(
        x + 0.2,
        [report["loader"][s]["training_images_per_s"] for s in sizes],
        0.4,
        label=f"{report['settings']['train_model']} training",
    )
    right.set_xticks(x, [f"{s} px" for s in sizes])
    right.set_ylabel("images / s")
    right.set_yscale("log")
    right.set_title("loader against training")
    right.margins(y=0.2)
    right.legend(fontsize="small")
    figure.suptitle(
        f"bench_data on {report['environment']['device_name']} ({report['environment']['cpu_cores']} cores)"
    )
    return save_figure(figure, path)


FULL_DEFAULTS: dict[str, Any] = {
    "presets": ["default", "full"],
    "subjects": 2,
    "samples_per_class": 2,
    "img_sizes": [224, 112],
    "batch_size": 32,
    "passes": 3,
    "loader_batches": 32,
    "train_model": "mobilevit_s",
    "train_steps": lambda args: 20 if torch.cuda.is_available() else 3,  # a GPU step is fast; a few more steady it
    "train_warmup": lambda args: 5 if torch.cuda.is_available() else 1,
    "threads": lambda args: cpu_cores(),
}
QUICK_DEFAULTS: dict[str, Any] = {
    "presets": ["tiny"],
    "subjects": 1,
    "samples_per_class": 1,
    "img_sizes": [32],
    "batch_size": 8,
    "passes": 1,
    "loader_batches": 4,
    "train_model": "mobilevit_xxs",
    "train_steps": 2,
    "train_warmup": 1,
    "threads": 1,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: preset tiny, 5 videos, 32 px, MobileViT-XXS (explicit options still win)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default: %(default)s)")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK,
        help="generated subsets and crops; each preset's folder is recreated (default: %(default)s)",
    )
    parser.add_argument("--presets", type=name_list, help="synthetic presets to time (default: default,full)")
    parser.add_argument("--subjects", type=int, help="subjects per subset (default: 2)")
    parser.add_argument("--samples-per-class", type=int, help="videos per subject and class (default: 2)")
    parser.add_argument(
        "--workers",
        type=int,
        default=cpu_cores(),
        help="processes of the all-cores runs (default: all cores, %(default)s)",
    )
    parser.add_argument("--img-sizes", type=positive_int_list, help="loader/training input sizes (default: 224,112)")
    parser.add_argument("--batch-size", type=int, help="loader and training batch (default: 32)")
    parser.add_argument("--passes", type=int, help="timed loader passes after one warm-up pass (default: 3)")
    parser.add_argument(
        "--loader-batches",
        type=int,
        help="at least this many batches per loader pass; a small subset is repeated (default: 32)",
    )
    parser.add_argument(
        "--loader-data",
        choices=("auto", "subset"),
        default="auto",
        help=f"auto: {PROJECT_PROCESSED.relative_to(PROJECT_ROOT)} if prepared, else the subset",
    )
    parser.add_argument("--augment", default="heavy", help="configs/augment/<name>.yaml (default: %(default)s)")
    parser.add_argument(
        "--train-model", help="backbone whose training speed the loader is compared with (default: mobilevit_s)"
    )
    parser.add_argument("--train-steps", type=int, help="timed training steps (default: 20 on a GPU, 3 on a CPU)")
    parser.add_argument(
        "--train-warmup", type=int, help="untimed training steps first (default: 5 on a GPU, 1 on a CPU)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads of the training steps (default: all cores; --quick: 1)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = fill_defaults(parser.parse_args(argv), FULL_DEFAULTS, QUICK_DEFAULTS)
    for key in (
        "subjects",
        "samples_per_class",
        "workers",
        "batch_size",
        "passes",
        "loader_batches",
        "train_steps",
        "threads",
    ):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.train_warmup < 0:
        parser.error("--train-warmup must be >= 0")
    args.out, args.work_dir = args.out.resolve(), args.work_dir.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path = write_report(args.out, "bench_data", report)
    png_path = plot(report, args.out / "bench_data.png")
    print(f"\nwrote {json_path}\n      {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
