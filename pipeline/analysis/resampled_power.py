"""`make power EFFECT=aa` and `EFFECT=curve`: the error rates of `make compare`'s paired test where the models have
signal, measured on replicates of BioVid's size resampled from one large population of the twin.

Why resampled: a type-I error bounded at 5 +- 3 % takes about 300 replicates, and a power curve a few hundred more;
a twin drawn, cropped and embedded per replicate, with two CVs through MLflow, takes minutes each. Here the
population (`population.draw_population`: many twins of the configured dataset, 87 people each) is drawn and
embedded once; each replicate draws 87 of its people onto the slots of BioVid's committed fold file (kfold5 or LOSO of
all87, non-responders onto Part A's non-responders' slots) and cross-validates every configuration on them in memory
(`resampled_cv.fit_replicate`: the in-memory probe's recipe, every probe at once, each fold's threshold from its
validation videos by the CV's rule), so that a replicate takes seconds. The statistic is `make compare`'s own:
`comparison_statistics.paired_table` on the pooled test videos a CV would log, with their folds and seeds.

The copies compared:

- `aa`: two copies of one configuration (the frozen backbone's linear probe) that differ only in their training
  seeds. No true difference: the rejection rate is the test's type-I error where the models have signal, with both
  copies' accuracy beside it (they must be above chance for the test's units to be able to depend on each other).
- `curve`: copy a against copy b whose embeddings carry a fixed per-crop shift of known size (`knob`, `levels` in
  units of each dimension's spread, `population.shift_matrix`): `action_units`, the crop's own action units projected
  into the embedding space (b sees what a facial tracker measures: a better copy), or `noise` (a worse one). The
  rejection rate against the TRUE difference, each copy's accuracy on the population's people outside the replicate
  (`resampled_cv.population_accuracy`), is the test's power curve, beside the `mde80` it printed.

Each replicate also runs the subject-level permutation test `make compare` used before (the subjects taken as
independent) on the same scores, so the record says what each test would have concluded. Replicates already in
`<reports>/power/<effect>/replicates.csv` (one row per replicate and level, study by study) are not run again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.analysis.comparison_statistics import PRIMARY_METRIC, paired_table, seed_scores
from pipeline.analysis.population import (
    Population,
    draw_population,
    draw_replicate,
    population_backbone,
    replicate_frames,
    shift_matrix,
    slot_responders,
)
from pipeline.analysis.power_report import log_study, print_summary, write_summary
from pipeline.analysis.resampled_cv import (
    Copy,
    PopulationVideos,
    ReplicateFit,
    fit_replicate,
    fold_splits,
    population_accuracy,
)
from pipeline.data.datamodule import LoaderConfig
from pipeline.data.fold_files import read_folds
from pipeline.data.prepare import synthetic_config
from pipeline.data.tasks import Task, get_task
from pipeline.evaluation.statistics import paired_permutation_test
from pipeline.models.probe_batch import BatchRecipe, Embeddings, check_recipe
from pipeline.utils.atomic_io import atomic_write_csv
from pipeline.utils.config import load_config
from pipeline.utils.digests import file_sha256
from pipeline.utils.paths import resolve_path
from pipeline.utils.seeds import derived_seed

RECORD_COLUMNS = ["study", "effect", "protocol", "seeds", "replicate", "knob", "level", "n_subjects", "n_units",
                  "value_a",
                  "value_b", "mean_diff", "diff_ci95_low", "diff_ci95_high", "p_value", "p_holm", "mde80", "rejected",
                  "p_subject", "rejected_subject", "true_a", "true_b", "alpha", "seconds"]
A_COPY = "copy a"


@dataclass(frozen=True)
class ResampledStudy:
    """One study: the effect's copies (`knob` and `levels`: copy b's shift), the fold file's protocol, training seeds
    a copy, replicates, the population and its truth, alpha; `key` names its rows in the record."""

    effect: str
    task: str
    knob: str
    levels: tuple[float, ...]
    base_level: float  # copy a's own shift on the knob (0: none; aa_signal: both copies at one gain)
    protocol: str
    seeds: int
    replicates: tuple[int, ...]
    population_twins: int
    population_seed: int
    shift_seed: int
    truth_replicates: int
    alpha: float
    key: str

    @classmethod
    def from_config(cls, power: Mapping[str, Any], effect: str, base: Sequence[str], twin: str) -> ResampledStudy:
        """The study of `effect` with the command's overrides `base` on the twin named `twin` (its population's
        folder: the generator's resolved settings)."""
        entry, settings = plain(power["effects"][effect]), plain(power["resampled"])
        described = {"effect": effect, "entry": entry, "alpha": float(power["alpha"]),
                     "twin": twin, "resampled": {k: v for k, v in settings.items() if k != "truth_replicates"},
                     "common": list(power["common"]), "base": sorted(map(by_content, base))}
        key = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cls(effect, str(entry["task"]), str(entry.get("knob") or "noise"),
                   tuple(float(v) for v in entry["levels"]), float(entry.get("base_level", 0.0)),
                   str(settings["protocol"]), int(settings["seeds"]),
                   tuple(int(power["seed"]) + r for r in range(int(power["repeats"]))),
                   int(settings["population_twins"]), int(settings["population_seed"]), int(settings["shift_seed"]),
                   int(settings["truth_replicates"]), float(power["alpha"]), key)

    @property
    def same_configuration(self) -> bool:
        """An A/A: copy b at copy a's own level, so the copies differ only in their training seeds."""
        return all(level == self.base_level for level in self.levels)

    def describe(self) -> str:
        """What the study's copies are, in a line."""
        seeds = f"{self.seeds} training seed(s) a copy"
        if self.same_configuration:
            plain_copies = "both plain" if not self.base_level else f"both at {self.knob} {self.base_level:g}"
            return f"an A/A: copies a and b differ only in their training seeds ({plain_copies}), {seeds}"
        return f"copy a at {self.knob} {self.base_level:g}, copy b at {list(self.levels)}, {seeds}"

    def copies(self, replicate: int) -> list[Copy]:
        """Copy a (at `base_level`), then copy b at each level: a's training seeds and b's (shared by b's levels)
        drawn from the replicate, so every replicate trains anew."""
        seeds = [tuple(derived_seed(replicate, side, s) % 2**31 for s in range(self.seeds)) for side in (0, 1)]
        return [Copy(A_COPY, self.base_level, seeds[0]), *(Copy(f"copy b ({self.knob} {level:g})", level, seeds[1])
                                                for level in self.levels)]


