"""Every fold metric of a tiny seeded cross-validation, as JSON: the check that a refactoring changed no number.

Runs the test suite's tiny twin (tests/conftest.py) through `run_cv` with two folds of MobileViT-XXS at 32-true, then
writes {"fold <k>": {metric: last value}} for every child run. `--variant` trains another kind of model on the same
folds: `frame` (the default: a frame model, its crops' scores aggregated per video), `two_stage` (a GRU head on the
fold's frame model's embeddings, `model.head.name=gru`), `frozen` (a linear probe on a frozen backbone's cached
embeddings, `model.finetune=frozen`), `end_to_end` (a GRU clip model trained through its backbone). `--final` also
trains `make final`'s model from that CV and records its threshold and validation metrics; `--tune` also runs a
two-trial search of fold 0 (`make tune`) and records each trial's value. Compare two such files with --compare.

Run:
    .venv/bin/python scripts/cv_metrics.py --variant two_stage --out before.json      # on one commit
    .venv/bin/python scripts/cv_metrics.py --variant two_stage --out after.json       # on another
    .venv/bin/python scripts/cv_metrics.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAST = ("data.synthetic.preset=tiny", "model=mobilevit_xxs", "model.img_size=32", "loader.batch_size=8",
        "trainer.max_epochs=3", "trainer.patience=1", "trainer.folds=[0,1]", "augment=light", "seed=7")
# clips of the tiny twin's three crops; a small head, a few epochs
CLIP = ("loader.clip_frames=3", "model.head.name=gru", "model.head.hidden=16", "model.head.epochs=5",
        "model.head.patience=2")
VARIANTS = {
    "frame": (),
    "two_stage": CLIP,
    "frozen": ("model.finetune=frozen",),
    "end_to_end": (*CLIP, "model.head.mode=end_to_end", "loader.batch_size=4"),
}
TUNE = ("tune.trials=2", "trainer.folds=[0]", "trainer.monitor=val/loss", "trainer.monitor_mode=min",
        "cv.log_models=false")
TIMING_PREFIXES = ("time/", "perf/")  # wall-clock figures differ run to run; not compared


def fold_metrics(client, experiment_id: str, prefix: str = "") -> dict[str, dict[str, float]]:
    """{"<prefix>fold <k>": metrics} of every fold run of `experiment_id`, {"trial <n>": metrics} of its trial runs."""
    out: dict[str, dict[str, float]] = {}
    for run in client.search_runs([experiment_id]):
        fold = run.data.tags.get("fold")
        if fold is None:
            continue
        trial = run.data.tags.get("painvit.trial")
        name = f"trial {trial}" if trial is not None else f"{prefix}fold {fold}"
        out[name] = {key: value for key, value in sorted(run.data.metrics.items())
                     if not key.startswith(TIMING_PREFIXES)}
    return out


def measure(work: Path, variant: str, final: bool, tune: bool) -> dict[str, dict[str, float]]:
    from mlflow import MlflowClient

    from pipeline.data.prepare import DataSettings, prepare_data
    from pipeline.runs.orchestration.cross_validation import run_cv
    from pipeline.utils.config import load_config
    from tests.conftest import tiny_overrides

    prepare_data(DataSettings.from_config(load_config(tiny_overrides(work))), progress=False)
    cfg = load_config(tiny_overrides(work, *FAST, *VARIANTS[variant]))
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id
    out = fold_metrics(client, experiment)
    if final:
        from pipeline.deployment.final_model import run_final

        done = run_final(cfg)
        out["final"] = {"threshold": float(done["threshold"]),
                        **{k: float(v) for k, v in sorted(done["metrics"].items())}}
    if tune:
        from pipeline.runs.orchestration.tuning import run_tune

        store = work / "tune"
        paths = (f"mlflow.tracking_uri=sqlite:///{store / 'mlflow.db'}", f"mlflow.artifact_root={store / 'art'}",
                 f"cv.work_dir={store / 'runs'}")
        tuned = load_config(tiny_overrides(work, *FAST, *VARIANTS[variant], *TUNE, *paths), groups=("tune=default",))
        run_tune(tuned)
        client = MlflowClient(tuned.mlflow.tracking_uri)
        out.update(fold_metrics(client, client.get_experiment_by_name(tuned.mlflow.experiment).experiment_id,
                                "tuned "))
    return out


def compare(before: dict, after: dict) -> int:
    shared = differ = 0
    for fold in sorted(set(before) | set(after)):
        old, new = before.get(fold, {}), after.get(fold, {})
        for key in sorted(set(old) & set(new)):
            shared += 1
            if old[key] != new[key]:
                differ += 1
                print(f"{fold} {key}: {old[key]!r} -> {new[key]!r}")
        for key in sorted(set(old) - set(new)):
            print(f"{fold} {key}: only before")
        for key in sorted(set(new) - set(old)):
            print(f"{fold} {key}: only after")
    print(f"{shared} shared fold metrics compared, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the fold metrics of a fresh tiny CV here")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="frame", help="what the folds train")
    parser.add_argument("--final", action="store_true", help="also train the final model and record its threshold")
    parser.add_argument("--tune", action="store_true", help="also run a two-trial search and record its trials")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(json.loads(path.read_text()) for path in args.compare))
    if not args.out:
        parser.error("give --out or --compare")
    with tempfile.TemporaryDirectory() as work:
        metrics = measure(Path(work), args.variant, args.final, args.tune)
    args.out.write_text(json.dumps(metrics, indent=1))
    print(f"{sum(len(m) for m in metrics.values())} metrics of {len(metrics)} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
