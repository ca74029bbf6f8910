"""One large population drawn from a twin's generator and embedded once, and replicates of BioVid's size drawn from
it: what `make power`'s resampled studies (pipeline/analysis/resampled_power.py) train thousands of probes on.

The population is `twins` independent twins of the configured dataset (the BioVid-scale twin: 87 people each, 20 of
them non-responders), generator seeds `population_seed`, `population_seed + 1`, ..., each cropped from its own
geometry (`data.synthetic.crops=truth`: no videos, no detector) for the task's classes and embedded by the frozen
backbone (the embedding cache, `WEIGHTS=` its start). Whatever the twin is (its preset, effect and knobs: the config's
`data.synthetic.*`), the population is drawn from it. Each crop keeps the action units its frame was drawn with
(`traces.clip_traces`: the generator's own animation), which a power curve's better copy may see (`shift_matrix`).

A replicate fills the slots of a committed BioVid fold file (kfold5 or LOSO of all87) with people drawn without
replacement from the population: a responder's slot with a responder, a non-responder's (Part A's 20) with a
non-responder, so each replicate has BioVid's 87, its 20 non-responders where BioVid has them and its folds. Its
frames are the drawn people's, renamed to their slots; `ReplicateDataModule` splits them as a CV's fold does (the
same `PainDataModule.split_frames`), over the population's embeddings.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from pipeline.data.biovid import NON_RESPONDERS
from pipeline.data.datamodule import ROW_INDEX_NAME, LoaderConfig, SubjectRoles, read_frame_table
from pipeline.data.embeddings import EmbeddingDataModule, EmbeddingTable
from pipeline.data.fold_files import fold_subjects
from pipeline.data.personalise import PersonaliseConfig
from pipeline.data.prepare import DataSettings, prepare_data, synthetic_config
from pipeline.data.synthetic.settings import SUBJECTS_CSV
from pipeline.data.synthetic.traces import clip_traces
from pipeline.data.tasks import Task
from pipeline.models.backbones import Backbone, create_backbone
from pipeline.models.embedding_cache import CacheSettings, ensure_embeddings, used_rows
from pipeline.utils.config import load_config
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)
PERSON = "person"  # the population's name of a person: its twin's seed and its name there
AU_PREFIX = "action_unit_"  # a population frame's action units while the twins are joined


@dataclass(frozen=True)
class Population:
    """The drawn people's crops: `frames` (one row per embedded crop, index = its row in `embeddings`, with the
    person, its own subject and sample names), `people` (person -> responder), the embeddings of every crop and
    the action units the generator drew its frame with (the truth a facial tracker estimates)."""

    frames: pd.DataFrame
    people: pd.Series
    embeddings: EmbeddingTable
    action_units: np.ndarray  # (crops, 4): AU4, AU6/7, AU9/10, AU43
    seconds: float  # drawing and embedding it (0 where it was read back)

    def __len__(self) -> int:
        return len(self.people)


def population_twin_overrides(seed: int, folder: Path, classes: Sequence[str]) -> list[str]:
    """The config overrides of the population's twin `seed`: its generator seed, its classes, its own folders."""
    twin = folder / f"seed_{seed}"
    return ["data.synthetic.crops=truth", f"data.synthetic.seed={seed}",
            f"data.synthetic.classes=[{','.join(classes)}]", f"data.root={twin / 'raw'}",
            f"data.processed_dir={twin / 'processed'}"]


def population_backbone(model: Mapping[str, Any]) -> Backbone:
    """The frozen backbone every population twin is embedded by (the `model` group; `WEIGHTS=` in its `weights`)."""
    backbone, _ = create_backbone(model["name"], pretrained=model["pretrained"], weights=model["weights"],
                                  img_size=model["img_size"])
    return backbone.eval()


def draw_twin(overrides: Sequence[str], backbone: Backbone) -> tuple[pd.DataFrame, np.ndarray, pd.Series]:
    """One twin of the population: its crops (truth crops, resumable) with the action units of their frames, their
    embeddings (the cache beside them, built once per backbone and weights) and who responds."""
    cfg = load_config(list(overrides))
    processed = resolve_path(cfg.data.processed_dir)
    loader = LoaderConfig.from_config(cfg.loader)
    if not (processed / "frames.csv").is_file():
        prepare_data(DataSettings.from_config(cfg), progress=sys.stderr.isatty())
    settings = CacheSettings.from_config(cfg.cache)
    entry = ensure_embeddings(backbone, processed, crop_fraction=loader.crop_fraction, from_s=loader.from_s,
                              frames_per_video=loader.frames_per_video, augment=OmegaConf.to_container(cfg.augment),
                              settings=settings, progress=sys.stderr.isatty(), workers=0)
    frames = used_rows(read_frame_table(processed / "frames.csv"), loader.from_s,
                       loader.frames_per_video).loc[entry.table.rows]
    subjects = pd.read_csv(resolve_path(cfg.data.root) / SUBJECTS_CSV, dtype={"subject_name": str})
    responder = subjects.set_index("subject_name")["responder"].astype(bool)
    traces = clip_traces(synthetic_config(cfg.data.synthetic))
    clip = pd.Series(np.arange(len(traces.sample_names)), index=traces.sample_names)
    units = traces.values[clip[frames["sample_name"]].to_numpy(), frames["frame_index"].to_numpy(), :4]
    return frames.assign(**{f"{AU_PREFIX}{i}": units[:, i] for i in range(4)}), entry.table.plain, responder


