"""BioVid Heat Pain Database, Part A: read `samples.csv`, validate it against the videos on disk, pick a subject set.

The same code reads the real database and the synthetic twin, which is written in the identical layout::

    <root>/starting_point/samples.csv           TAB-separated, header row
    <root>/video/<subject_name>/<sample_name>.mp4
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pipeline.data.tasks import CLASS_NAMES

log = logging.getLogger(__name__)

SAMPLES_CSV = Path("starting_point") / "samples.csv"
VIDEO_DIR = Path("video")
SAMPLES_COLUMNS: tuple[str, ...] = ("subject_id", "subject_name", "class_id", "class_name", "sample_id", "sample_name")
SUBJECT_NAME = re.compile(r"^\d{6}_[wm]_\d{2}$")

# The 20 participants without a facial response to the stimuli; the 67-subject set excludes them.
NON_RESPONDERS: frozenset[str] = frozenset(
    """082315_w_60 082414_m_64 082909_m_47 083009_w_42 083013_w_47 083109_m_60 083114_w_55
    091914_m_46 092009_m_54 092014_m_56 092509_w_51 092714_m_64 100514_w_51 100914_m_39
    101114_w_37 101209_w_61 101809_m_59 101916_m_40 111313_m_64 120614_w_61""".split()
)
SUBJECT_SETS = ("all", "all87", "responders67")


class BioVidError(ValueError):
    """The folder or its samples.csv is not what BioVid Part A's layout promises."""


@dataclass
class ValidationReport:
    """What validation skipped or noticed; every entry names the file (and the samples.csv row where there is one)."""

    samples_csv: Path
    missing_videos: list[tuple[int, str]] = field(default_factory=list)  # (csv line, path) listed but not on disk
    empty_videos: list[tuple[int, str]] = field(default_factory=list)  # (csv line, path) zero bytes
    unlisted_videos: list[str] = field(default_factory=list)  # on disk, not in samples.csv
    excluded_subjects: list[str] = field(default_factory=list)  # dropped by the subject set

    @property
    def n_skipped(self) -> int:
        return len(self.missing_videos) + len(self.empty_videos)

    def lines(self) -> list[str]:
        """Human-readable summary lines (empty when there is nothing to report)."""
        out = []
        for title, rows in (("listed in samples.csv but missing on disk", self.missing_videos),
                            ("zero-byte video files", self.empty_videos)):
            if rows:
                out.append(f"skipped {len(rows)} sample(s), {title}:")
                out += [f"  {self.samples_csv}:{line}: {path}" for line, path in rows[:20]]
                if len(rows) > 20:
                    out.append(f"  ... and {len(rows) - 20} more")
        if self.unlisted_videos:
            out.append(f"ignored {len(self.unlisted_videos)} video(s) on disk that samples.csv does not list:")
            out += [f"  {path}" for path in self.unlisted_videos[:20]]
            if len(self.unlisted_videos) > 20:
                out.append(f"  ... and {len(self.unlisted_videos) - 20} more")
        return out


def check_root(root: str | Path) -> Path:
    """Fail early, with the expected layout in the message, when `root` is not a BioVid Part A folder."""
    root = Path(root).expanduser()
    expected = f"expected {root / SAMPLES_CSV} and {root / VIDEO_DIR}/<subject>/<sample>.mp4"
    if not root.is_dir():
        raise BioVidError(f"BioVid root {root} does not exist or is not a folder ({expected})")
    if not (root / SAMPLES_CSV).is_file() or not (root / VIDEO_DIR).is_dir():
        raise BioVidError(f"{root} is not a BioVid Part A folder: {expected}")
    return root


