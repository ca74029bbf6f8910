"""Prediction benchmark: how long `make predict` takes on one BioVid-sized clip, and where the time per frame goes.

For each backbone (default vit_b16, cvt_13, mobilevit_s; random weights at the input size of its synthetic config,
`configs/data_model/synthetic_<model>.yaml`) an MLflow model is saved the way `make final` logs it, then:

1. per frame: MTCNN detection (min face 5 % of the shorter side), alignment + crop, and the network, from the scorer's
   own timers over one 5.5 s clip of the synthetic twin at 1388 x 1038, sampled at 5 fps (28 frames);
2. end to end: `python -m pipeline predict --video=<clip> --model_uri=<saved model>` in a fresh process, wall time
   from start to exit, model load included (what `make predict` costs, less make's own start); `--repeats` runs
   (3), each reported, and their median.

Run:
    .venv/bin/python scripts/bench_predict.py                    # all three backbones, this machine's threads
    .venv/bin/python scripts/bench_predict.py --models mobilevit_s --threads 2
    .venv/bin/python scripts/bench_predict.py --models cvt_13 --head transformer   # a clip model's windows
Writes reports/bench/bench_predict.json. Timings on a shared machine are polluted by the other load: the load
average is recorded with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.runs.store import tracking
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT, resolve_path


def render_clip(folder: Path) -> Path:
    """One full-size (1388 x 1038) PA4 clip of the twin's first subject, 5.5 s at 25 fps."""
    from dataclasses import replace

    from pipeline.data.synthetic import PRESETS, make_samples, make_subjects
    from pipeline.data.synthetic.videos import write_video

    config = replace(PRESETS["full"], n_subjects=1, samples_per_class=1)
    subjects = make_subjects(config)
    sample = next(s for s in make_samples(config, subjects) if "PA4" in s.sample_name)
    path = folder / "clip_1388x1038.mp4"
    write_video(path, config, subjects[0], sample)
    return path


def save_model(name: str, folder: Path, head: str = "linear") -> tuple[Path, int]:
    """A random-weight model of backbone `name`, saved as the MLflow model `make final` would log; with a temporal
    `head`, the clip model (`ClipNet`) of that head at the config's sizes and clip length."""
    import mlflow
    from omegaconf import OmegaConf

    from pipeline.models.factory import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.models.temporal_heads import HeadConfig
    from pipeline.runs.serving.mlflow_model import CODE_FILE, WEIGHTS_ARTIFACT, model_config, signature

    cfg = load_config([f"model={name}", f"model.head.name={head}"])
    torch.manual_seed(0)
    config = HeadConfig.from_config(cfg.model.head)
    net, source = create_model(name, n_classes=2, pretrained=False, img_size=cfg.model.img_size, head=config)
    extra = {"head": OmegaConf.to_container(cfg.model.head)} if config.temporal else {}
    meta = model_meta(net, model_name=name, img_size=cfg.model.img_size, class_names=["BL1", "PA4"],
                      task="bl1_vs_pa4", loader=dict(cfg.loader), weights=tracking.weights_tags(source), **extra)
    weights = save_model_file(net, meta, folder / f"{name}.pt")
    path = folder / f"model_{name}"
    mlflow.pyfunc.save_model(str(path), python_model=str(CODE_FILE), artifacts={WEIGHTS_ARTIFACT: str(weights)},
                             model_config=model_config(cfg, ["BL1", "PA4"], 0.5, 0.5), signature=signature())
    return path, int(cfg.model.img_size)


def per_frame(model_dir: Path, clip: Path, fps: float) -> dict[str, Any]:
    from pipeline.deployment.predict import ScorerSource, find_scorer, score_video
    from pipeline.models.scoring import Timings
    from pipeline.utils.config import load_config as compose

    cfg = compose([])
    scorer, _ = find_scorer(ScorerSource.of(cfg.mlflow.tracking_uri, cfg.model.name, cfg.task.name, cfg.predict),
                            model_uri=str(model_dir))
    score_video(scorer, clip, fps)  # warm-up: first calls allocate
    scorer.timings = Timings()  # the warm-up call left out of the figures
    result = score_video(scorer, clip, fps)
    return {**{k: round(v * 1000, 1) for k, v in scorer.timings.per_frame().items()},
            "frames": len(result.frames), "faces": int(result.frames.face_found.sum())}


def end_to_end(model_dir: Path, clip: Path, fps: float, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline", "predict", f"predict.fps={fps:g}", f"--video={clip}",
                    f"--model_uri={model_dir}", f"--out={out}"], cwd=PROJECT_ROOT, check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vit_b16,cvt_13,mobilevit_s")
    parser.add_argument("--head", default="linear",
                        help="model.head.name: linear (a frame model) or a temporal head (a clip model, scored in "
                             "sliding windows of loader.clip_frames crops)")
    parser.add_argument("--fps", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs per model (the median is reported)")
    parser.add_argument("--out", default=str(resolve_path("reports/bench")))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results = {"cpu_threads": torch.get_num_threads(), "load_average": os.getloadavg(), "fps": args.fps,
               "head": args.head,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        clip = render_clip(folder)
        for name in args.models.split(","):
            model_dir, img_size = save_model(name, folder, args.head)
            os.sync()  # the model was just written: its write-back would otherwise slow the first run's reads
            timing = per_frame(model_dir, clip, args.fps)
            runs = [round(end_to_end(model_dir, clip, args.fps, folder / "out"), 2) for _ in range(args.repeats)]
            timing["end_to_end_runs_s"] = runs
            timing["end_to_end_s"] = round(statistics.median(runs), 2)
            timing["img_size"] = img_size
            results["models"][name] = timing
            print(f"{name} ({img_size} px): per frame detection {timing['detect_s']} ms, alignment "
                  f"{timing['align_s']} ms, network {timing['network_s']} ms; faces in {timing['faces']} of "
                  f"{timing['frames']} frames; `predict` end to end {timing['end_to_end_s']} s (median of "
                  f"{', '.join(map(str, runs))})", flush=True)
    results["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_predict.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"load average {results['load_average']} -> {results['load_average_after']}; {out / 'bench_predict.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