@dataclass
class StudyData:
    """What every replicate of a study reads: the population, its embeddings (with copy b's shift), the fold
    table and its slots, the population's videos (the truth), and the CV's settings."""

    population: Population
    embeddings: Embeddings
    folds: pd.DataFrame
    slots: pd.Series
    truth: PopulationVideos
    task: Task
    recipe: BatchRecipe
    loader: LoaderConfig
    data_config: object
    rule: str | float


def recipe_of(trainer: Mapping[str, Any], loader: Mapping[str, Any], optim: Mapping[str, Any],
              views: int) -> BatchRecipe:
    """The in-memory probe's settings (the `trainer`, `loader` and `model.optim` groups, the cache's views), checked
    to be those the lockstep fit reproduces."""
    check_recipe(str(trainer["monitor"]), str(trainer["aggregation"]), int(views), bool(loader["balanced_sampling"]),
                 float(trainer["label_smoothing"]), trainer["class_weights"])
    return BatchRecipe(int(loader["batch_size"]), int(trainer["max_epochs"]), int(trainer["patience"]),
                       float(optim["head_lr"]), float(optim["weight_decay"]), float(optim["warmup_epochs"]),
                       trainer["gradient_clip_val"])


def by_content(override: str) -> str:
    """An override as a study's key reads it: `model.weights=<file>` by the file's SHA-256, so that one study resumes
    from another checkout, or with the path written otherwise; any other override as written."""
    key, _, value = override.partition("=")
    if key.lstrip("+~") == "model.weights" and value and Path(value).is_file():
        return f"{key}=sha256:{file_sha256(value)}"
    return override


