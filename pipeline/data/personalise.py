"""Personalisation protocols: a person's embeddings seen against that person's own statistics, as pure functions of
row tables (subject_name, sample_name, ...: one row per crop) and embedding arrays (one row per table row).

Faces differ more between people than one person's BL1 and PA1 do; two protocols take the person out:

- `subject_normalised` (`subject_normalise`): each person's embeddings standardised by that person's own mean and
  standard deviation over all of their rows. It takes subject ids and features only, so it cannot read a label; a
  test person's statistics come from their unlabelled test recordings.
- `baseline` with k (`select_baseline`, `relative_to_reference`): k of a person's BL1 videos (every crop of each) are
  their resting reference, drawn from (seed, person); they leave the rows the person is tested (or trained) on, and
  every other crop is seen as its embedding minus the reference mean. The only label read is "which videos are BL1"
  (a clinician records the resting video first): the selection takes a BL1 mask and refuses a table that carries
  class or label columns. It draws each person's reference from the rows given for that person, so a training
  subject's reference comes from their own training videos.

The protocols are a registry (`PROTOCOLS`, name -> `Protocol`) that `personalise.mode` names and the embedding
data, the scorer and the reference ask: what a protocol takes out of a split (`take_reference`), how it shows a
split's embeddings to the head (`split_transform`) and a new person's (`applied`). A new protocol is one subclass
registered with `@register_protocol`.

`reference_statistics` is the same for a new person (`make predict REFERENCE=<folder>`): the folder's recordings
play the part a person's own videos play in a cross-validation, their mean the baseline reference, their mean and
spread a subject-normalised model's statistics (`ReferenceStatistics.applied`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from pipeline.data.tasks import NO_PAIN
from pipeline.utils.seeds import derived_seed

VIDEO_KEYS = ["subject_name", "sample_name"]
LABEL_COLUMNS = ("class_name", "class_id", "label")  # what a baseline selection must never be handed


@dataclass(frozen=True)
class PersonaliseConfig:
    """`personalise` (configs/personalise/): `none` (the default) adds no key, so an absent section is none."""

    mode: str
    k: int | None = None  # baseline: reference videos per person
    seed: int | None = None  # baseline: which BL1 videos, drawn per person

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> PersonaliseConfig:
        """The config's `personalise` section (None or empty: none), checked."""
        if not section:
            return cls(NONE)
        config = cls(**dict(section))
        if config.mode not in PROTOCOLS:
            raise ValueError(f"personalise.mode={config.mode!r}: expected one of {', '.join(PROTOCOLS)}")
        config.protocol.check(config)
        return config

    @property
    def protocol(self) -> Protocol:
        return PROTOCOLS[self.mode]

    @property
    def personal(self) -> bool:
        """Whether a person is seen against their own statistics (anything but `none`)."""
        return self.protocol.personal

    @property
    def label(self) -> str:
        """How tables and tags name the protocol: none, subject_normalised, baseline_k2."""
        return self.protocol.label(self)

    def meta(self) -> dict[str, Any]:
        """What a kept model records of its protocol (`meta["personalise"]`, read back with `from_config`): nothing
        for none, so a plain model's file is as before."""
        return {"personalise": {"mode": self.mode, "k": self.k, "seed": self.seed}} if self.personal else {}


def refuse_unapplied(config: PersonaliseConfig, *, reads_cache: bool) -> None:
    """A personalisation protocol is applied to a fixed backbone's cached embeddings
    (`pipeline.data.embeddings.EmbeddingDataModule`): under a frame head, and under a temporal head's second stage,
    whose clips are made of the same personalised embeddings. A backbone trained on images would need each person's
    reference re-embedded by the backbone as it changes, which is not done: a CV asked for one is refused before it
    plans anything, rather than a plain model trained and recorded under the protocol's name."""
    if not config.personal or reads_cache:
        return
    raise ValueError(f"personalise={config.mode} ({config.label}) is applied to a frozen backbone's cached "
                     f"embeddings (model.finetune=frozen, under a frame head or a two-stage temporal head); a backbone "
                     f"trained on images (model.finetune) does not apply it yet, so this CV would be a plain one under "
                     f"a personalised name")


