"""Which threshold rule to use, from real folds: cheap cross-validations on the twins at 2 and at 10-12 validation
subjects a fold, every rule of `eval.threshold` recomputed on each fold's own validation and test videos, and the
regret table with Monte-Carlo intervals (pipeline/analysis/threshold_regret.py says what regret is).

The folds are the project's own path at its cheapest: truth crops (no video, no detector), a frozen backbone's
embedding cache, probes fitted in memory. Each arm below is one twin and one kind of fold file, run for every binary
task (BL1 vs PA1..PA4) and every fold-file seed:

- `synthetic87`, 2 validation subjects: the calibrated BioVid-scale twin (87 people x 5 classes x 20 clips), kfold5
  fold files written with val_fraction 0.03 (2 of a fold's 69-70 non-test people), seeds 0..n-1;
- `synthetic87`, 10 validation subjects: BioVid's committed kfold5 file (seed 0) and kfold5 files of seeds 1..n-1
  written alike (val_fraction 0.15);
- `synthetic87`, 12 validation subjects: BioVid's committed kfold10 file;
- `synthetic`, 2 validation subjects: the default twin (20 people x 5 x 6 clips, the default CVs' data, truth
  crops) with its own kfold5 files of seeds 0..n-1.

Every CV lands in a store of its own (`--store`, experiment pain-thresholds); a killed study resumes where it stopped
(a finished CV is not run again). Then every finished binary CV in the store is read, each rule is chosen on every
fold's validation videos and scored on its test videos, and the table (per twin, number of validation subjects and
rule: mean regret with its 95 % interval, worst fold, 90th percentile, paired difference to the best rule) is printed
and written with the per-fold rows and a PNG.

    .venv/bin/python scripts/threshold_regret.py --weights data/pretrained/resnet10t_identity_synthetic1_64px.pt \\
        [--seeds 6] [--arms synthetic87_val2 synthetic87_val10 synthetic87_val12 synthetic_val2] [--store DIR]
    .venv/bin/python scripts/threshold_regret.py --analyse-only [--store DIR] [--also DIR ...]  # what stores hold
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlflow import MlflowClient  # noqa: E402

from pipeline.analysis.threshold_regret import one_run_per_fold, regret_rows, regret_table  # noqa: E402
from pipeline.runs.orchestration.cross_validation import run_cv  # noqa: E402
from pipeline.runs.store import cv_runs  # noqa: E402
from pipeline.utils.atomic_io import atomic_write_csv, save_png  # noqa: E402
from pipeline.utils.config import load_config  # noqa: E402

EXPERIMENT = "pain-thresholds"
TASKS = ("bl1_vs_pa1", "bl1_vs_pa2", "bl1_vs_pa3", "bl1_vs_pa4")
PROBE = ("model=timm", "model.name=resnet10t", "model.img_size=64", "model.finetune=frozen", "model.head.fit=in_memory",
         "cv.log_models=false", "cv.fold_plots=false", "data.synthetic.crops=truth")
ARMS = ("synthetic87_val2", "synthetic87_val10", "synthetic87_val12", "synthetic_val2")
GROUPS = ("dataset", "validation_subjects")


def arm_overrides(arm: str, seed: int, store: Path) -> list[str] | None:
    """The overrides of one arm's fold file of `seed` (None: the arm has no such seed)."""
    folds = store / "folds" / f"{arm}_seed{seed}"
    if arm == "synthetic87_val2":
        return ["data=synthetic87", f"data.manifest_dir={folds}", "protocol.val_fraction=0.03", f"protocol.seed={seed}"]
    if arm == "synthetic87_val10":  # seed 0: BioVid's committed kfold5 file
        return ["data=synthetic87"] + ([f"data.manifest_dir={folds}", f"protocol.seed={seed}"] if seed else [])
    if arm == "synthetic87_val12":
        return ["data=synthetic87", "protocol=kfold10"] if seed == 0 else None
    if arm == "synthetic_val2":
        twin = ROOT / "data" / "threshold_study"
        return ["data=synthetic", f"data.root={twin / 'raw'}", f"data.processed_dir={twin / 'processed'}",
                f"data.manifest_dir={folds}", f"protocol.seed={seed}"]
    raise SystemExit(f"unknown arm {arm!r}; the arms: {', '.join(ARMS)}")


def run_study(arms: list[str], seeds: int, weights: list[Path], store: Path, tasks: list[str]) -> None:
    """Every arm's CVs, embedder by embedder, task by task and seed by seed, into `store`; each CV's wall time
    printed."""
    common = [*PROBE, f"mlflow.tracking_uri=sqlite:///{store / 'mlflow.db'}", f"mlflow.experiment={EXPERIMENT}",
              f"mlflow.artifact_root={store / 'mlartifacts'}", f"cv.work_dir={store / 'runs'}"]
    plan = [(arm, seed, task, [f"model.weights={start.resolve()}", *overrides]) for arm in arms for start in weights
            for seed in range(seeds) if (overrides := arm_overrides(arm, seed, store)) is not None for task in tasks]
    for index, (arm, seed, task, overrides) in enumerate(plan, start=1):
        started = time.monotonic()
        what = f"[{index}/{len(plan)}] {arm} seed {seed} {task} {Path(overrides[0]).name}"
        print(f"== {what}", flush=True)
        run_cv(load_config([*common, *overrides, f"task={task}"]))
        print(f"== {what}: {time.monotonic() - started:.0f} s", flush=True)