def plain(group: Mapping[str, Any]) -> Any:
    """A config group as plain values (an OmegaConf node resolved, a mapping copied)."""
    return OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else dict(group)


def population_folder(power_dir: str, data: Mapping[str, Any], preprocess: Mapping[str, Any]) -> Path:
    """Where the population of this twin lives: one folder per dataset and generator settings as the generator
    resolves them (a preset's values, not only its name: a recalibrated preset is another twin) and the crops'
    settings, so a study of another twin draws its own and one of the same twin reads it back."""
    twin = {"data": plain(data), "preprocess": plain(preprocess), "generator": dataclasses.asdict(
        synthetic_config(data["synthetic"]))}
    digest = hashlib.sha256(json.dumps(twin, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return resolve_path(power_dir) / "population" / f"{data['name']}_{digest}"


def study_data(power_dir: str, study: ResampledStudy, overrides: Sequence[str]) -> StudyData:
    """The population drawn (or read back) and everything each replicate reads."""
    cfg = load_config([*overrides, f"protocol={study.protocol}"])
    task = get_task(study.task)
    if task.n_classes != 2:
        raise SystemExit(f"power: the resampled studies compare accuracy at the threshold of a binary task, not "
                         f"{study.task}")
    recipe = recipe_of(cfg.trainer, cfg.loader, cfg.model.optim, int(cfg.cache.views))
    population = draw_population(overrides, study.population_twins, study.population_seed,
                                 population_folder(power_dir, cfg.data, cfg.preprocess), task.classes)
    plain = torch.from_numpy(np.array(population.embeddings.plain, dtype=np.float32))
    shift = shift_matrix(population, study.knob, study.shift_seed) if any(study.levels) else None
    folds = read_folds(resolve_path(cfg.fold_file))
    return StudyData(population, Embeddings(plain, shift), folds, slot_responders(folds),
                     PopulationVideos.of(population, task), task, recipe, LoaderConfig.from_config(cfg.loader),
                     population_backbone(cfg.model).data_config, cfg.eval.threshold)


def seed_mean_primary(videos: pd.DataFrame) -> pd.Series:
    """Each subject's primary metric, averaged over the training seeds (what both tests pair)."""
    scores = seed_scores(videos, auroc=False)
    return scores.pivot(index="subject_name", columns="seed", values=PRIMARY_METRIC).mean(axis=1)


def level_row(study: ResampledStudy, replicate: int, fitted: ReplicateFit, copy: Copy,
              truth: dict[str, float]) -> dict:
    """Copy a against one copy b: `make compare`'s paired test of the primary metric (`paired_table`, on the
    pooled videos with their folds and seeds) and the subject-level permutation test on the same scores."""
    pair = {A_COPY: fitted.videos[A_COPY], copy.name: fitted.videos[copy.name]}
    row = paired_table(pair, PRIMARY_METRIC, metrics=(PRIMARY_METRIC,)).iloc[0]
    a, b = (seed_mean_primary(pair[name]) for name in (A_COPY, copy.name))
    _, p_subject = paired_permutation_test(a.to_numpy(), b.reindex(a.index).to_numpy())
    value = {name: float((table["decision"] == table["label"]).mean()) for name, table in pair.items()}
    return {"study": study.key, "effect": study.effect, "protocol": study.protocol, "seeds": study.seeds,
            "replicate": replicate, "knob": study.knob, "level": copy.shift, "n_subjects": int(row.n_subjects),
            "n_units": int(row.n_units), "value_a": value[A_COPY], "value_b": value[copy.name],
            "mean_diff": float(row.mean_diff), "diff_ci95_low": float(row.diff_ci95_low),
            "diff_ci95_high": float(row.diff_ci95_high), "p_value": float(row.p_value), "p_holm": float(row.p_holm),
            "mde80": float(row.mde80), "rejected": bool(row.p_holm < study.alpha), "p_subject": float(p_subject),
            "rejected_subject": bool(p_subject < study.alpha), "true_a": truth.get(A_COPY, np.nan),
            "true_b": truth.get(copy.name, np.nan), "alpha": study.alpha}


def run_replicate(study: ResampledStudy, data: StudyData, replicate: int) -> list[dict]:
    """One replicate: 87 people drawn onto the fold file's slots, every copy cross-validated on them, and a row per
    level (with the copies' accuracy on the rest of the population for the first `truth_replicates`)."""
    started = time.time()
    drawn = draw_replicate(data.population, data.slots,
                           np.random.default_rng([study.population_seed, replicate]))
    frames = replicate_frames(data.population, drawn)
    splits = fold_splits(frames, data.folds, data.task, data.data_config, data.loader, data.population)
    copies = study.copies(replicate)
    fitted = fit_replicate(splits, copies, data.embeddings, data.recipe, data.task.classes, data.rule)
    truth = (population_accuracy(data.truth, data.embeddings, fitted, drawn)
             if replicate - study.replicates[0] < study.truth_replicates else {})
    rows = [level_row(study, replicate, fitted, copy, truth) for copy in copies[1:]]
    seconds = round(time.time() - started, 1)
    return [{**row, "seconds": seconds} for row in rows]


def progress_line(rows: list[dict]) -> str:
    first = rows[0]
    levels = "; ".join(f"{r['knob']} {r['level']:g}: a {r['value_a']:.3f} b {r['value_b']:.3f} diff "
                       f"{r['mean_diff']:+.3f} p {r['p_value']:.3g}{' REJECTED' if r['rejected'] else ''} "
                       f"(subject test p {r['p_subject']:.3g}) mde80 {r['mde80']:.3f}" for r in rows)
    return (f"{first['effect']} {first['protocol']} {first['seeds']} seed(s), replicate {first['replicate']}: "
            f"{levels} ({first['seconds']:.0f} s)")


def run_resampled(cfg: DictConfig, overrides: Sequence[str] = ()) -> pd.DataFrame:
    """`make power EFFECT=aa|curve`: the replicates not yet in the record, then the study's summary, the effect's
    plot of every study's curve (`power.png`) and its run in MLflow."""
    power = cfg.power
    effect = str(power.effect)
    base = [o for o in overrides if not o.startswith(("power.", "task=", "data="))]
    composed = [*base, *power.common, f"task={power.effects[effect].task}"]
    twin = load_config(composed)
    study = ResampledStudy.from_config(power, effect, base,
                                       population_folder(power.dir, twin.data, twin.preprocess).name)
    out_dir = resolve_path(cfg.reports_dir) / "power" / effect
    record = out_dir / "replicates.csv"
    done = pd.read_csv(record, dtype={"study": str}) if record.is_file() else pd.DataFrame(columns=RECORD_COLUMNS)
    ours = done["study"] == study.key
    todo = [r for r in study.replicates if r not in set(done.loc[ours, "replicate"])]
    print(f"power: {effect}, {study.protocol}, {study.describe()}; {len(study.replicates)} replicates "
          f"({len(study.replicates) - len(todo)} done "
          f"before); study {study.key}; record {record}", flush=True)
    if todo:
        data = study_data(power.dir, study, composed)
        print(f"population: {len(data.population)} people ({int(data.population.people.sum())} responders), "
              f"{len(data.population.frames)} crops, ready in {data.population.seconds:.0f} s", flush=True)
        for replicate in todo:
            rows = run_replicate(study, data, replicate)
            done = pd.concat([done, pd.DataFrame(rows)], ignore_index=True)
            atomic_write_csv(record, done)  # each replicate kept as soon as it is known: a killed run resumes
            print(progress_line(rows), flush=True)
    counted = done[(done["study"] != study.key) | done["replicate"].isin(study.replicates)]
    summary, paths = write_summary(counted, out_dir)
    print_summary(summary, study.key, study.same_configuration)
    log_study(cfg.mlflow, OmegaConf.to_yaml(power), summary, study.key, paths)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return summary[summary["study"] == study.key]
