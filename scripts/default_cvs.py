"""The README's table of the three default CVs on the twin: `make data`, then `make cv MODEL=<m>` for each default
backbone, then `make compare`, each timed (wall and CPU seconds, the load average before and after), with each CV's
video AUROC (mean and sd over folds, pooled), its pooled accuracy at the threshold with the subject-bootstrap
interval and each fold's epochs and seconds, read back from the CV's parent run. Prints the table in the README's form
with the CPU named, and writes everything to reports/bench/default_cvs.json.

Run it from a fresh clone on a quiet machine (the first `make data` draws and crops the twin; it is timed apart):
    .venv/bin/python scripts/default_cvs.py
A variant of the settings, into a store of its own so the project's runs stay as they are:
    .venv/bin/python scripts/default_cvs.py --store /tmp/variant --args "data.loader.frames_per_video=3"
    .venv/bin/python scripts/default_cvs.py --store /tmp/mvit8 --models mobilevit_s --args "trainer.max_epochs=8"
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.runs.store import tracking  # noqa: E402
from pipeline.utils.devices import cpu_description  # noqa: E402

DEFAULT_MODELS = ("vit_b16", "cvt_13", "mobilevit_s")
MAKE = ["make", "--no-print-directory"]


def timed(command: list[str], env: dict[str, str]) -> dict:
    """Run `command` in the checkout, its output passed through; wall and CPU seconds, the load before and after."""
    load_before, started = os.getloadavg()[0], time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, cwd=ROOT, env=env)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed with exit status {result.returncode}")
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return {"command": shlex.join(command), "wall_s": round(time.perf_counter() - started, 1), "cpu_s": round(cpu, 1),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


def cv_figures(uri: str, model: str) -> dict:
    """The newest finished CV parent of `model` in the store: its headline figures and its folds' epochs and times."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
    query = f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.CV_RUN}' and tags.model = '{model}'"
    parent = client.search_runs([experiment.experiment_id], query, order_by=["attribute.start_time DESC"],
                                max_results=1)[0]
    metrics = parent.data.metrics
    folds = sorted(tracking.finished_fold_runs(client, parent.info.run_id).items())
    return {"run_id": parent.info.run_id, "run_name": parent.info.run_name,
            **{name: metrics.get(name) for name in (
                "cv/video_auroc_mean", "cv/video_auroc_std", "pooled/video_auroc",
                "pooled/video_accuracy_at_threshold", "pooled/video_accuracy_at_threshold_ci95_low",
                "pooled/video_accuracy_at_threshold_ci95_high")},
            "fold_epochs": [run.data.metrics.get("epochs_trained") for _, run in folds],
            "fold_seconds": [round((run.info.end_time - run.info.start_time) / 1000, 1) for _, run in folds]}


def table(rows: list[dict]) -> str:
    lines = ["| backbone | video AUROC, mean ± sd over 5 folds | pooled video AUROC | accuracy at the threshold, "
             "pooled (95 % CI) | `make cv` wall time | load (before, after) |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row['model']}` | {row['cv/video_auroc_mean']:.3f} ± {row['cv/video_auroc_std']:.3f} | "
                     f"{row['pooled/video_auroc']:.3f} | {row['pooled/video_accuracy_at_threshold']:.3f} "
                     f"({row['pooled/video_accuracy_at_threshold_ci95_low']:.3f}-"
                     f"{row['pooled/video_accuracy_at_threshold_ci95_high']:.3f}) | {row['wall_s'] / 60:.1f} min | "
                     f"{row['load_before']}, {row['load_after']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--args", default="", help="ARGS= for every make cv (key=value words)")
    parser.add_argument("--store", type=Path, default=None,
                        help="a folder for the store, artifacts, checkpoints and reports (default: the project's)")
    parser.add_argument("--no-compare", action="store_true", help="leave out make compare")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "default_cvs.json")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    words = args.args
    uri = tracking.tracking_uri(ROOT)
    if args.store is not None:
        store = args.store.resolve()
        store.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{store / 'mlflow.db'}"
        words = (f"mlflow.tracking_uri={uri} mlflow.artifact_root={store / 'mlartifacts'} cv.work_dir={store / 'runs'} "
                 f"reports_dir={store / 'reports'} {words}")
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    report: dict = {"cpu": cpu_description(), "args": args.args, "data": timed([*MAKE, "data"], env), "cvs": []}
    for model in args.models:
        run = timed([*MAKE, "cv", f"MODEL={model}", "RESUME=never", f"ARGS={words}"], env)
        report["cvs"].append({"model": model, **run, **cv_figures(uri, model)})
        print(json.dumps(report["cvs"][-1]), flush=True)
    if not args.no_compare and len(args.models) > 1:
        report["compare"] = timed([*MAKE, "compare", f"ARGS={words}"], env)
    print(f"CPU: {report['cpu']}\n{table(report['cvs'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
