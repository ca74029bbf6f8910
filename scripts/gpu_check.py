"""`make gpu-check`: what matters about the project on one CUDA GPU, measured within 8 minutes, written as JSON.

For the few minutes a GPU is at hand. Each step runs in a fresh process with a time budget; a step that runs over it
is stopped (its process group killed) and recorded as `timed out`, and the next one starts, so the whole stays within
the sum of the budgets (470 s, under 8 minutes on an H100 / H200 class GPU):

1. `device` (25 s): the GPU torch sees (name, memory, compute capability, driver, CUDA runtime, bf16), and the precision
   and channels-last `trainer.precision=auto` and `trainer.channels_last=auto` pick on it for each backbone;
2. `data` (120 s): the default twin generated and its faces cropped by MTCNN on the GPU (`python -m pipeline data
   preprocess.device=cuda`): crops, seconds;
3. `bench` (140 s): `make bench` on the GPU (`scripts/bench_train.py`) for vit_b16, cvt_13 and mobilevit_s on that
   twin's crops: images/s of the real path (Lightning + PainDataModule) and of a bare PyTorch loop, and their ratio;
4. `fold` (95 s): one ViT-B/16 fold of the default twin (`python -m pipeline cv model=vit_b16 trainer.folds=[0]`):
   seconds, the precision it trained in, its test metrics;
5. `detection` (40 s): face detection on the GPU (MTCNN, `FaceFinder` as `make predict` runs it) and the network, on a
   BioVid-sized clip of the twin (1388 x 1038, 5 frames a second): ms a frame for each stage;
6. `predict` (50 s): `python -m pipeline predict predict.device=cuda` of that clip with the fold's model (a
   random-weight MobileViT-S where the fold did not finish), end to end in a fresh process.

Writes reports/gpu_check/<UTC time>/gpu_check.json (`--out`), each step's log beside it. Without CUDA it says so in one
line and exits 0. `--device cpu --tiny` runs every step on the CPU at test sizes (tests/test_gpu_check.py): what it
proves is the plumbing and the JSON's fields, not a GPU's figures. Extra `key=value` overrides go to every project
command (data, bench, fold, predict).

Run:
    make gpu-check                                      # = .venv/bin/python scripts/gpu_check.py
    .venv/bin/python scripts/gpu_check.py --steps device,bench
    .venv/bin/python scripts/gpu_check.py --device cpu --tiny --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
BACKBONES = ("vit_b16", "cvt_13", "mobilevit_s")
TINY_MODEL = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false")


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: float
    needs: tuple[str, ...] = ()  # steps that must have succeeded first


# Budgets (s), 470 in all: what each needs on an H100 / H200 class GPU with 16 cores is a guess (never measured yet),
# with room for a process's imports (8-10 s each); the data step writes 600 videos of the default twin and crops 8
# frames of each, the fold trains ViT-B/16 at the twin's 48 px for at most 5 epochs.
STEPS = (Step("device", 25), Step("data", 120), Step("bench", 140), Step("fold", 95, ("data",)),
         Step("detection", 40), Step("predict", 50))


@dataclass
class Outcome:
    """A step's record in the JSON: `ok`, `failed` (exit status, last line), `timed out` or `skipped`."""

    status: str
    seconds: float = 0.0
    budget_s: float = 0.0
    command: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def run_bounded(command: list[str], timeout_s: float, log: Path) -> tuple[int | None, float]:
    """`command` in a session of its own, its output into `log`; killed with its children after `timeout_s`.
    (exit status or None when it ran over, seconds)."""
    started = time.monotonic()
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
        try:
            code: int | None = process.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            code = None
            for sent in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sent)
                try:
                    process.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return code, time.monotonic() - started


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