def _check_features(subjects: np.ndarray, features: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    subjects, features = np.asarray(subjects), np.asarray(features, dtype=float)
    if features.ndim != 2 or subjects.shape != (len(features),):
        raise ValueError(f"{what}: expected subjects (N,) and features (N, D), got {subjects.shape} and "
                         f"{features.shape}")
    return subjects, features


def subject_statistics(subjects: np.ndarray, features: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each person's mean and standard deviation (ddof=0) over that person's rows; a dimension constant within a
    person gets a standard deviation of 1, so it is centred only."""
    subjects, features = _check_features(subjects, features, "subject_statistics")
    out = {}
    for subject in np.unique(subjects.astype(str)):
        rows = features[subjects.astype(str) == subject]
        sd = rows.std(axis=0)
        out[subject] = rows.mean(axis=0), np.where(sd > 0, sd, 1.0)
    return out


def standardised(subjects: np.ndarray, features: np.ndarray,
                 statistics: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each row's features minus its person's mean, divided by its person's spread (`subject_statistics`, perhaps of
    other rows of the same people: a training person's augmented views by the statistics of their plain crops)."""
    subjects, features = _check_features(subjects, features, "standardised")
    people = subjects.astype(str)
    without = sorted(set(people) - set(statistics))
    if without:
        raise ValueError(f"no statistics for {', '.join(without)}")
    out = np.empty_like(features)
    for person in np.unique(people):
        mean, sd = statistics[person]
        out[people == person] = (features[people == person] - mean) / sd
    return out


def subject_normalise(subjects: np.ndarray, features: np.ndarray) -> np.ndarray:
    """Each row's features standardised by its person's own mean and spread over all of that person's rows. Labels
    are not an argument: they cannot shape the statistics."""
    return standardised(subjects, features, subject_statistics(subjects, features))


@dataclass(frozen=True)
class BaselineSplit:
    """A baseline selection: the reference rows, the rows left to test (or train) on, and per person what it cost."""

    reference: pd.DataFrame  # every crop of each chosen BL1 video
    remaining: pd.DataFrame  # the other rows, in their order
    videos_lost: pd.DataFrame  # subject_name, n_videos, n_bl1_videos, n_reference_videos, n_remaining_videos


def label_free_rows(frames: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """A frame table split into what a baseline selection may see: its rows without the class and label columns,
    and the BL1 mask (class NO_PAIN), the one label it needs."""
    missing = [column for column in (*VIDEO_KEYS, "class_name") if column not in frames.columns]
    if missing:
        raise ValueError(f"frame table is missing columns {missing}; it has {list(frames.columns)}")
    is_bl1 = (frames["class_name"] == NO_PAIN).to_numpy()
    return frames.drop(columns=[column for column in LABEL_COLUMNS if column in frames.columns]), is_bl1


def _person_key(subject: str) -> int:
    """A stable integer of a person's name (the same on every machine and Python run, unlike hash())."""
    return int.from_bytes(hashlib.sha256(str(subject).encode()).digest()[:8], "big")


def select_baseline(rows: pd.DataFrame, is_bl1: Sequence[bool] | np.ndarray, k: int, seed: int) -> BaselineSplit:
    """Choose k of each person's BL1 videos as their reference, drawn from (seed, person) alone (another person's
    rows do not change it), and take every crop of those videos out of the rows.

    `rows` (subject_name, sample_name, ...: crops, or one row per video) may not hold class or label columns: the
    only label this reads is `is_bl1`, one flag per row, the same for every crop of a video. A person with fewer
    than k BL1 videos is an error that names every such person and their count.
    """
    leaked = [column for column in LABEL_COLUMNS if column in rows.columns]
    if leaked:
        raise ValueError(f"a baseline selection reads only the BL1 mask, but the rows carry the label columns "
                         f"{leaked}: pass label_free_rows(frames)")
    missing = [column for column in VIDEO_KEYS if column not in rows.columns]
    if missing:
        raise ValueError(f"baseline rows are missing columns {missing}; they have {list(rows.columns)}")
    is_bl1 = np.asarray(is_bl1, dtype=bool)
    if is_bl1.shape != (len(rows),):
        raise ValueError(f"the BL1 mask has shape {is_bl1.shape}, the rows {len(rows)} rows")
    if k < 1:
        raise ValueError(f"personalise.k={k}: a baseline needs at least one reference video per person")
    videos = rows[VIDEO_KEYS].assign(is_bl1=is_bl1).groupby(VIDEO_KEYS, sort=True)["is_bl1"].agg(["min", "max"])
    mixed = videos.index[videos["min"] != videos["max"]]
    if len(mixed):
        raise ValueError("the BL1 mask differs between crops of one video: "
                         + ", ".join(f"{subject}/{sample}" for subject, sample in mixed[:10]))
    chosen, record, short = [], [], []
    for subject, flags in videos["max"].groupby(level="subject_name", sort=True):
        bl1_videos = sorted(flags.index.get_level_values("sample_name")[flags.to_numpy()])
        if len(bl1_videos) < k:
            short.append(f"{subject} ({len(bl1_videos)})")
            continue
        rng = np.random.default_rng(derived_seed(seed, _person_key(subject)))
        # the first k of one order per person: a larger k keeps the smaller k's references (k=1 within k=2 within
        # k=4), so CVs of several k share every video none of them took as a reference
        picked = sorted(bl1_videos[int(i)] for i in rng.permutation(len(bl1_videos))[:k])
        chosen += [(subject, sample) for sample in picked]
        record.append({"subject_name": subject, "n_videos": len(flags), "n_bl1_videos": len(bl1_videos),
                       "n_reference_videos": k, "n_remaining_videos": len(flags) - k})
    if short:
        raise ValueError(f"personalise=baseline with k={k}: these people have fewer BL1 videos than k (their count "
                         f"in brackets): {', '.join(short)}; lower personalise.k or leave them out")
    in_reference = pd.MultiIndex.from_frame(rows[VIDEO_KEYS]).isin(pd.MultiIndex.from_tuples(chosen,
                                                                                             names=VIDEO_KEYS))
    return BaselineSplit(rows[in_reference], rows[~in_reference], pd.DataFrame(
        record, columns=["subject_name", "n_videos", "n_bl1_videos", "n_reference_videos", "n_remaining_videos"]))


def reference_means(subjects: np.ndarray, features: np.ndarray) -> dict[str, np.ndarray]:
    """Each person's mean reference embedding, from the reference rows' subjects and features."""
    subjects, features = _check_features(subjects, features, "reference_means")
    return {str(subject): features[subjects == subject].mean(axis=0) for subject in np.unique(subjects)}


def relative_to_reference(subjects: np.ndarray, features: np.ndarray, means: Mapping[str, np.ndarray]) -> np.ndarray:
    """Each row's features minus its person's reference mean (`reference_means`); a person without one is an error
    naming them."""
    subjects, features = _check_features(subjects, features, "relative_to_reference")
    people = [str(subject) for subject in np.unique(subjects)]
    without = [person for person in people if person not in means]
    if without:
        raise ValueError(f"no baseline reference for {', '.join(without)}")
    out = np.empty_like(features)
    for person in people:
        rows = subjects.astype(str) == person
        out[rows] = features[rows] - np.asarray(means[person], dtype=float)
    return out


@dataclass(frozen=True)
class ReferenceStatistics:
    """A person's resting reference for a new recording: the mean and standard deviation of its embeddings."""

    mean: np.ndarray  # (D,)
    sd: np.ndarray  # (D,)
    n_recordings: int
    n_rows: int
    folder: Path

    def relative(self, features: np.ndarray) -> np.ndarray:
        """`features` (N, D) minus the reference mean, as `relative_to_reference` does in a cross-validation."""
        features = np.asarray(features, dtype=float)
        if features.ndim != 2 or features.shape[1] != len(self.mean):
            raise ValueError(f"features of shape {features.shape} against a reference of {len(self.mean)} dimensions "
                             f"({self.folder})")
        return features - self.mean

    def applied(self, features: np.ndarray, config: PersonaliseConfig) -> np.ndarray:
        """`features` (N, D) as protocol `config` showed its training crops to the head (`Protocol.applied`)."""
        return config.protocol.applied(self, features)


NO_REFERENCE = ("it scores a person against their own recordings; give a folder of them: make predict "
                "REFERENCE=<folder of the person's recordings> (videos, or .npy embeddings)")


def no_reference(config: PersonaliseConfig) -> str:
    """What to say when a personalised model has no reference to score against."""
    return f"this model is personalised ({config.label}, the person's {config.protocol.reference}): {NO_REFERENCE}"


def not_served(config: PersonaliseConfig) -> str:
    """Why a personalised model is not served or exported: a request carries frames, not the person's recordings."""
    return (f"this model is personalised ({config.label}): it scores a person against their own recordings, which a "
            f"scoring request or an exported network does not take; score with make predict REFERENCE=<folder of "
            f"the person's recordings>")


def reference_statistics(folder: str | Path | None,
                         embed: Callable[[Path], np.ndarray] | None = None) -> ReferenceStatistics:
    """The reference of `folder`, a person's resting recordings: `.npy` files of embeddings (N, D) or (D,), and any
    other file (a video, a crop) through `embed` (a path to its embeddings (N, D): make predict's face search, crop
    and backbone). None, a missing or an empty folder is an error saying what to give."""
    if folder is None or str(folder).strip() == "":
        raise ValueError(f"no reference: {NO_REFERENCE}")
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"reference folder {folder} does not exist or is not a folder: {NO_REFERENCE}")
    files = sorted(path for path in folder.iterdir() if path.is_file() and not path.name.startswith("."))
    if not files:
        raise ValueError(f"reference folder {folder} holds no recordings: {NO_REFERENCE}")
    others = [path.name for path in files if path.suffix != ".npy"]
    if others and embed is None:
        raise ValueError(f"reference folder {folder}: {', '.join(others[:5])} are not embeddings (.npy) and no "
                         f"embedding function was given to read them")
    parts = []
    for path in files:
        if path.suffix == ".npy":
            loaded = np.load(path, allow_pickle=False)
        else:
            assert embed is not None  # checked above: every file that is not .npy goes through it
            loaded = embed(path)
        values = np.atleast_2d(np.asarray(loaded, dtype=float))
        if values.ndim != 2 or len(values) == 0 or not np.isfinite(values).all():
            raise ValueError(f"reference recording {path}: expected finite embeddings (N, D), got shape "
                             f"{values.shape}")
        if parts and values.shape[1] != parts[0].shape[1]:
            raise ValueError(f"reference recording {path}: {values.shape[1]} dimensions, the folder's first file "
                             f"{parts[0].shape[1]}")
        parts.append(values)
    stacked = np.concatenate(parts)
    return ReferenceStatistics(stacked.mean(axis=0), stacked.std(axis=0), len(parts), len(stacked), folder)


# ---------------------------------------------------------------------------------------------------------------
# The protocols

Change = Callable[[np.ndarray], np.ndarray]  # a split's features (N, D) -> as the head sees them


class Protocol:
    """No protocol (`none`): every crop as the backbone embeds it. The base of the protocols."""

    name: ClassVar[str] = "none"
    personal: ClassVar[bool] = False  # a person is seen against their own statistics
    reference: ClassVar[str] = ""  # what of a person's own recordings it reads, in words

    def check(self, config: PersonaliseConfig) -> None:
        """Refuse settings this protocol cannot run with."""

    def label(self, config: PersonaliseConfig) -> str:
        return self.name

    def take_reference(self, rows: pd.DataFrame, config: PersonaliseConfig) -> tuple[pd.DataFrame, pd.DataFrame] | None:
        """A split's frame rows without each person's reference videos, and those videos' rows; None: it takes
        none out."""
        return None

    def split_transform(self, subjects: np.ndarray, plain: np.ndarray, reference_subjects: np.ndarray,
                        reference_features: np.ndarray) -> Change | None:
        """How a split's embeddings (`plain`, one row per crop of `subjects`) are shown to the head, given its
        reference crops (none where `take_reference` took none); None: as they are."""
        return None

    def applied(self, statistics: ReferenceStatistics, features: np.ndarray) -> np.ndarray:
        """A new person's `features` (N, D) against their reference (`reference_statistics`)."""
        raise ValueError(f"personalise={self.name}: a plain model takes no reference")


PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(protocol: type[Protocol]) -> type[Protocol]:
    """Add a protocol that `personalise.mode` may name (its `name`; a name already taken is an error)."""
    if protocol.name in PROTOCOLS:
        raise ValueError(f"a personalisation protocol named {protocol.name!r} exists already")
    PROTOCOLS[protocol.name] = protocol()
    return protocol


NONE = register_protocol(Protocol).name


@register_protocol
class SubjectNormalised(Protocol):
    """Each person's embeddings standardised by their own mean and spread (`subject_normalise`)."""

    name = "subject_normalised"
    personal = True
    reference = "unlabelled recordings, their mean and spread the statistics"

    def split_transform(self, subjects: np.ndarray, plain: np.ndarray, reference_subjects: np.ndarray,
                        reference_features: np.ndarray) -> Change | None:
        statistics = subject_statistics(subjects, plain)
        return lambda features: standardised(subjects, features, statistics)

    def applied(self, statistics: ReferenceStatistics, features: np.ndarray) -> np.ndarray:
        """Standardised by the reference's mean and spread, a constant dimension centred only (as
        `subject_statistics` does)."""
        return statistics.relative(features) / np.where(statistics.sd > 0, statistics.sd, 1.0)


@register_protocol
class Baseline(Protocol):
    """k of each person's BL1 videos as their resting reference, taken out of their rows (`select_baseline`); every
    other crop minus the reference mean (`relative_to_reference`)."""

    name = "baseline"
    personal = True
    reference = "resting (BL1) recordings, their mean the reference"

    def check(self, config: PersonaliseConfig) -> None:
        if config.k is None or config.k < 1 or config.seed is None:
            raise ValueError(f"personalise=baseline needs personalise.k >= 1 and personalise.seed, got k={config.k}, "
                             f"seed={config.seed}")

    def label(self, config: PersonaliseConfig) -> str:
        return f"baseline_k{config.k}"

    def take_reference(self, rows: pd.DataFrame, config: PersonaliseConfig) -> tuple[pd.DataFrame, pd.DataFrame] | None:
        """The selection sees the rows without their labels and the BL1 mask (`label_free_rows`), nothing else."""
        free, is_bl1 = label_free_rows(rows)
        assert config.k is not None and config.seed is not None  # checked by from_config
        split = select_baseline(free, is_bl1, config.k, config.seed)
        return rows.loc[split.remaining.index], rows.loc[split.reference.index]

    def split_transform(self, subjects: np.ndarray, plain: np.ndarray, reference_subjects: np.ndarray,
                        reference_features: np.ndarray) -> Change | None:
        means = reference_means(reference_subjects, reference_features)
        return lambda features: relative_to_reference(subjects, features, means)

    def applied(self, statistics: ReferenceStatistics, features: np.ndarray) -> np.ndarray:
        """Minus the reference mean."""
        return statistics.relative(features)
