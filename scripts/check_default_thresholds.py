"""Issue 43's check of the default CVs' decision thresholds, read from an MLflow store.

For the newest finished CV of each default backbone (`make cv MODEL=vit_b16|cvt_13|mobilevit_s`: the default twin,
kfold5, BL1 vs PA4, 2 validation subjects a fold), or the parent runs given with --run, prints per fold: the test video
AUROC, the rule the fold ran with, its threshold and balanced accuracy as logged, and the balanced accuracy at every
rule's threshold recomputed on the fold's validation videos (pipeline/analysis/threshold_regret.py); then each rule's
mean regret over these folds, and the check: no fold with video AUROC >= 0.85 under balanced accuracy 0.65 at the
rule's threshold, for the configured default (`eval.threshold` in configs/config.yaml) unless --rule names another.
Writes the per-fold table to <out>/default_cv_folds.csv. Exit status 1 when a fold fails the check, 2 when a backbone
has no finished CV (or the store no such experiment).

    make check-thresholds                        # the three default CVs in the project's store, at eval.threshold
    make check-thresholds RULE=youden RUN=<id>   # another rule, one CV of your own
    .venv/bin/python scripts/check_default_thresholds.py [--store URI] [--experiment NAME] \\
        [--models vit_b16 cvt_13 mobilevit_s] [--run <parent run id> ...] [--rule youden] [--out DIR]

--store: a tracking URI (default: the project's, as `make cv` writes it: $MLFLOW_TRACKING_URI, else
sqlite:///<project>/mlflow.db); --experiment: default configs' mlflow.experiment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlflow import MlflowClient  # noqa: E402

from pipeline.analysis.threshold_regret import failing_folds, regret_rows, rule_label  # noqa: E402
from pipeline.evaluation.thresholds import parse_rule  # noqa: E402
from pipeline.runs.store import cv_runs, tracking  # noqa: E402
from pipeline.utils.atomic_io import atomic_write_csv  # noqa: E402
from pipeline.utils.config import load_config  # noqa: E402

DEFAULT_MODELS = ("vit_b16", "cvt_13", "mobilevit_s")
AUROC_FLOOR = 0.85  # a fold that ranks this well ...
ACCURACY_FLOOR = 0.65  # ... must not be called at a threshold that leaves it under this balanced accuracy


def default_cvs(client: MlflowClient, experiment: str, models: list[str]) -> dict[str, str]:
    """Backbone label -> the parent run id of its newest finished default CV (synthetic, kfold5, bl1_vs_pa4)."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        print(f"no experiment {experiment!r} in this store: no default CV ran here (`make cv MODEL=<backbone>` first)",
              file=sys.stderr)
        raise SystemExit(2)
    latest = cv_runs.latest_finished_cvs(client, [found.experiment_id], "synthetic", "kfold5", "bl1_vs_pa4")
    missing = [model for model in models if model not in latest]
    if missing:
        print(f"no finished default CV of {', '.join(missing)} (found: {', '.join(latest) or 'none'}); run "
              f"`make cv MODEL=<backbone>` first", file=sys.stderr)
        raise SystemExit(2)
    return {model: latest[model].info.run_id for model in models}


def as_run(client: MlflowClient, fold_runs: pd.Series) -> pd.DataFrame:
    """Each fold run's own decision as logged: its rule, threshold and test balanced accuracy at it."""
    rows = []
    for run_id in fold_runs.unique():
        run = client.get_run(run_id)
        rows.append({"fold_run": run_id, "rule_as_run": run.data.params.get("threshold_rule", ""),
                     "threshold_as_run": run.data.metrics.get("test/threshold", float("nan")),
                     "balanced_accuracy_as_run": run.data.metrics.get(
                         "test/video_balanced_accuracy_at_threshold", float("nan"))})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=None, help="tracking URI (default: the project's, as make cv uses)")
    parser.add_argument("--experiment", default=None, help="the CVs' experiment (default: configs' mlflow.experiment)")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--run", action="append", default=[], help="a CV's parent run id instead (repeatable)")
    parser.add_argument("--rule", default=None, help="the rule checked (default: configs' eval.threshold)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "threshold_regret")
    args = parser.parse_args(argv)
    configured = load_config([])
    rule = rule_label(parse_rule(args.rule if args.rule is not None else configured.eval.threshold))
    experiment = args.experiment if args.experiment is not None else configured.mlflow.experiment
    client = MlflowClient(tracking.store_uri(args.store))
    parents = ({run_id: run_id for run_id in args.run} if args.run else
               default_cvs(client, experiment, args.models))
    rows, skipped = regret_rows(client, parents.values())
    if rows.empty:
        raise SystemExit("no binary fold to check in these CVs")
    rows = rows.merge(as_run(client, rows["fold_run"]), on="fold_run")
    label = {run_id: model for model, run_id in parents.items()}
    rows["cv"] = rows["cv_run"].map(label)
    wide = rows.pivot_table(index=["cv", "fold", "validation_subjects", "video_auroc", "rule_as_run",
                                   "threshold_as_run", "balanced_accuracy_as_run"],
                            columns="rule", values="balanced_accuracy").reset_index()
    pd.set_option("display.width", 250)
    print(f"balanced accuracy on each fold's test videos at each rule's threshold ({skipped} fold(s) left out):")
    print(wide.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    thresholds = rows.pivot_table(index=["cv", "fold"], columns="rule", values="threshold")
    print("\neach rule's threshold:")
    print(thresholds.to_string(float_format=lambda v: f"{v:.3f}"))
    regret = rows.groupby("rule")["regret"].agg(["mean", "max"]).mul(100).sort_values("mean")
    print("\nregret over these folds (points): mean, worst")
    print(regret.to_string(float_format=lambda v: f"{v:.2f}"))
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(args.out / "default_cv_folds.csv", rows)
    failing = failing_folds(rows, rule, AUROC_FLOOR, ACCURACY_FLOOR)
    verdict = "FAILS" if len(failing) else "passes"
    print(f"\ncheck ({rule}): no fold with video AUROC >= {AUROC_FLOOR} under balanced accuracy {ACCURACY_FLOOR} at "
          f"its threshold: {verdict} ({len(failing)} of {rows['fold_run'].nunique()} folds)")
    if len(failing):
        print(failing[["cv", "fold", "video_auroc", "threshold", "balanced_accuracy"]].to_string(index=False))
    return 1 if len(failing) else 0


if __name__ == "__main__":
    raise SystemExit(main())