class Check:
    """The steps of one check: where they write, the overrides every project command gets, and what each found."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out, self.device = args, out, args.device
        self.outcomes: dict[str, Outcome] = {}
        self.python = sys.executable
        self.common = [f"data.root={out / 'data' / 'raw'}", f"data.processed_dir={out / 'data' / 'processed'}",
                       f"data.manifest_dir={out / 'data' / 'manifests'}", f"mlflow.tracking_uri=sqlite:///"
                       f"{out / 'mlflow.db'}", f"mlflow.artifact_root={out / 'mlartifacts'}",
                       f"reports_dir={out / 'reports'}", f"cv.work_dir={out / 'runs'}",
                       f"preprocess.device={self.device}", f"trainer.accelerator={'gpu' if self.gpu else 'cpu'}",
                       *(["data.synthetic.preset=tiny", "preprocess.frames_per_video=3", "preprocess.crop_size=64",
                          "data.loader.frames_per_video=null", "data.loader.from_s=null"] if args.tiny else []),
                       *args.overrides]

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def config(self):
        """The configuration the project's commands of this check compose (where their data and store are)."""
        from pipeline.utils.config import load_config

        return load_config(self.common)

    def own_step(self, name: str) -> list[str]:
        """This script in a fresh process, running one of its in-process steps."""
        return [self.python, str(Path(__file__).resolve()), "--run-step", name, "--device", self.device,
                "--out", str(self.out), *(["--tiny"] if self.args.tiny else [])]

    def command(self, name: str) -> list[str]:
        py = [self.python, "-m", "pipeline"]
        if name == "data":
            return [*py, "data", *self.common]
        if name == "bench":
            models = ["--quick", "--steps", "2"] if self.args.tiny else ["--models", ",".join(BACKBONES)]
            return [self.python, "scripts/bench_train.py", *models, "--no-progress", "--out", str(self.out / "bench"),
                    "--work-dir", str(self.out / "bench_work"), *self.common]
        if name == "fold":
            tiny = [*TINY_MODEL, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                    "trainer.precision=32-true"]
            model = tiny if self.args.tiny else ["model=vit_b16"]
            return [*py, "cv", *self.common, *model, "trainer.folds=[0]"]
        if name == "predict":
            source = self.fold_model() or f"--model_uri={self.out / 'random_model'}"
            return [*py, "predict", *self.common, f"predict.device={self.device}", f"--video={self.clip()}", source,
                    f"--out={self.out / 'predict'}"]
        return self.own_step(name)

    def clip(self) -> Path:
        return self.out / "clip.mp4"

    def fold_model(self) -> str | None:
        run = self.outcomes.get("fold")
        return f"--run={run.figures['run_id']}" if run and run.figures.get("run_id") else None

    def run(self, step: Step, deadline: float) -> Outcome:
        missing = [need for need in step.needs if self.outcomes.get(need, Outcome("skipped")).status != "ok"]
        left = deadline - time.monotonic()
        if missing or left < 5:
            return Outcome("skipped", budget_s=step.budget_s,
                           note=f"needs {', '.join(missing)}" if missing else "no time left in the check's budget")
        if step.name == "predict":
            self.prepare_predict()
        command = self.command(step.name)
        log = self.out / f"{step.name}.log"
        code, seconds = run_bounded(command, min(step.budget_s * self.args.budget_scale, left), log)
        outcome = Outcome("ok" if code == 0 else "timed out" if code is None else "failed", round(seconds, 2),
                          step.budget_s * self.args.budget_scale, command)
        if code is None:
            outcome.note = f"stopped after {seconds:.0f} s (budget {outcome.budget_s:g} s); last line: {last_line(log)}"
        elif code != 0:
            outcome.note = f"exit {code}: {last_line(log)}"
        else:
            try:
                outcome.figures = READERS[step.name](self, log)
            except Exception as error:  # noqa: BLE001 - a figure that cannot be read is said, not a crash
                outcome.status, outcome.note = "failed", f"its figures could not be read: {error!r}"
        return outcome

    def prepare_predict(self) -> None:
        """The clip (written by the detection step) and, without the fold's model, a random-weight one."""
        if not self.clip().is_file():
            write_clip(self.clip(), self.args.tiny)
        if not self.fold_model() and not (self.out / "random_model").is_dir():
            save_random_model(self.out / "random_model", self.args.tiny)


def read_device(check: Check, log: Path) -> dict[str, Any]:
    return json.loads((check.out / "device.json").read_text())


def read_data(check: Check, log: Path) -> dict[str, Any]:
    import pandas as pd

    from pipeline.utils.paths import resolve_path

    frames = pd.read_csv(resolve_path(check.config().data.processed_dir) / "frames.csv")
    summary = next((line for line in log.read_text().splitlines() if line.startswith("data ready:")), "")
    return {"crops": len(frames), "summary": summary.removeprefix("data ready: ")}


def read_bench(check: Check, log: Path) -> dict[str, Any]:
    report = json.loads((check.out / "bench" / "bench_train.json").read_text())
    keep = ("lightning_images_per_s", "bare_images_per_s", "ratio", "peak_memory_MB", "parameters_M")
    return {name: {**{key: entry[key] for key in keep},
                   **{key: entry["settings"][key] for key in ("img_size", "batch_size", "precision", "num_workers")}}
            for name, entry in report["models"].items()}