def read_samples_csv(path: str | Path) -> pd.DataFrame:
    """Read and validate samples.csv row by row; errors name the file and the line."""
    path = Path(path)
    try:
        table = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError) as error:
        raise BioVidError(f"{path}: cannot be parsed as a TAB-separated table: {error}") from error
    columns = [str(c).strip() for c in table.columns]
    if len(columns) == 1 and "," in columns[0]:
        raise BioVidError(f"{path}: the header has no TAB; samples.csv is TAB-separated (found commas)")
    missing = [c for c in SAMPLES_COLUMNS if c not in columns]
    extra = [c for c in columns if c not in SAMPLES_COLUMNS]
    if missing or extra:
        raise BioVidError(f"{path}: expected columns {', '.join(SAMPLES_COLUMNS)}; "
                          f"missing: {missing or 'none'}, unexpected: {extra or 'none'}")
    table.columns = columns
    table = table[list(SAMPLES_COLUMNS)].apply(lambda column: column.str.strip())
    if table.empty:
        raise BioVidError(f"{path}: no samples listed")

    seen: dict[str, int] = {}
    for index, row in enumerate(table.itertuples(index=False)):
        line = index + 2  # 1-based, after the header
        where = f"{path}:{line}"
        if row.class_name not in CLASS_NAMES:
            raise BioVidError(f"{where}: unknown class {row.class_name!r} (known: {', '.join(CLASS_NAMES)})")
        for column in ("subject_id", "class_id", "sample_id"):
            if not getattr(row, column).lstrip("-").isdigit():
                raise BioVidError(f"{where}: {column} {getattr(row, column)!r} is not an integer")
        if int(row.class_id) != CLASS_NAMES.index(row.class_name):
            raise BioVidError(f"{where}: class_id {row.class_id} does not match class_name {row.class_name} "
                              f"(expected {CLASS_NAMES.index(row.class_name)})")
        if not row.subject_name or not row.sample_name:
            raise BioVidError(f"{where}: empty subject_name or sample_name")
        if not row.sample_name.startswith(f"{row.subject_name}-{row.class_name}"):
            raise BioVidError(f"{where}: sample_name {row.sample_name!r} does not belong to subject "
                              f"{row.subject_name!r} and class {row.class_name!r}")
        if row.sample_name in seen:
            first = seen[row.sample_name]
            raise BioVidError(f"{where}: sample {row.sample_name} is listed twice (first at line {first})")
        seen[row.sample_name] = line
    for column in ("subject_id", "class_id", "sample_id"):
        table[column] = table[column].astype(int)
    table["csv_line"] = range(2, len(table) + 2)
    return table


def load_samples(root: str | Path, subject_set: str = "all") -> tuple[pd.DataFrame, ValidationReport]:
    """The sample table of a BioVid-layout folder, validated against the videos on disk.

    Listed videos that are missing or empty are skipped and reported; videos on disk that samples.csv does not list
    are reported and ignored. Returns the sample table (SAMPLES_COLUMNS + video_path) and the report.
    """
    if subject_set not in SUBJECT_SETS:
        raise BioVidError(f"unknown subject set {subject_set!r}; known: {', '.join(SUBJECT_SETS)}")
    root = check_root(root)
    samples_csv = root / SAMPLES_CSV
    table = read_samples_csv(samples_csv)
    report = ValidationReport(samples_csv=samples_csv)

    table["video_path"] = [str((root / VIDEO_DIR / s / f"{n}.mp4").resolve())
                           for s, n in zip(table.subject_name, table.sample_name, strict=True)]
    keep = []
    for row in table.itertuples(index=False):
        video = Path(row.video_path)
        if not video.is_file():
            report.missing_videos.append((row.csv_line, str(video)))
        elif video.stat().st_size == 0:
            report.empty_videos.append((row.csv_line, str(video)))
        else:
            keep.append(True)
            continue
        keep.append(False)
    listed = set(table.video_path)
    report.unlisted_videos = sorted(str(p.resolve()) for p in (root / VIDEO_DIR).glob("*/*.mp4")
                                    if str(p.resolve()) not in listed)
    table = table[keep]
    if table.empty:
        raise BioVidError(f"{samples_csv}: none of the {len(keep)} listed videos exists under {root / VIDEO_DIR}")

    if subject_set == "responders67":
        report.excluded_subjects = sorted(set(table.subject_name) & NON_RESPONDERS)
        table = table[~table.subject_name.isin(NON_RESPONDERS)]
    for line in report.lines():
        log.warning(line)
    return table.drop(columns="csv_line").reset_index(drop=True), report
