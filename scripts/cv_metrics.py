"""Every fold metric of a tiny seeded cross-validation, as JSON: the check that a refactoring changed no number.

Runs the test suite's tiny twin (tests/conftest.py) through `run_cv` with two folds of MobileViT-XXS at 32-true, then
writes {"fold <k>": {metric: last value}} for every child run. Compare two such files with --compare.

Run:
    .venv/bin/python scripts/cv_metrics.py --out before.json      # on one commit
    .venv/bin/python scripts/cv_metrics.py --out after.json       # on another
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
TIMING_PREFIXES = ("time/", "perf/")  # wall-clock figures differ run to run; not compared


def fold_metrics(work: Path) -> dict[str, dict[str, float]]:
    from mlflow import MlflowClient

    from pipeline.data.prepare import prepare_data
    from pipeline.runs.cross_validation import run_cv
    from pipeline.utils.config import load_config
    from tests.conftest import tiny_overrides

    prepare_data(load_config(tiny_overrides(work)), progress=False)
    cfg = load_config(tiny_overrides(work, *FAST))
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    out: dict[str, dict[str, float]] = {}
    for run in client.search_runs([experiment.experiment_id]):
        fold = run.data.tags.get("fold")
        if fold is None:
            continue
        out[f"fold {fold}"] = {key: value for key, value in sorted(run.data.metrics.items())
                               if not key.startswith(TIMING_PREFIXES)}
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
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(json.loads(path.read_text()) for path in args.compare))
    if not args.out:
        parser.error("give --out or --compare")
    with tempfile.TemporaryDirectory() as work:
        metrics = fold_metrics(Path(work))
    args.out.write_text(json.dumps(metrics, indent=1))
    print(f"{sum(len(m) for m in metrics.values())} metrics of {len(metrics)} folds -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