def read_fold(check: Check, log: Path) -> dict[str, Any]:
    from mlflow import MlflowClient

    from pipeline.runs.store import tracking

    client = MlflowClient(tracking.store_uri(check.config().mlflow.tracking_uri))
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()],
                              f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.FOLD_RUN}' and tags.`{tracking.FOLD_TAG}` "
                              f"= '0' and attributes.status = 'FINISHED'")
    if not runs:
        raise ValueError("no finished run of fold 0 in the store")
    run = runs[0]
    keep = ("test/video_auroc", "test/accuracy_at_threshold", "test/threshold")
    return {"run_id": run.info.run_id, "precision": run.data.tags.get(tracking.PRECISION_TAG),
            "channels_last": run.data.tags.get("channels_last"), "device": run.data.tags.get("device"),
            "gpu": run.data.tags.get("gpu"), "train_seconds": (run.info.end_time - run.info.start_time) / 1000,
            **{key: run.data.metrics[key] for key in keep if key in run.data.metrics}}


def read_detection(check: Check, log: Path) -> dict[str, Any]:
    return json.loads((check.out / "detection.json").read_text())


def read_predict(check: Check, log: Path) -> dict[str, Any]:
    import pandas as pd

    table = pd.read_csv(check.out / "predict" / f"{check.clip().name}.csv")
    return {"frames": len(table), "faces": int(table["face_found"].sum()),
            "model": "the fold's" if check.fold_model() else "random weights"}


READERS = {"device": read_device, "data": read_data, "bench": read_bench, "fold": read_fold,
           "detection": read_detection, "predict": read_predict}


