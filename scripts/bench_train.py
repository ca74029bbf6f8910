"""Training throughput benchmark: the real path (PainDataModule + PainClassifier + Lightning Trainer) against a bare
PyTorch loop on the same model, per backbone.

What it measures (numbers for the release notes, not a test), for each backbone of --models:

(a) images/s of the REAL training path: `PainDataModule` over prepared face crops with the heavy augmentation,
    `PainClassifier` (pipeline/module.py), `pl.Trainer` with no logger, checkpointing or validation; a callback
    times the training batches after the warm-up steps (data loading included, as in training);
(b) images/s of a bare PyTorch loop on the same model (`create_model`), same batch size, optimizer groups
    (`pipeline.module.parameter_groups`), gradient clipping and schedule, on one pre-made random batch;
(c) the ratio a / b: the cost of Lightning and the data loader. Target >= 0.9.

Both paths use the same torch thread count. On a CPU the dataloader workers need cores of their own, so by default
workers = half the cores and torch threads = the rest (2 cores: 1 worker, 1 thread): more would oversubscribe, and
OpenMP threads that wait on a busy core slow training several-fold. On CUDA: bf16 autocast and channels_last for
convolutional backbones, as in cross-validation (`pipeline.cv.precision_for`, `use_channels_last`).

Data: the project's prepared dataset (data/processed/synthetic) if there is one, else a small default-preset subset
generated and cropped once into --work-dir (its crops listed repeatedly until one epoch covers the run). Models
start from random weights: speed does not depend on them.

Run:
    make bench                                         # = .venv/bin/python scripts/bench_train.py
    .venv/bin/python scripts/bench_train.py --models mobilevit_s --img-size 224
    .venv/bin/python scripts/bench_train.py --quick    # tiny smoke version (seconds)

Prints a results table; writes reports/bench/bench_train.json and bench_train.png (atomic writes).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from bench_data import (
    DEFAULT_OUT,
    DEFAULT_WORK,
    PROJECT_PROCESSED,
    bare_training_throughput,
    check_model_names,
    compute_device,
    cpu_cores,
    environment,
    fill_defaults,
    load_augment,
    load_optim,
    loader_dataset,
    name_list,
    prepared_subset,
    print_table,
    save_figure,
    synchronize,
    write_report,
)

from pipeline import PROJECT_ROOT

TARGET_RATIO = 0.9  # real path images/s over bare loop images/s


class TrainThroughput(pl.Callback):
    """Images/s of training batches after `warmup_steps`: from the end of the last warm-up batch to the end of the
    last batch, so waiting for data between batches counts, as it does in training."""

    def __init__(self, warmup_steps: int) -> None:
        if warmup_steps < 1:
            raise ValueError("need at least one warm-up step to start the clock after")
        self.warmup_steps = warmup_steps
        self.batches = 0
        self.images = 0
        self.start: float | None = None
        self.end: float | None = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        synchronize(pl_module.device)
        now = time.perf_counter()
        self.batches += 1
        if self.batches == self.warmup_steps:
            self.start = now
        elif self.batches > self.warmup_steps:
            self.images += len(batch[0])
            self.end = now

    @property
    def images_per_s(self) -> float:
        if self.start is None or self.end is None or self.end <= self.start:
            raise RuntimeError(f"no timed batches: {self.batches} batch(es) ran, {self.warmup_steps} were warm-up")
        return self.images / (self.end - self.start)

    @property
    def timed_steps(self) -> int:
        return self.batches - self.warmup_steps


def lightning_throughput(
    model_name: str, dataset: Mapping[str, Any], args: argparse.Namespace, precision: str, channels_last: bool
) -> dict[str, float]:
    """(a): the real training path, timed by `TrainThroughput`."""
    from pipeline.backbones import create_model
    from pipeline.datamodule import PainDataModule
    from pipeline.module import PainClassifier
    from pipeline.tasks import get_task

    task = get_task(args.task)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    net, _ = create_model(model_name, n_classes=task.n_classes, pretrained=False, img_size=args.img_size)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    datamodule = PainDataModule(
        dataset["processed_dir"],
        dataset["fold_file"],
        0,
        task,
        net.backbone.data_config,
        load_augment(args.augment),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        seed=args.seed,
    )
    module = PainClassifier(net, task.classes, load_optim(model_name), channels_last=channels_last)
    timer = TrainThroughput(args.warmup_steps)
    trainer = pl.Trainer(
        max_steps=args.warmup_steps + args.steps,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.no_progress,
        accelerator="auto",
        devices=1,
        precision=precision,
        gradient_clip_val=args.gradient_clip,
        callbacks=[timer],
        default_root_dir=args.work_dir,
    )
    with warnings.catch_warnings():
        # The worker count is chosen on purpose (see the module docstring); Lightning would advise more.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, datamodule=datamodule)
    if timer.timed_steps != args.steps:
        raise RuntimeError(f"{model_name}: {timer.timed_steps} timed steps ran, expected {args.steps}")
    return {
        "images_per_s": timer.images_per_s,
        "timed_steps": timer.timed_steps,
        "parameters_M": sum(p.numel() for p in net.parameters()) / 1e6,
    }


def bare_throughput(model_name: str, args: argparse.Namespace, precision: str, channels_last: bool) -> dict:
    """(b): the same model and optimizer recipe in a plain loop on an in-memory batch."""
    from pipeline.backbones import create_model
    from pipeline.tasks import get_task

    task = get_task(args.task)
    torch.manual_seed(args.seed)
    net, _ = create_model(model_name, n_classes=task.n_classes, pretrained=False, img_size=args.img_size)
    return bare_training_throughput(
        net,
        load_optim(model_name),
        batch_size=args.batch_size,
        img_size=args.img_size,
        n_classes=task.n_classes,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        precision=precision,
        channels_last=channels_last,
        gradient_clip=args.gradient_clip,
        seed=args.seed,
        progress=not args.no_progress,
        desc=f"{model_name} bare",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.cv import precision_for, use_channels_last
    from pipeline.tasks import get_task

    check_model_names(args.models)
    torch.set_num_threads(args.threads)
    device = compute_device()
    precision = precision_for("auto")
    report: dict[str, Any] = {
        "environment": environment(),
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
    }
    report["settings"].update(device=device.type, precision=precision, torch_threads=torch.get_num_threads())
    env = report["environment"]
    print(
        f"bench_train on {device.type} ({env['device_name']}), {env['cpu_cores']} cores, load "
        f"{env['load_average_1min']}: {args.img_size} px, batch {args.batch_size}, {args.warmup_steps} warm-up + "
        f"{args.steps} timed steps, precision {precision}, torch threads {torch.get_num_threads()}, "
        f"dataloader workers {args.num_workers}"
    )

    if args.data == "auto" and (PROJECT_PROCESSED / "frames.csv").is_file():
        source, kind = PROJECT_PROCESSED, "project"
    else:
        subset_dir = args.work_dir / f"subset_{args.preset}_{args.subjects}x{args.samples_per_class}"
        source = prepared_subset(
            subset_dir, args.preset, args.subjects, args.samples_per_class, progress=not args.no_progress
        )
        kind = f"subset:{args.preset}"
    # One epoch covers warm-up and timed steps, so no epoch restart (worker refill) falls inside the timing.
    min_images = args.batch_size * (args.warmup_steps + args.steps + 1)
    dataset = loader_dataset(
        source, args.work_dir / "train_loader", min_images, get_task(args.task).classes, seed=args.seed
    )
    report["dataset"] = {"kind": kind, **{k: v for k, v in dataset.items() if k not in ("processed_dir", "fold_file")}}

    report["models"] = {}
    for model_name in args.models:
        channels_last = use_channels_last("auto", model_name)
        print(f"\n{model_name}: Lightning + PainDataModule ...", flush=True)
        real = lightning_throughput(model_name, dataset, args, precision, channels_last)
        print(f"{model_name}: bare PyTorch loop ...", flush=True)
        bare = bare_throughput(model_name, args, precision, channels_last)
        report["models"][model_name] = {
            "lightning_images_per_s": real["images_per_s"],
            "bare_images_per_s": bare["images_per_s"],
            "ratio": real["images_per_s"] / bare["images_per_s"],
            "bare_seconds_per_step": bare["seconds_per_step"],
            "parameters_M": real["parameters_M"],
            "channels_last": channels_last,
        }
    report["target_ratio"] = TARGET_RATIO
    print_table(
        f"Training throughput on {device.type}, {args.img_size} px, batch {args.batch_size}, {precision}, "
        f"{torch.get_num_threads()} torch thread(s), {args.num_workers} loader worker(s), "
        f"{args.augment} augmentation",
        [
            {
                "model": name,
                "params (M)": entry["parameters_M"],
                "Lightning+DataModule img/s": entry["lightning_images_per_s"],
                "bare PyTorch img/s": entry["bare_images_per_s"],
                "ratio": entry["ratio"],
                "target": f">= {TARGET_RATIO:g}: {'ok' if entry['ratio'] >= TARGET_RATIO else 'LOW'}",
            }
            for name, entry in report["models"].items()
        ],
    )
    return report


def plot(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    x = np.arange(len(models))
    figure, axes = plt.subplots(figsize=(max(5, 2.2 * len(models)), 4))
    real = [report["models"][m]["lightning_images_per_s"] for m in models]
    bare = [report["models"][m]["bare_images_per_s"] for m in models]
    axes.bar(x - 0.2, real, 0.4, label="Lightning + DataModule")
    axes.bar(x + 0.2, bare, 0.4, label="bare PyTorch")
    for index, model in enumerate(models):
        axes.annotate(
            f"{report['models'][model]['ratio']:.2f}x", (index, max(real[index], bare[index])), ha="center", va="bottom"
        )
    axes.set_xticks(x, models)
    axes.set_ylabel("training images / s")
    settings = report["settings"]
    axes.set_title(
        f"{settings['device']} ({report['environment']['device_name']}), {settings['img_size']} px, "
        f"batch {settings['batch_size']}, {settings['precision']}"
    )
    axes.margins(y=0.15)  # room for the ratio labels
    axes.legend(loc="lower right", fontsize="small")
    return save_figure(figure, path)


FULL_DEFAULTS: dict[str, Any] = {
    "models": ["vit_b16", "cvt_13", "mobilevit_s"],
    "img_size": lambda args: 224 if torch.cuda.is_available() else 112,
    "batch_size": 32,
    "steps": lambda args: 50 if torch.cuda.is_available() else 8,
    "warmup_steps": lambda args: 10 if torch.cuda.is_available() else 2,
    "preset": "default",
    "subjects": 2,
    "samples_per_class": 2,
}
QUICK_DEFAULTS: dict[str, Any] = {
    "models": ["mobilevit_xxs"],
    "img_size": 32,
    "batch_size": 8,
    "steps": 3,
    "warmup_steps": 1,
    "preset": "tiny",
    "subjects": 1,
    "samples_per_class": 1,
}


def default_workers() -> int:
    """GPU: the datamodule's own default; CPU: half the cores, the other half for torch threads."""
    from pipeline.datamodule import default_num_workers

    return default_num_workers() if torch.cuda.is_available() else max(1, cpu_cores() // 2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: MobileViT-XXS, 32 px, 3 steps, preset tiny (explicit options still win)",
    )
    parser.add_argument(
        "--models", type=name_list, help="backbones, comma-separated (default: vit_b16,cvt_13,mobilevit_s)"
    )
    parser.add_argument("--img-size", type=int, help="input size (default: 224 on a GPU, 112 on a CPU)")
    parser.add_argument("--batch-size", type=int, help="training batch (default: 32)")
    parser.add_argument("--steps", type=int, help="timed steps per path (default: 50 on a GPU, 8 on a CPU)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps first (default: 10 on a GPU, 2 on a CPU)")
    parser.add_argument(
        "--num-workers",
        type=int,
        help="dataloader workers (default: GPU: the datamodule's default; CPU: half the cores)",
    )
    parser.add_argument("--threads", type=int, help="torch threads, both paths (default: cores - workers, >= 1)")
    parser.add_argument("--task", default="bl1_vs_pa4", help="task of the real path (default: %(default)s)")
    parser.add_argument("--augment", default="heavy", help="configs/augment/<name>.yaml (default: %(default)s)")
    parser.add_argument(
        "--gradient-clip",
        type=float,
        default=1.0,
        help="gradient norm clip in both paths, as configs/trainer (default: %(default)s; 0: off)",
    )
    parser.add_argument(
        "--data",
        choices=("auto", "subset"),
        default="auto",
        help=f"auto: {PROJECT_PROCESSED.relative_to(PROJECT_ROOT)} if prepared, else a subset",
    )
    parser.add_argument("--preset", help="synthetic preset of the fallback subset (default: default)")
    parser.add_argument("--subjects", type=int, help="subjects of the fallback subset (default: 2)")
    parser.add_argument("--samples-per-class", type=int, help="videos per subject and class (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default: %(default)s)")
    parser.add_argument(
        "--work-dir", type=Path, default=DEFAULT_WORK, help="fallback subset and loader tables (default: %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = fill_defaults(parser.parse_args(argv), FULL_DEFAULTS, QUICK_DEFAULTS)
    if args.num_workers is None:
        args.num_workers = default_workers()
    if args.threads is None:
        args.threads = max(1, cpu_cores() - args.num_workers)
    for key in ("img_size", "batch_size", "steps", "warmup_steps", "threads", "subjects", "samples_per_class"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.num_workers < 0:
        parser.error("--num-workers must be >= 0")
    from pipeline.tasks import TASKS

    if args.task not in TASKS:
        parser.error(f"unknown --task {args.task!r}; known: {', '.join(TASKS)}")
    args.out, args.work_dir = args.out.resolve(), args.work_dir.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    json_path = write_report(args.out, "bench_train", report)
    png_path = plot(report, args.out / "bench_train.png")
    print(f"\nwrote {json_path}\n      {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