def finished_cvs(store: Path) -> list[str]:
    """The parent run ids of every finished CV in the study's store."""
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        raise SystemExit(f"{store / 'mlflow.db'}: no experiment {EXPERIMENT!r}: run the study first")
    runs = cv_runs.search_all(client, [experiment.experiment_id], f"{cv_runs.CV_QUERY} and {cv_runs.FINISHED_QUERY}")
    return [run.info.run_id for run in runs]


def plot(table: pd.DataFrame, path: Path) -> Path:
    """Mean regret with its interval, per rule, one panel per twin and number of validation subjects."""
    from matplotlib.figure import Figure

    groups = list(table.groupby(list(GROUPS), sort=True))
    figure = Figure(figsize=(4.2 * len(groups), 3.8))
    axes = np.atleast_1d(figure.subplots(1, len(groups), sharey=True))
    for axis, ((dataset, n_val), part) in zip(axes, groups, strict=True):
        part = part.sort_values("rule")
        errors = [part["regret"] - part["regret_low"], part["regret_high"] - part["regret"]]
        axis.errorbar(part["rule"], part["regret"], yerr=errors, fmt="o", capsize=3)
        axis.scatter(part["rule"], part["worst"], marker="x", color="tab:red", label="worst fold")
        axis.set_title(f"{dataset}, {n_val} validation subjects ({int(part['folds'].iloc[0])} folds)", fontsize=9)
        axis.tick_params(axis="x", labelrotation=45, labelsize=7)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("regret: best cut's bal. acc. - the rule's (points)")
    axes[-1].legend(fontsize=7)
    figure.suptitle("Threshold rules on real folds (mean, 95 % cluster-bootstrap interval, worst fold)", fontsize=10)
    save_png(figure, path)
    return path


def store_rows(stores: list[Path]) -> tuple[pd.DataFrame, int, int]:
    """Every rule on every usable fold of every finished CV in these stores, the number of CVs and of folds left
    out."""
    frames, cvs, skipped = [], 0, 0
    for store in stores:
        parents = finished_cvs(store)
        rows, left_out = regret_rows(MlflowClient(f"sqlite:///{store / 'mlflow.db'}"), parents)
        frames.append(rows)
        cvs, skipped = cvs + len(parents), skipped + left_out
    return pd.concat(frames, ignore_index=True), cvs, skipped


def analyse(stores: list[Path], out: Path, resamples: int) -> pd.DataFrame:
    """The regret table of every finished CV in `stores`, written to `out` and printed."""
    rows, cvs, skipped = store_rows(stores)
    rows, twice = one_run_per_fold(rows)  # the stores list the newest CV first: it keeps a fold trained twice
    table = regret_table(rows, GROUPS, resamples=resamples, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out / "threshold_regret_folds.csv", rows)
    atomic_write_csv(out / "threshold_regret.csv", table)
    png = plot(table, out / "threshold_regret.png")
    described = rows.groupby([*GROUPS, "model"]).agg(cvs=("cv_run", "nunique"), folds=("split", "size"),
                                                     tasks=("task", "nunique"), splits=("split", "nunique"),
                                                     auroc=("video_auroc", "mean"))
    described["folds"] //= rows["rule"].nunique()
    print(f"{cvs} finished CVs, {skipped} fold(s) left out (multiclass or one class among the test videos), {twice} "
          f"fold(s) trained twice counted once (the newest CV's)")
    print(described.to_string(float_format=lambda v: f"{v:.3f}"))
    print("\nregret in balanced-accuracy points (best cut on the test videos minus the rule's), 95 % interval over "
          f"splits ({resamples} resamples), worst fold, 90th percentile, difference to the group's best rule:")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"\n{out / 'threshold_regret.csv'}\n{png}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, nargs="+", default=[],
                        help="the frozen backbone's weights, one embedder each (make pretrain's resnet10t)")
    parser.add_argument("--seeds", type=int, default=6, help="fold-file seeds per arm")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="in this order")
    parser.add_argument("--store", type=Path, default=ROOT / "data" / "threshold_study" / "store")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "threshold_regret")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the splits")
    parser.add_argument("--analyse-only", action="store_true", help="only the table of what the store holds")
    parser.add_argument("--also", type=Path, nargs="+", default=[],
                        help="more study stores whose CVs join the table (another embedder's, another twin's)")
    args = parser.parse_args(argv)
    args.store = args.store.resolve()
    args.store.mkdir(parents=True, exist_ok=True)
    if not args.analyse_only:
        missing = [path for path in args.weights if not path.is_file()] or ([] if args.weights else ["(none)"])
        if missing:
            raise SystemExit(f"--weights {missing[0]}: not a file (`make pretrain MODEL=resnet10t DATA=synthetic87 "
                             f"ARGS=\"model.img_size=64\"` writes data/pretrained/"
                             f"resnet10t_identity_synthetic1_64px.pt)")
        run_study(args.arms, args.seeds, args.weights, args.store, args.tasks)
    analyse([args.store, *(store.resolve() for store in args.also)], args.out, args.resamples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