def device_step(device: str, out: Path) -> None:
    """The `device` step, in its own process: the device line, the GPU's facts, and what `auto` picks per backbone."""
    import torch

    from pipeline.models.backbone_adapter import family_traits
    from pipeline.models.backbones import model_family
    from pipeline.runs.store import tracking
    from pipeline.utils.accelerator import training_device
    from pipeline.utils.config import load_config
    from pipeline.utils.devices import device_settings

    training = training_device("gpu" if device == "cuda" else "cpu")
    print(training.line, flush=True)
    facts: dict[str, Any] = {"line": training.line, **tracking.training_device_tags(training),
                             "torch": torch.__version__}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts |= {"memory_gib": round(properties.total_memory / 2**30, 1),
                  "compute_capability": f"{properties.major}.{properties.minor}",
                  "bf16": torch.cuda.is_bf16_supported(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    facts["backbones"] = {}
    for name in BACKBONES:
        cfg = load_config([f"model={name}"])
        settings = device_settings(str(cfg.trainer.precision), cfg.trainer.channels_last,
                                   family_traits(model_family(name, cfg.model.img_size)), device)
        facts["backbones"][name] = {"img_size": cfg.model.img_size, **tracking.device_settings_tags(settings)}
        print(f"{name}: {settings.line}", flush=True)
    (out / "device.json").write_text(json.dumps(facts, indent=2) + "\n")


def write_clip(path: Path, tiny: bool) -> None:
    """One PA4 clip of the twin's first subject: BioVid's size (1388 x 1038, 5.5 s at 25 fps), or the tiny twin's."""
    from dataclasses import replace

    from pipeline.data.synthetic import PRESETS, make_samples, make_subjects
    from pipeline.data.synthetic.videos import write_video

    config = replace(PRESETS["tiny" if tiny else "full"], n_subjects=1, samples_per_class=1)
    subjects = make_subjects(config)
    sample = next(s for s in make_samples(config, subjects) if "PA4" in s.sample_name)
    write_video(path, config, subjects[0], sample)


def save_random_model(path: Path, tiny: bool) -> Path:
    """A random-weight model saved as the MLflow model `make final` logs (MobileViT-S at its twin size; the tiny
    MobileViT-XXS with --tiny): what `predict` and `detection` score with where the fold's model is not at hand."""
    import mlflow
    import torch

    from pipeline.models.factory import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.runs.serving.mlflow_model import CODE_FILE, WEIGHTS_ARTIFACT, model_config, signature
    from pipeline.runs.store import tracking
    from pipeline.utils.config import load_config

    cfg = load_config(list(TINY_MODEL) if tiny else ["model=mobilevit_s"])
    torch.manual_seed(0)
    net, source = create_model(cfg.model.name, n_classes=2, pretrained=False, img_size=cfg.model.img_size)
    meta = model_meta(net, model_name=cfg.model.name, img_size=cfg.model.img_size, class_names=["BL1", "PA4"],
                      task="bl1_vs_pa4", loader=dict(cfg.loader), weights=tracking.weights_tags(source))
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = save_model_file(net, meta, path.parent / f"{path.name}.pt")
    mlflow.pyfunc.save_model(str(path), python_model=str(CODE_FILE), artifacts={WEIGHTS_ARTIFACT: str(weights)},
                             model_config=model_config(cfg, ["BL1", "PA4"], 0.5, "fixed"), signature=signature())
    return path


def detection_step(device: str, out: Path, tiny: bool) -> None:
    """The `detection` step, in its own process: the clip's frames at 5 a second through `FrameScorer` on `device`
    (MTCNN with its retries, the crop, the network; BlazeFace runs on the CPU where MTCNN finds no face), once to
    warm up and once timed."""
    import torch

    from pipeline.deployment.video_frames import sampled_frames
    from pipeline.models.scoring import Timings
    from pipeline.runs.serving.mlflow_model import load_scorer

    write_clip(out / "clip.mp4", tiny)
    model = save_random_model(out / "random_model", tiny)
    scorer = load_scorer(str(model), device=device)
    frames = [frame for _, _, chunk in sampled_frames(out / "clip.mp4", 5) for frame in chunk]
    scorer.score(frames)
    scorer.timings = Timings()  # the warm-up call left out of the figures
    if device == "cuda":
        torch.cuda.synchronize()
    table = scorer.score(frames)
    height, width = frames[0].shape[:2]
    figures = {"frames": len(frames), "frame_size": f"{width} x {height}", "faces": int(table.face_found.sum()),
               **{f"{key.removesuffix('_s')}_ms_per_frame": round(1000 * value, 2)
                  for key, value in scorer.timings.per_frame().items()}}
    print(json.dumps(figures), flush=True)
    (out / "detection.json").write_text(json.dumps(figures, indent=2) + "\n")


def no_cuda_line() -> str | None:
    """The one line that says why there is no GPU check here, or None when torch sees a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return None
    from pipeline.utils.accelerator import why_no_gpu

    return f"gpu-check: no CUDA GPU here ({why_no_gpu()}); nothing measured, run it on a machine with one"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every project command")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda if torch sees a GPU, else the one line and exit 0")
    parser.add_argument("--tiny", action="store_true", help="test sizes (tiny twin, MobileViT-XXS at 32 px, 1 epoch)")
    parser.add_argument("--steps", default=",".join(step.name for step in STEPS), help="steps to run, in order")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="every step's budget times this")
    parser.add_argument("--out", type=Path, default=None, help="default reports/gpu_check/<UTC time>")
    parser.add_argument("--run-step", choices=("device", "detection"), help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    unknown = set(args.steps.split(",")) - {step.name for step in STEPS}
    if unknown:
        parser.error(f"unknown steps: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_step:  # one in-process step, in the fresh process the check started for it
        (device_step(args.device, args.out) if args.run_step == "device"
         else detection_step(args.device, args.out, args.tiny))
        return 0
    if args.device in ("auto", "cuda"):
        line = no_cuda_line()
        if line is not None:
            print(line)
            return 0
        args.device = "cuda"
    from pipeline.utils.permissions import private_umask

    private_umask()  # the store and the data are made as every command makes them: this user's alone
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = (args.out or PROJECT_ROOT / "reports" / "gpu_check" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(args, out)
    chosen = [step for step in STEPS if step.name in args.steps.split(",")]
    budget_s = sum(step.budget_s for step in chosen) * args.budget_scale
    print(f"gpu-check on {args.device}{' (tiny)' if args.tiny else ''}: {', '.join(s.name for s in chosen)} within "
          f"{budget_s:.0f} s; logs and gpu_check.json in {out}", flush=True)
    started = time.monotonic()
    for step in chosen:
        outcome = check.run(step, started + budget_s)
        check.outcomes[step.name] = outcome
        shown = json.dumps(outcome.figures)[:400] if outcome.status == "ok" else outcome.note
        print(f"  {step.name}: {outcome.status} in {outcome.seconds:.1f} s of {outcome.budget_s:g}: {shown}",
              flush=True)
    report = {"when_utc": stamp, "device": args.device, "tiny": args.tiny, "budget_s": budget_s,
              "seconds": round(time.monotonic() - started, 2), "load_average": os.getloadavg(),
              "steps": {name: vars(outcome) for name, outcome in check.outcomes.items()}}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    failed = [name for name, outcome in check.outcomes.items() if outcome.status != "ok"]
    print(f"gpu-check: {len(chosen) - len(failed)} of {len(chosen)} steps ok in {report['seconds']:.0f} s"
          f"{'; not ok: ' + ', '.join(failed) if failed else ''}; {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
