"""Fine-tuning strategies, measured: LoRA's share of trainable backbone weights, the embedding cache's build time, and
a frozen CV's time per epoch from cached embeddings against from images.

    .venv/bin/python scripts/bench_finetune.py [--model vit_b16] [--epochs 3] [key=value ...]

On the synthetic twin of this checkout (`make data` first), fold 0 of kfold5, BL1 vs PA4, the data_model settings of
the backbone (vit_b16: 48 px, two crops per clip from 3.5 s). Prints one JSON object; name the CPU beside the numbers.
The full frozen CVs (all folds, cached and from images) are timed with --cv.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from pipeline.data.datamodule import SubjectRoles
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneConfig, parameter_counts, strategy_for
from pipeline.runs.jobs.embed import run_embed
from pipeline.runs.jobs.fold_decisions import plan_decisions
from pipeline.runs.jobs.fold_job import build_fold
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.utils.config import load_config
from pipeline.utils.paths import resolve_path


class EpochTimer(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # after the epoch's validation
        self.seconds.append(time.perf_counter() - self.started)


def epoch_seconds(cfg, epochs: int) -> list[float]:
    training = TrainingSettings.from_config(cfg)
    built = build_fold(training, WhatTrains.of(training).check(), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                       plan_decisions(training, resolve_path(cfg.fold_file)))
    module, datamodule = built.module, built.datamodule
    timer = EpochTimer()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[timer])
    trainer.fit(module, datamodule=datamodule)
    return timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cv", action="store_true", help="also time the whole frozen kfold5 CV, cached and not")
    args, overrides = parser.parse_known_args()
    result: dict = {"cpu": torch.backends.cpu.get_cpu_capability(), "model": args.model}
    cfg = load_config([f"model={args.model}", "model.finetune=lora"])
    with torch.device("meta"):
        net, _ = create_model(args.model, img_size=224)
    strategy_for(FinetuneConfig.from_config(cfg.model, cfg.cache)).prepare(net)
    counts = parameter_counts(net)
    result["lora_r8_224px"] = {**counts, "trainable_share_of_backbone":
                               counts["backbone_parameters_trainable"] / counts["backbone_parameters"]}
    frozen = [f"model={args.model}", "model.finetune=frozen", "trainer.precision=32-true", *overrides]
    started = time.perf_counter()
    run_embed(load_config([*frozen, "cache.views=0"]))
    result["cache_build_seconds_incl_model_build"] = time.perf_counter() - started
    started = time.perf_counter()
    run_embed(load_config(frozen))
    result["cache_read_and_check_seconds"] = time.perf_counter() - started
    result["epoch_seconds_cached"] = epoch_seconds(load_config(frozen), args.epochs)
    print(json.dumps(result), flush=True)  # what is known so far, in case the slower half is stopped
    result["epoch_seconds_images"] = epoch_seconds(load_config([*frozen, "cache.embeddings=false"]), args.epochs)
    if args.cv:
        with tempfile.TemporaryDirectory() as store:
            tracked = [f"mlflow.tracking_uri=sqlite:///{Path(store) / 'mlflow.db'}",
                       f"mlflow.artifact_root={Path(store) / 'art'}", f"cv.work_dir={Path(store) / 'runs'}",
                       "cv.log_models=false", "augment=none"]
            for name, extra in (("cached", []), ("images", ["cache.embeddings=false"])):
                started = time.perf_counter()
                summary = run_cv(load_config([*frozen, *tracked, *extra]))
                result[f"cv_seconds_{name}"] = time.perf_counter() - started
                result[f"cv_metrics_{name}"] = {k: v for k, v in summary.items() if k.startswith("cv/video_auroc")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
