"""`make power`: the error rates of `make compare`'s corrected test, measured on twins whose answer is known.

A comparison that finds nothing on 87 people says either that there is nothing to find or that the instrument cannot
see it. This tells the two apart: it repeats one comparison of two settings over independent BioVid-scale twins
(generator seeds `power.seed`, `power.seed + 1`, ...), each with a planted effect of known size (or none), and counts
how often `make compare`'s test rejects (the primary metric's Holm-adjusted p-value below `power.alpha`):

- on the null twin (`EFFECT=null`: the classes look alike) the rejection rate is the test's type-I error;
- on a twin with an effect (`EFFECT=temporal`: a stimulus-locked burst that only a temporal head can place) it is the
  test's power at BioVid's scale, beside the planted size and the mean minimum detectable effect.

Each repeat is the project's own path: the twin's crops (drawn and cropped from the generator's geometry, of the
task's classes only), a frozen backbone's embedding cache, the two settings' CVs (`run_cv`, kfold5 over BioVid's
committed fold file of the 87 people) and `compare` of those two CVs alone. The interval of a rate is Clopper-Pearson's
exact binomial interval. Repeats already done (in `<reports>/power/<effect>/repeats.csv`) are not run again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from mlflow import MlflowClient
from omegaconf import DictConfig, OmegaConf

from pipeline.analysis.compare import compare
from pipeline.analysis.comparison_runs import ComparisonError
from pipeline.analysis.comparison_statistics import PRIMARY_METRIC
from pipeline.analysis.power_report import clopper_pearson
from pipeline.analysis.resampled_power import run_resampled
from pipeline.data.prepare import synthetic_config
from pipeline.data.tasks import get_task
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.orchestration.launchers import LaunchSession
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.atomic_io import atomic_write_csv, atomic_write_text, save_png
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT, resolve_path

log = logging.getLogger(__name__)
EXPERIMENT = "pain-power"  # every repeat's CVs and comparisons live in this experiment, apart from real work
REPEAT_COLUMNS = ["study", "effect", "seed", "task", "a", "b", "n_subjects", "value_a", "value_b", "mean_diff",
                  "diff_ci95_low", "diff_ci95_high", "p_value", "p_holm", "mde80", "rejected", "seconds"]
# the generator settings that make each effect, reported as its planted size
PLANTED = {"null": ("class_intensity", "burst_amplitude", "resting_au_sd"), "temporal": ("burst_amplitude", "burst_s",
           "burst_pain_window_s", "burst_rest_window_s", "class_intensity"), "baseline": ("resting_au_sd",),
           "graded": ("class_intensity",)}


@dataclass(frozen=True)
class PowerSettings:
    """The `power` group as one value, read once where `make power` starts (`of`): the chosen effect and its entry of
    `power.effects` (the twin, the task, the two settings `a` and `b` with their labels and overrides, the paired
    test's `metric`, the differences compare may allow), the repeats and the first one's seed, alpha, the overrides
    every repeat shares, where the twins go and whether they are kept, and the group as `power.yaml` records it."""

    effect: str  # `EFFECT=null` reaches Hydra as YAML's null, and names the null twin
    entry: dict  # power.effects[effect]
    repeats: int
    seed: int
    alpha: float
    dir: Path
    keep_data: bool
    common: tuple[str, ...]
    yaml: str

    @classmethod
    def of(cls, power: Mapping[str, Any]) -> PowerSettings:
        """The group's settings; an unknown effect is an error listing the ones there are."""
        effect = "null" if power["effect"] is None else str(power["effect"])
        if effect not in power["effects"]:
            raise SystemExit(f"power: unknown EFFECT={effect!r}; configured: {', '.join(power['effects'])}")
        return cls(effect, OmegaConf.to_container(power["effects"][effect]), int(power["repeats"]),
                   int(power["seed"]), float(power["alpha"]), resolve_path(power["dir"]), bool(power["keep_data"]),
                   tuple(power["common"]), OmegaConf.to_yaml(power))

    @property
    def task(self) -> str:
        return str(self.entry["task"])

    def side(self, name: str) -> dict:
        """Setting `a` or `b`: its label and overrides."""
        return self.entry[name]


def effect_metric(power: PowerSettings) -> str:
    """The paired test's metric of the chosen effect: its own (`metric`, e.g. mae for the graded twin), else compare's
    primary one."""
    return str(power.entry.get("metric") or PRIMARY_METRIC)


def twin_overrides(power: PowerSettings, seed: int, classes: Sequence[str]) -> list[str]:
    """The config overrides of repeat `seed`'s twin: the effect's generator settings, its own folders and store."""
    folder = power.dir / power.effect / f"seed_{seed}"
    return [f"data.synthetic.effect='{power.entry['twin']}'", f"data.synthetic.seed={seed}",
            f"data.synthetic.classes=[{','.join(classes)}]", f"data.root={folder / 'raw'}",
            f"data.processed_dir={folder / 'processed'}", f"mlflow.experiment={EXPERIMENT}"]


def study_key(power: PowerSettings, base: Sequence[str]) -> str:
    """What makes repeats of one study: the effect's pair and twin, the settings every repeat shares and the
    command's own overrides (the backbone, its weights, ...), hashed. A record's rows of another study (another
    MODEL= or WEIGHTS= over the same seeds) are never counted as this one's."""
    described = {"effect": power.effect, "entry": power.entry, "common": list(power.common), "alpha": power.alpha,
                 "base": sorted(base)}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def planted_size(synthetic: Mapping[str, Any], effect: str) -> dict:
    """The generator settings that make `effect`, as a twin's `data.synthetic` group makes them (what
    synthetic_config.json records)."""
    config = synthetic_config(synthetic)
    return {key: getattr(config, key) for key in PLANTED.get(effect, ())}


def run_repeat(power: PowerSettings, base: Sequence[str], seed: int, out_dir: Path,
               session: LaunchSession) -> dict:
    """One twin, the two settings' CVs on it (through `session`: the study's server and workers), and `compare` of
    those two: the primary metric's paired row."""
    task = get_task(power.task)
    twin = [*base, *power.common, f"task={power.task}", *twin_overrides(power, seed, task.classes)]
    started = time.time()
    configs = {}
    for side in ("a", "b"):
        cfg = load_config([*twin, *power.side(side)["overrides"]])
        print(f"== {power.effect} twin seed {seed}: {power.side(side)['label']} "
              f"({cv_runs.config_label(cv_runs.CvConfig.from_config(cfg))})",
              flush=True)
        run_cv(cfg, session)
        configs[side] = cfg
    labels = {side: cv_runs.config_label(cv_runs.CvConfig.from_config(cfg)) for side, cfg in configs.items()}
    if labels["a"] == labels["b"]:
        raise SystemExit(f"power: both settings of {power.effect} are the CV label {labels['a']!r}; compare "
                         f"cannot tell them apart")
    cfg = configs["a"]
    primary = effect_metric(power)
    try:
        result = compare(cfg.data.name, cfg.protocol.name, cfg.task.name, out_dir / f"seed_{seed}",
                         tracking_uri=cfg.mlflow.tracking_uri, experiment=cfg.mlflow.experiment,
                         subject_set=cfg.data.subject_set,
                         fold_file_sha256=cv_runs.current_fold_file_sha256(cv_runs.CvConfig.from_config(cfg)),
                         crop_params=cv_runs.crop_settings(cv_runs.CvConfig.from_config(cfg)),
                         only=[labels["a"], labels["b"]],
                         allow_differences=list(power.entry.get("allow_differences") or []), primary=primary)
    except ComparisonError as error:
        raise SystemExit(f"power: {error}") from None
    paired = result["subjects_paired"]
    row = paired[paired["metric"] == primary].iloc[0]  # the one pair
    sign = 1.0 if row.model_a == labels["a"] else -1.0  # report a - b as the config names them
    values = result["subjects"].set_index(["model", "metric"])["value"]
    if not power.keep_data:
        shutil.rmtree(resolve_path(cfg.data.processed_dir).parent, ignore_errors=True)
    low, high = sorted((sign * row.diff_ci95_low, sign * row.diff_ci95_high))
    return {"study": study_key(power, base), "effect": power.effect, "seed": seed, "task": power.task,
            "a": power.side("a")["label"], "b": power.side("b")["label"],
            "n_subjects": int(row.n_subjects), "value_a": float(values[(labels["a"], primary)]),
            "value_b": float(values[(labels["b"], primary)]), "mean_diff": sign * float(row.mean_diff),
            "diff_ci95_low": low, "diff_ci95_high": high, "p_value": float(row.p_value),
            "p_holm": float(row.p_holm), "mde80": float(row.mde80), "rejected": bool(row.p_holm < power.alpha),
            "seconds": round(time.time() - started, 1)}


def summarise(repeats: pd.DataFrame, power: PowerSettings, planted: dict) -> dict:
    """The rejection rate with its Clopper-Pearson interval, the planted size, the mean difference and MDE."""
    n, k = len(repeats), int(repeats["rejected"].sum())
    low, high = clopper_pearson(k, n)
    return {"effect": power.effect, "comparison": f"{repeats['a'].iloc[0]} - {repeats['b'].iloc[0]}",
            "task": repeats["task"].iloc[0], "metric": effect_metric(power), "repeats": n, "rejections": k,
            "rejection_rate": k / n, "rate_ci95_low": low, "rate_ci95_high": high,
            "measures": "type-I error" if power.effect == "null" else "power",
            "planted": json.dumps(planted, default=list), "mean_diff": float(repeats["mean_diff"].mean()),
            "sd_diff": float(repeats["mean_diff"].std(ddof=1)) if n > 1 else float("nan"),
            "mean_mde80": float(repeats["mde80"].mean()), "n_subjects": int(repeats["n_subjects"].median()),
            "alpha": power.alpha, "seconds_per_repeat": float(repeats["seconds"].median())}


def plot_repeats(repeats: pd.DataFrame, summary: dict, path: Path) -> None:
    """Left: each twin's paired difference with its interval (rejections marked). Right: the rejection rate with its
    Clopper-Pearson interval, beside the nominal alpha."""
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1]})
    order = np.arange(len(repeats))
    errors = np.vstack([repeats["mean_diff"] - repeats["diff_ci95_low"],
                        repeats["diff_ci95_high"] - repeats["mean_diff"]])
    colours = np.where(repeats["rejected"], "tab:red", "tab:blue")
    for i in order:
        left.errorbar(i, repeats["mean_diff"].iloc[i], yerr=errors[:, i : i + 1].clip(min=0), fmt="o",
                      color=colours[i], capsize=3)
    left.axhline(0, color="grey", lw=1)
    left.set_xlabel("twin (generator seed order)")
    left.set_ylabel(f"{summary['comparison']}\n{summary['metric']} difference")
    left.set_title(f"{summary['effect']} twin: paired difference per twin (red: rejected by Holm)", fontsize=9)
    left.grid(alpha=0.3)
    rate, low, high = summary["rejection_rate"], summary["rate_ci95_low"], summary["rate_ci95_high"]
    right.errorbar([0], [rate], yerr=[[rate - low], [high - rate]], fmt="s", capsize=6, color="black")
    right.axhline(summary["alpha"], color="tab:red", ls="--", lw=1, label=f"alpha {summary['alpha']}")
    right.set_xlim(-1, 1)
    right.set_ylim(0, 1)
    right.set_xticks([0], labels=[summary["measures"]])
    right.set_title(f"{summary['rejections']} of {summary['repeats']} rejected", fontsize=9)
    right.legend(fontsize=8)
    save_png(figure, path)


