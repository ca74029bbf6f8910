"""Training throughput benchmark: the real path (PainDataModule + PainLightningModule + Lightning Trainer) against a
bare PyTorch loop on the same model, per backbone, with the settings `make cv` trains with.

What it measures (numbers for the release notes, not a test), for each backbone:

(a) images/s of the REAL training path: `PainDataModule` over prepared face crops, `PainLightningModule`
    (pipeline/module.py), `pl.Trainer` with no logger, checkpointing or validation; a callback times the training
    batches after the warm-up steps (data loading included, as in training);
(b) images/s of a bare PyTorch loop on the same model, batch, optimizer groups, precision, gradient clipping and
    schedule, on one pre-made random batch;
(c) the ratio a / b: the cost of Lightning and the data loader. Target >= 0.9;
(d) with --finetune, each fine-tuning strategy (`model.finetune`: full, top_blocks, lora, frozen) of each backbone:
    its trainable parameters and the peak memory of the real path (a GPU's peak allocation; on a CPU the process's
    peak resident set, which also holds what the allocator kept from the rows before it: there, the first row is
    exact and the later ones are upper bounds; run one strategy per call for a clean CPU figure). A frozen strategy
    runs the backbone on the images here (`cache.embeddings=false`): the embedding cache's own speed is
    scripts/bench_finetune.py's.

Settings: composed by `pipeline.utils.config.load_config` from the same key=value overrides as `python -m pipeline cv`,
and the model and data built by `make cv`'s own `pipeline.runs.jobs.fold_job.build_fold`, so the image size, batch,
loader, augmentation, optimizer recipe and precision are those of `make cv` for that backbone and dataset, data_model
specialisation included. Backbones: --models, else the one the overrides pick (model=...), else vit_b16, cvt_13 and
mobilevit_s. Models start from random weights: speed does not depend on them.

Both paths use the same torch thread count: by default the CPUs left over by the dataloader workers (at least 1),
because OpenMP threads that wait on a busy core slow training several-fold.

Data: the config's prepared crops (data.processed_dir) if there are any, else a small generated subset cropped
once into --work-dir; either is listed repeatedly until one epoch covers the run.

Run:
    make bench                                         # = .venv/bin/python scripts/bench_train.py
    .venv/bin/python scripts/bench_train.py --models mobilevit_s model.img_size=224 augment=heavy
    .venv/bin/python scripts/bench_train.py data=biovid model=cvt_13 --steps 20
    .venv/bin/python scripts/bench_train.py --quick    # tiny smoke version (seconds)
    .venv/bin/python scripts/bench_train.py --models vit_b16 --finetune full,lora    # LoRA against full

Prints a results table; writes reports/bench/bench_train.json and bench_train.png (atomic writes).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig

from pipeline.analysis.throughput import (
    DEFAULT_OUT,
    DEFAULT_WORK,
    bare_training_throughput,
    build,
    compute_device,
    environment,
    fill_defaults,
    load_configs,
    loader_dataset,
    name_list,
    peak_memory,
    precision,
    prepared_subset,
    print_table,
    synchronize,
    training_settings,
    write_report,
)
from pipeline.data.datamodule import PainDataModule
from pipeline.data.prepare import DataSettings
from pipeline.models.finetune import FinetuneConfig, parameter_counts
from pipeline.models.lightning_module import PainLightningModule
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.store import tracking
from pipeline.utils.accelerator import announce_device_or_exit
from pipeline.utils.cpus import available_cpus
from pipeline.utils.paths import resolve_path

TARGET_RATIO = 0.9  # real path images/s over bare loop images/s
DEFAULT_MODELS = ["vit_b16", "cvt_13", "mobilevit_s"]
QUICK_MODELS = ["mobilevit_xxs"]
QUICK_OVERRIDES = ["model.img_size=32", "loader.batch_size=8"]  # before the command line's, which win


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
    cfg: DictConfig, module: PainLightningModule, datamodule: PainDataModule, args: argparse.Namespace
) -> float:
    """(a): images/s of the real training path, timed by `TrainThroughput`."""
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
        accelerator=cfg.trainer.accelerator,
        devices=1,
        precision=precision(TrainingSettings.from_config(cfg)),
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        deterministic=cfg.trainer.deterministic,
        callbacks=[timer],
        default_root_dir=args.work_dir,
    )
    with warnings.catch_warnings():
        # The worker count is the config's (see the module docstring); Lightning would advise more.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, datamodule=datamodule)
    if timer.timed_steps != args.steps:
        raise RuntimeError(f"{cfg.model.name}: {timer.timed_steps} timed steps ran, expected {args.steps}")
    return timer.images_per_s


def bench_model(cfg: DictConfig, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(a), (b) and (c) for one backbone."""
    name = cfg.model.name
    recipe = TrainingSettings.from_config(cfg)  # what `make cv` trains, read once
    # One epoch covers warm-up and timed steps, so no epoch restart (worker refill) falls inside the timing.
    min_images = cfg.loader.batch_size * (args.warmup_steps + args.steps + 1)
    dataset = loader_dataset(source, args.work_dir / "train_loader" / name, min_images, recipe)
    module, datamodule = build(recipe, dataset)
    settings = training_settings(recipe, module, datamodule)
    torch.set_num_threads(args.threads or max(1, available_cpus() - settings["num_workers"]))
    print(f"\n{name}: {settings['img_size']} px, batch {settings['batch_size']}, {settings['precision']}, "
          f"{settings['num_workers']} loader worker(s), {torch.get_num_threads()} torch thread(s); "
          f"Lightning + PainDataModule ...", flush=True)
    counts = parameter_counts(module.model)
    with peak_memory(compute_device()) as peak:
        real = lightning_throughput(cfg, module, datamodule, args)
    peak_mb = peak()
    del module, datamodule
    print(f"{name}: bare PyTorch loop ...", flush=True)
    module, _ = build(recipe, dataset)  # a fresh model and optimizer
    bare = bare_training_throughput(recipe, module, settings["batch_size"], steps=args.steps,
                                    warmup_steps=args.warmup_steps, progress=not args.no_progress, desc=f"{name} bare")
    return {
        "lightning_images_per_s": real,
        "bare_images_per_s": bare["images_per_s"],
        "ratio": real / bare["images_per_s"],
        "bare_seconds_per_step": bare["seconds_per_step"],
        "parameters_M": sum(p.numel() for p in module.model.parameters()) / 1e6,
        "parameters_trainable": counts["parameters_trainable"],
        "backbone_trainable_share": counts["backbone_parameters_trainable"] / counts["backbone_parameters"],
        "peak_memory_MB": peak_mb,
        "torch_threads": torch.get_num_threads(),
        "settings": settings,
        "dataset": {k: v for k, v in dataset.items() if k not in ("processed_dir", "fold_file")},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = load_configs(args.overrides, args.models, QUICK_MODELS if args.quick else DEFAULT_MODELS)
    if args.finetune:  # each backbone under each strategy, keyed "<backbone> <strategy>"
        configs = [with_finetune(cfg, strategy) for cfg in configs for strategy in args.finetune]
    training = announce_device_or_exit(configs[0].trainer.accelerator)  # an unusable GPU: an error
    device = compute_device()
    report: dict[str, Any] = {
        "environment": {**environment(), **tracking.training_device_tags(training)},
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
    }
    report["settings"]["device"] = device.type
    env = report["environment"]
    print(f"bench_train on {device.type} ({env['device_name']}), {env['cpu_cores']} CPUs, load "
          f"{env['load_average_1min']}: {args.warmup_steps} warm-up + {args.steps} timed steps per path")

    processed = resolve_path(configs[0].data.processed_dir)
    if args.data == "auto" and (processed / "frames.csv").is_file():
        source, kind = processed, "project"
    else:
        subset_dir = args.work_dir / f"subset_{args.preset}_{args.subjects}x{args.samples_per_class}"
        source = prepared_subset(subset_dir, args.preset, args.subjects, args.samples_per_class,
                                 DataSettings.from_config(configs[0]),
                                 progress=not args.no_progress)
        kind = f"subset:{args.preset}"
    report["data"] = {"kind": kind, "source": str(source)}
    report["models"] = {bench_key(cfg, args): bench_model(cfg, source, args) for cfg in configs}
    report["target_ratio"] = TARGET_RATIO
    print_table(
        f"Training throughput on {device.type}, {kind} data, {args.steps} timed steps",
        [
            {
                "model": entry["settings"]["model"],
                "finetune": entry["settings"]["finetune"],
                "px": entry["settings"]["img_size"],
                "batch": entry["settings"]["batch_size"],
                "precision": entry["settings"]["precision"],
                "params (M)": entry["parameters_M"],
                "trainable": entry["parameters_trainable"],
                "backbone trainable": f"{100 * entry['backbone_trainable_share']:.2f} %",
                "peak MB": entry["peak_memory_MB"],
                "Lightning+DataModule img/s": entry["lightning_images_per_s"],
                "bare PyTorch img/s": entry["bare_images_per_s"],
                "ratio": entry["ratio"],
                "target": f">= {TARGET_RATIO:g}: {'ok' if entry['ratio'] >= TARGET_RATIO else 'LOW'}",
            }
            for entry in report["models"].values()
        ],
    )
    return report


def with_finetune(cfg: DictConfig, strategy: str) -> DictConfig:
    """`cfg` under fine-tuning strategy `strategy`; a frozen backbone runs on the images (no embedding cache)."""
    cfg = copy.deepcopy(cfg)
    cfg.model.finetune = strategy
    if strategy == "frozen":
        cfg.cache.embeddings = False
    FinetuneConfig.from_config(cfg.model, cfg.cache)  # an unknown strategy fails here, before any data is made
    return cfg


def bench_key(cfg: DictConfig, args: argparse.Namespace) -> str:
    """The report's key: the backbone, and its strategy's label when strategies were asked for."""
    if not args.finetune:
        return cfg.model.name
    return f"{cfg.model.name} {FinetuneConfig.from_config(cfg.model, cfg.cache).label}"


def plot(report: Mapping[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    from pipeline.utils.atomic_io import save_png

    models = list(report["models"])
    entries = [report["models"][m] for m in models]
    x = np.arange(len(models))
    figure = Figure(figsize=(max(5, 2.2 * len(models)), 4))
    axes = figure.subplots()
    real = [entry["lightning_images_per_s"] for entry in entries]
    bare = [entry["bare_images_per_s"] for entry in entries]
    axes.bar(x - 0.2, real, 0.4, label="Lightning + DataModule")
    axes.bar(x + 0.2, bare, 0.4, label="bare PyTorch")
    for index, entry in enumerate(entries):
        axes.annotate(f"{entry['ratio']:.2f}x", (index, max(real[index], bare[index])), ha="center", va="bottom")
    axes.set_xticks(x, [f"{m}\n{e['settings']['img_size']} px, batch {e['settings']['batch_size']}, "
                        f"{e['settings']['precision']}" for m, e in zip(models, entries, strict=True)])
    axes.set_ylabel("training images / s")
    axes.set_title(f"{report['settings']['device']} ({report['environment']['device_name']})")
    axes.margins(y=0.15)  # room for the ratio labels
    axes.legend(loc="lower right", fontsize="small")
    save_png(figure, path)
    return path


FULL_DEFAULTS: dict[str, Any] = {
    "steps": lambda: 50 if torch.cuda.is_available() else 8,
    "warmup_steps": lambda: 10 if torch.cuda.is_available() else 2,
    "preset": "default",
    "subjects": 2,
    "samples_per_class": 2,
}
QUICK_DEFAULTS: dict[str, Any] = {
    "steps": 3, "warmup_steps": 1, "preset": "tiny", "subjects": 1, "samples_per_class": 1
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as `python -m pipeline`")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny smoke run: {','.join(QUICK_MODELS)}, {' '.join(QUICK_OVERRIDES)}, 3 steps, preset tiny "
        f"(explicit options and overrides still win)",
    )
    parser.add_argument(
        "--models", type=name_list, help=f"backbones, comma-separated (default: {','.join(DEFAULT_MODELS)})"
    )
    parser.add_argument("--finetune", type=name_list,
                        help="fine-tuning strategies to set side by side, comma-separated (full,top_blocks,lora,"
                             "frozen; default: the config's model.finetune alone)")
    parser.add_argument("--steps", type=int, help="timed steps per path (default: 50 on a GPU, 8 on a CPU)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps first (default: 10 on a GPU, 2 on a CPU)")
    parser.add_argument("--threads", type=int, help="torch threads, both paths (default: CPUs - loader workers, >= 1)")
    parser.add_argument(
        "--data",
        choices=("auto", "subset"),
        default="auto",
        help="auto: the config's data.processed_dir if prepared, else a subset",
    )
    parser.add_argument("--preset", help="synthetic preset of the fallback subset (default: default)")
    parser.add_argument("--subjects", type=int, help="subjects of the fallback subset (default: 2)")
    parser.add_argument("--samples-per-class", type=int, help="videos per subject and class (default: 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default: %(default)s)")
    parser.add_argument(
        "--work-dir", type=Path, default=DEFAULT_WORK, help="fallback subset and loader tables (default: %(default)s)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = fill_defaults(parser.parse_intermixed_args(argv), FULL_DEFAULTS, QUICK_DEFAULTS)
    for key in ("steps", "warmup_steps", "subjects", "samples_per_class"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.quick:
        args.overrides = [*QUICK_OVERRIDES, *args.overrides]
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