def draw_population(base: Sequence[str], twins: int, first_seed: int, folder: Path,
                    classes: Sequence[str]) -> Population:
    """`twins` twins of the configuration `base` (the command's overrides) drawn, cropped and embedded into
    `folder` (each kept: a second study reads them back), as one population."""
    started = time.time()
    backbone = population_backbone(load_config(list(base)).model)
    frames, plains, people = [], [], {}
    for seed in range(first_seed, first_seed + twins):
        print(f"population: twin {seed - first_seed + 1} of {twins} (generator seed {seed})", flush=True)
        overrides = [*base, *population_twin_overrides(seed, Path(folder), classes)]
        twin_frames, plain, responder = draw_twin(overrides, backbone)
        twin_frames = twin_frames.assign(**{PERSON: f"{seed}:" + twin_frames["subject_name"]})
        frames.append(twin_frames.reset_index(drop=True))
        plains.append(np.asarray(plain, dtype=np.float32))
        people.update({f"{seed}:{name}": flag for name, flag in responder.items()})
    table = pd.concat(frames, ignore_index=True)
    table.index.name = ROW_INDEX_NAME
    plain = np.concatenate(plains)
    embeddings = EmbeddingTable(np.arange(len(table), dtype=np.int64), plain,
                                np.zeros((0, *plain.shape), dtype=np.float32))
    units = table[[f"{AU_PREFIX}{i}" for i in range(4)]].to_numpy(dtype=np.float32)
    return Population(table.drop(columns=[f"{AU_PREFIX}{i}" for i in range(4)]), pd.Series(people, name="responder"),
                      embeddings, units, time.time() - started)


def shift_matrix(population: Population, knob: str, seed: int) -> torch.Tensor:
    """What a copy adds to its embeddings, scaled by its level (`probe_batch.Embeddings.shift`), in float16, each
    dimension in units of its spread over the population: `noise`, a fixed standard-normal draw per crop and
    dimension (a worse backbone); `action_units`, the crop's four action units (standardised over the population)
    through a fixed random projection into every dimension (a backbone that also sees what a facial tracker
    measures: a better one)."""
    plain = torch.from_numpy(population.embeddings.plain)
    generator = torch.Generator().manual_seed(int(seed))
    spread = plain.std(dim=0)
    if knob == "noise":
        return (torch.randn(plain.shape, generator=generator) * spread).to(torch.float16)
    if knob == "action_units":
        units = torch.from_numpy(population.action_units)
        standard = (units - units.mean(dim=0)) / units.std(dim=0).clamp_min(1e-6)
        projection = torch.randn(units.shape[1], plain.shape[1], generator=generator) / units.shape[1] ** 0.5
        return (standard @ projection * spread).to(torch.float16)
    raise ValueError(f"power.effects.<effect>.knob={knob!r}: expected noise or action_units")


def slot_responders(folds: pd.DataFrame) -> pd.Series:
    """The fold file's subjects (slots), each a responder unless it is one of Part A's 20 non-responders."""
    slots = sorted(folds["subject_name"].unique())
    return pd.Series({slot: slot not in NON_RESPONDERS for slot in slots}, name="responder")


def draw_replicate(population: Population, slots: pd.Series, rng: np.random.Generator) -> dict[str, str]:
    """Slot -> person: the slots' responders filled with responders, its non-responders with non-responders, every
    person at most once; an error where the population has too few of either."""
    assignment: dict[str, str] = {}
    for flag in (True, False):
        wanted = slots.index[slots == flag]
        pool = population.people.index[population.people == flag]
        if len(pool) < len(wanted):
            kind = "responders" if flag else "non-responders"
            raise ValueError(f"the population has {len(pool)} {kind}; a replicate needs {len(wanted)} "
                             f"(draw more twins: power.resampled.population_twins)")
        assignment.update(zip(wanted, rng.choice(np.asarray(pool), size=len(wanted), replace=False), strict=True))
    return assignment


def replicate_frames(population: Population, assignment: Mapping[str, str]) -> pd.DataFrame:
    """The replicate's frame table: every crop of the drawn people (rows keep their population numbers), each
    person named after its slot, sample names too, ordered as a frames.csv is."""
    person_of = pd.Series(assignment, name=PERSON)
    slot_of = pd.Series(person_of.index, index=person_of.to_numpy())
    frames = population.frames[population.frames[PERSON].isin(slot_of.index)]
    slot = frames[PERSON].map(slot_of)
    own = frames["subject_name"].str.len()
    sample = [s + name[n:] for s, name, n in zip(slot, frames["sample_name"], own, strict=True)]
    frames = frames.assign(subject_name=slot.to_numpy(), sample_name=sample)
    return frames.sort_values(["subject_name", "sample_name", "frame_index"])


class ReplicateDataModule(EmbeddingDataModule):
    """One fold of a replicate: the fold file's roles (`folds`), filled by the replicate's people (`frames`, from
    memory), split as a CV's fold is (`PainDataModule.split_frames`: the task's classes, usable frames, the loader's
    crops) over the population's embeddings."""

    def __init__(self, frames: pd.DataFrame, folds: pd.DataFrame, fold: int, task: Task, data_config,
                 loader: LoaderConfig, seed: int, embeddings: EmbeddingTable) -> None:
        roles = fold_subjects(folds, fold)
        super().__init__(Path("replicate"), SubjectRoles(tuple(roles["train"]), tuple(roles["val"]),
                                                         tuple(roles["test"]), int(fold), f"replicate, fold {fold}"),
                         task, data_config, {}, loader, seed, embeddings=embeddings, source=Path("population"),
                         personalise=PersonaliseConfig.from_config(None))
        self._frames = frames

    def _read_frame_table(self) -> pd.DataFrame:
        return self._frames