def run_power(cfg: DictConfig, overrides: Sequence[str] = ()) -> dict:
    """`make power EFFECT=... REPEATS=n`: run the repeats not yet done, then summarise, plot and log them."""
    power = PowerSettings.of(cfg.power)  # read once
    if power.entry.get("design") == "resampled":  # EFFECT=aa, curve: replicates resampled from one population
        return run_resampled(cfg, overrides).to_dict("records")[0]
    base = [o for o in overrides if not o.startswith(("power.", "task=", "data="))]
    out_dir = resolve_path(cfg.reports_dir) / "power" / power.effect
    record = out_dir / "repeats.csv"
    done = pd.read_csv(record, dtype={"study": str}) if record.is_file() else pd.DataFrame(columns=REPEAT_COLUMNS)
    if "study" not in done:  # a record written before repeats named their study: none of its rows is this one's
        done.insert(0, "study", "")
    study = study_key(power, base)
    ours = done["study"] == study
    seeds = [power.seed + r for r in range(power.repeats)]
    print(f"power: {power.effect} twin, {power.side('a')['label']} against {power.side('b')['label']} on "
          f"{power.task}, {len(seeds)} "
          f"repeats ({int((ours & done['seed'].isin(seeds)).sum())} done before); study {study}; record {record}"
          + (f" ({int((~ours).sum())} rows of other studies there, not counted)" if (~ours).any() else ""),
          flush=True)
    with LaunchSession() as session:  # one tracking server and one set of workers for every repeat's CVs
        for seed in seeds:
            if seed in set(done.loc[done["study"] == study, "seed"]):
                continue
            row = run_repeat(power, base, seed, out_dir, session)
            done = pd.concat([done, pd.DataFrame([row])], ignore_index=True)
            atomic_write_csv(record, done)  # each repeat kept as soon as it is known: a killed run resumes after it
            print(f"power {power.effect} seed {seed}: {row['a']} - {row['b']} {row['mean_diff']:+.3f} "
                  f"[{row['diff_ci95_low']:+.3f}, {row['diff_ci95_high']:+.3f}], p_holm {row['p_holm']:.3g}"
                  f"{' REJECTED' if row['rejected'] else ''}; mde80 {row['mde80']:.3f} ({row['seconds']:.0f} s)",
                  flush=True)
    repeats = done[(done["study"] == study) & done["seed"].isin(seeds)].sort_values("seed", ignore_index=True)
    first = load_config([*base, *power.common, f"task={power.task}",
                         *twin_overrides(power, seeds[0], get_task(power.task).classes)])
    summary = summarise(repeats, power, planted_size(first.data.synthetic, power.effect))
    paths = {"summary": out_dir / "power_summary.csv", "plot": out_dir / "power.png", "repeats": record}
    atomic_write_csv(paths["summary"], pd.DataFrame([summary]))
    plot_repeats(repeats, summary, paths["plot"])
    atomic_write_text(out_dir / "power_summary.json", json.dumps(summary, indent=2) + "\n")
    log_power(tracking.store_uri(cfg.mlflow.tracking_uri), cfg.mlflow.artifact_root, power, summary, paths)
    print(f"{summary['measures']} of {summary['comparison']} ({summary['metric']}, Holm, alpha {summary['alpha']}) "
          f"on the {summary['effect']} twin: {summary['rejections']} of {summary['repeats']} = "
          f"{summary['rejection_rate']:.3f} [95 % Clopper-Pearson {summary['rate_ci95_low']:.3f}, "
          f"{summary['rate_ci95_high']:.3f}]; planted {summary['planted']}; mean difference "
          f"{summary['mean_diff']:+.3f} "
          f"(sd {summary['sd_diff']:.3f} over twins), mean minimum detectable effect {summary['mean_mde80']:.3f} at "
          f"{summary['n_subjects']} subjects")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return summary


