"""Calibrate the BioVid-scale twin against the published reference curve: the share of a responder's clips that show
a response, per pain class, that makes `make fidelity`'s reference method (the same instrument, the same seeds) reach
the published binary figures. Five classes are held out: never used in the search, measured once at the end.

Why one knob a task: a binary task BL1 vs PAk sees only BL1 and PAk clips, and BL1 clips do not depend on the share
of PAk (`response_probability[k]`), so each task has its own knob and its figure rises with it (a larger share turns
more of the same clips into responding ones: one uniform draw per clip decides). Every other generator setting stays
as the preset has it (class intensities, expressiveness spread, trial variability, the 20 non-responders, the temporal
cue, the person baseline) and so does the reference's tracker error, chosen beforehand (configs/fidelity/): the knob
that BioVid's own analysis names (facial responses are rare near the pain threshold and grow with the stimulus) is
the one fitted.

The search, per task: bisection of the share on a cheap stand-in of LOSO (`--proxy-folds` subject-grouped folds),
then LOSO itself and secant steps on it (`--loso-rounds`), each step's slope taken from the stand-in's evaluations.
It prints each evaluation, the shares found, and the LOSO curve with five classes; the shares are then written into
PRESETS["biovid87"] (pipeline/data/synthetic/settings.py) by hand, and `make fidelity DATA=synthetic87` checks them.

    .venv/bin/python scripts/calibrate_twin.py [--proxy-folds 5] [--steps 7] [--loso-rounds 2] [key=value ...]
    .venv/bin/python scripts/calibrate_twin.py --check --seeds 0 1000 1001 --noise-scales 0.5 1 2

`--check` searches nothing: it prints the committed preset's binary curve on the stand-in folds for other draws of
the twin (`--seeds`: make power's twins start at 1000) and other tracker errors (`--noise-scales` times the
configured sds): how much the calibration depends on the draw and on the assumed tracker.

Key=value overrides compose the config as `make fidelity` does (data=synthetic87 is the default here), e.g.
`data.synthetic.seed=1` to calibrate on another draw of the twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from pipeline.analysis.fidelity import BINARY_TASKS, published_targets, reference_accuracies, reference_settings
from pipeline.analysis.results_table import read_literature
from pipeline.data.prepare import synthetic_config
from pipeline.data.synthetic.settings import SyntheticConfig
from pipeline.data.synthetic.traces import clip_traces
from pipeline.utils.config import load_config
from pipeline.utils.logging_setup import setup_logging


def accuracy(config: SyntheticConfig, settings, task: str, folds: int | None) -> float:
    """The reference method's accuracy (%) on `task` of the twin `config`."""
    return float(reference_accuracies(clip_traces(config), settings, [task], folds, progress=False)[task].mean())


def with_share(config: SyntheticConfig, level: int, share: float) -> SyntheticConfig:
    shares = list(config.response_probability or (0.0,) * 5)
    shares[level] = round(float(share), 4)
    return dataclasses.replace(config, response_probability=tuple(shares))


def bisect(config: SyntheticConfig, settings, task: str, level: int, target: float, folds: int,
           steps: int) -> tuple[float, float]:
    """The share of `level` whose stand-in accuracy meets `target`, and the stand-in's slope (points per unit share)
    near it, from a bisection over [0, 1]."""
    low, high, seen = 0.0, 1.0, []
    for _ in range(steps):
        middle = (low + high) / 2
        value = accuracy(with_share(config, level, middle), settings, task, folds)
        seen.append((middle, value))
        print(f"  {task}: share {middle:.4f} -> {value:.2f} % ({folds} grouped folds; target {target})", flush=True)
        low, high = (middle, high) if value < target else (low, middle)
    shares, values = np.array(seen).T
    near = np.abs(shares - (low + high) / 2) <= 0.25
    slope = np.polyfit(shares[near], values[near], 1)[0] if near.sum() >= 2 else 30.0
    return (low + high) / 2, max(float(slope), 5.0)


def check(config: SyntheticConfig, settings, folds: int, seeds: list[int], scales: list[float]) -> None:
    """The binary curve of the preset on `folds` grouped folds, per twin seed and tracker-error scale."""
    print(f"{'seed':>6}{'noise x':>9}" + "".join(f"{task:>12}" for task in BINARY_TASKS), flush=True)
    for seed in seeds:
        traces = clip_traces(dataclasses.replace(config, seed=seed))
        for scale in scales:
            noise = dataclasses.replace(settings.noise, sd=tuple(scale * sd for sd in settings.noise.sd))
            curve = reference_accuracies(traces, dataclasses.replace(settings, noise=noise), BINARY_TASKS, folds,
                                         progress=False)
            print(f"{seed:>6}{scale:>9g}" + "".join(f"{curve[task].mean():>12.1f}" for task in BINARY_TASKS),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxy-folds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--loso-rounds", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.5, help="LOSO points from the target that end a task")
    parser.add_argument("--check", action="store_true", help="no search: the preset's curve per seed and noise")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--noise-scales", type=float, nargs="+", default=[1.0])
    arguments, overrides = parser.parse_known_args()
    setup_logging()
    cfg = load_config(["data=synthetic87", *overrides], groups=("fidelity=default",))
    config, settings = synthetic_config(cfg.data.synthetic), reference_settings(cfg.fidelity.reference)
    if arguments.check:
        check(config, settings, arguments.proxy_folds, arguments.seeds, arguments.noise_scales)
        return
    targets = published_targets(read_literature(), str(cfg.fidelity.published_method), cfg.fidelity.tasks)
    started = time.time()
    slopes = {}
    for level, task in enumerate(BINARY_TASKS, start=1):
        share, slopes[task] = bisect(config, settings, task, level, targets[task]["published"],
                                     arguments.proxy_folds, arguments.steps)
        config = with_share(config, level, share)
    for round_ in range(arguments.loso_rounds + 1):
        misses = {}
        for level, task in enumerate(BINARY_TASKS, start=1):
            value = accuracy(config, settings, task, None)
            print(f"LOSO round {round_}: {task} share {config.response_probability[level]:.4f} -> {value:.2f} % "
                  f"(target {targets[task]['published']})", flush=True)
            if abs(value - targets[task]["published"]) > arguments.tolerance:
                misses[task] = (level, value)
        if not misses or round_ == arguments.loso_rounds:
            break
        for task, (level, value) in misses.items():
            step = (targets[task]["published"] - value) / slopes[task]
            config = with_share(config, level, min(1.0, max(0.0, config.response_probability[level] + step)))
    print(f"calibrated response_probability: {config.response_probability} "
          f"({(time.time() - started) / 60:.1f} min)")
    print("held out, five classes (LOSO):", flush=True)
    five = accuracy(config, settings, "five_class", None)
    print(f"five_class: {five:.2f} % (published {targets['five_class']['published']}, band "
          f"{cfg.fidelity.bands.five_class})")


if __name__ == "__main__":
    main()