def log_power(tracking_uri: str, artifacts: str | None, power: PowerSettings, summary: dict,
              paths: dict[str, Path]) -> None:
    """The summary as a run of its own (kind `power`) in the power experiment of the store at `tracking_uri`
    (artifacts under `artifacts`, mlflow.artifact_root; None: the project's), with its tables and plot."""
    client = MlflowClient(tracking_uri)
    artifact_root = resolve_path(artifacts) if artifacts else tracking.artifact_root(PROJECT_ROOT)
    experiment_id = tracking.get_or_create_experiment(EXPERIMENT, artifact_root, client=client)
    run = client.create_run(experiment_id, run_name=f"power {summary['effect']} ({summary['repeats']} twins)",
                            tags={tracking.RUN_KIND_TAG: tracking.POWER_RUN, tracking.EFFECT_TAG: summary["effect"],
                                  tracking.MEASURES_TAG: summary["measures"],
                                  tracking.COMPARISON_TAG: summary["comparison"]})
    with tracking.run_lifecycle(run.info.run_id, client):
        for key in ("rejection_rate", "rate_ci95_low", "rate_ci95_high", "mean_diff", "mean_mde80", "repeats"):
            client.log_metric(run.info.run_id, f"power/{key}", float(summary[key]))
        client.log_param(run.info.run_id, "planted", summary["planted"][:500])
        client.log_text(run.info.run_id, power.yaml, "power.yaml")
        for path in paths.values():
            client.log_artifact(run.info.run_id, str(path), "power")
