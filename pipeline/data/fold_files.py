"""Evaluation protocols as data: fold files that assign whole subjects to train / val / test.

Folds are generated once (`make_folds`), reviewed, committed and from then on only read (`read_folds`), so every
backbone is compared on identical subject splits, and a leak (one person's frames on both sides of a split) fails
loudly every time a file is loaded (`pipeline.data.fold_checks.check_folds`). The parameters a fold file was made with
(protocol, seed, fractions) are recorded in a JSON sidecar beside it (`kfold5_all87.csv` -> `kfold5_all87.json`), so a
config asking for other ones is refused (`check_fold_parameters`) instead of silently getting the old folds. The
committed BioVid fold files, and the command that writes and checks them, are `pipeline.data.biovid_folds`'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.data.fold_checks import FOLD_COLUMNS, ROLES, FoldError, check_folds, where
from pipeline.utils.atomic_io import atomic_write_text
from pipeline.utils.digests import file_sha256

MIN_SUBJECTS = 3  # one train, one val and one test subject at the very least
STRATUM_SEPARATOR = "/"  # "w/age<=35": the part before the separator is the coarser stratum ("w")

_BIOVID_SUBJECT_NAME = re.compile(r"(?P<date>\d{6})_(?P<sex>[wm])_(?P<age>\d{1,3})")
_ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}

log = logging.getLogger(__name__)


# --- protocols -------------------------------------------------------------------------------------------------------


def protocol_spec(name: str) -> tuple[str, int | None]:
    """Split a protocol name into its kind and k: "loso" -> ("loso", None), "kfold5" -> ("kfold", 5)."""
    if isinstance(name, str):
        if name in ("loso", "holdout"):
            return name, None
        match = re.fullmatch(r"kfold([1-9][0-9]*)", name)
        if match and int(match.group(1)) >= 2:
            return "kfold", int(match.group(1))
    raise ValueError(f"unknown protocol {name!r}: expected 'loso', 'holdout' or 'kfold<k>' with k >= 2 (e.g. 'kfold5')")


def usable_strata(
    subjects: Sequence[str], strata: Mapping[str, str] | None, min_size: int
) -> tuple[dict[str, str], str]:
    """The finest stratification in which every stratum holds at least `min_size` of `subjects`.

    Tried in order: the labels as given ("full"), their part before the first '/' ("coarse", e.g. sex only), and one
    stratum for everybody ("none"), so stratifying never makes a small subject set fail.
    """
    if strata is not None:
        full = {subject: strata[subject] for subject in subjects}
        coarse = {subject: label.split(STRATUM_SEPARATOR, 1)[0] for subject, label in full.items()}
        for level, labels in (("full", full), ("coarse", coarse)):
            if min(Counter(labels.values()).values()) >= min_size:
                return labels, level
    return {subject: "" for subject in subjects}, "none"


def stratified_sample(
    pool: Sequence[str], n_pick: int, strata: Mapping[str, str] | None, rng: np.random.Generator
) -> list[str]:
    """Draw `n_pick` subjects from `pool`, each stratum represented in proportion to its size.

    Systematic sampling: every stratum's members get evenly spaced keys in [0, 1) with a random start, and the
    smallest keys win, so a stratum of size s contributes n_pick * s / len(pool) subjects, rounded up or down.
    """
    labels, _ = usable_strata(pool, strata, min_size=1)
    keyed: list[tuple[float, float, str]] = []
    for label in sorted(set(labels.values())):
        members = sorted(subject for subject in pool if labels[subject] == label)
        start = rng.random()
        for rank, index in enumerate(rng.permutation(len(members))):
            keyed.append(((rank + start) / len(members), rng.random(), members[index]))
    keyed.sort()
    return sorted(subject for _, _, subject in keyed[:n_pick])


def _kfold_test_sets(
    subjects: Sequence[str], k: int, strata: Mapping[str, str] | None, rng: np.random.Generator
) -> list[list[str]]:
    """Deal subjects to k test folds round-robin, stratum after stratum, so every fold gets its share of each."""
    labels, _ = usable_strata(subjects, strata, min_size=k)
    dealing_order: list[str] = []
    for label in sorted(set(labels.values())):
        members = sorted(subject for subject in subjects if labels[subject] == label)
        dealing_order.extend(members[index] for index in rng.permutation(len(members)))
    fold_of_turn = rng.permutation(k)  # which fold gets the extra subject when n is not a multiple of k is random
    test_sets: list[list[str]] = [[] for _ in range(k)]
    for turn, subject in enumerate(dealing_order):
        test_sets[int(fold_of_turn[turn % k])].append(subject)
    return [sorted(test_set) for test_set in test_sets]


def _validated_subjects(subjects: Sequence[str]) -> list[str]:
    if isinstance(subjects, str):
        raise ValueError(f"subjects must be a sequence of subject names, not the single string {subjects!r}")
    names = list(subjects)
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"invalid subject name {name!r}: must be a non-empty string without surrounding spaces")
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise ValueError(f"subject names must be unique; duplicated: {duplicates[:5]}")
    return sorted(names)


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")


def make_folds(
    subjects: Sequence[str],
    protocol: str,
    *,
    seed: int = 0,
    val_fraction: float = 0.15,
    test_fraction: float = 0.3,
    strata: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Assign whole subjects to train / val / test for every fold of `protocol` (loso, kfold<k>, holdout).

    loso: one fold per subject (in name order). kfold<k>: subject-grouped k-fold, stratified over `strata`
    (subject -> label such as "w/age<=35") at the finest level where every stratum has >= k subjects (see
    `usable_strata`). holdout: one fold with round(test_fraction * n) test subjects (87 -> 61/26), stratified.
    Every fold then carves max(1, round(val_fraction * n_non_test)) val subjects, stratified, out of its non-test
    subjects, for early stopping and checkpoint selection. The result depends only on the subject set, the
    arguments and `seed`; rows are sorted by fold, role (train, val, test) and subject name.
    """
    kind, k = protocol_spec(protocol)
    names = _validated_subjects(subjects)
    _check_fraction("val_fraction", val_fraction)
    _check_fraction("test_fraction", test_fraction)
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    n = len(names)
    if n < MIN_SUBJECTS:
        raise ValueError(f"protocol {protocol!r} needs at least {MIN_SUBJECTS} subjects (train, val, test), got {n}")
    if strata is not None:
        unlabelled = [name for name in names if name not in strata]
        if unlabelled:
            raise ValueError(f"strata has no label for {len(unlabelled)} subject(s), e.g. {unlabelled[:5]}")

    rng = np.random.default_rng(seed)
    if kind == "loso":
        test_sets = [[name] for name in names]
    elif kind == "kfold":
        assert k is not None
        if k > n:
            raise ValueError(f"protocol {protocol!r} needs at least {k} subjects (one test subject per fold), got {n}")
        if n - math.ceil(n / k) < 2:
            raise ValueError(
                f"protocol {protocol!r} on {n} subjects leaves {n - math.ceil(n / k)} non-test subject(s) "
                "in the largest fold; need at least 2 (one train, one val)"
            )
        test_sets = _kfold_test_sets(names, k, strata, rng)
    else:
        n_test = min(max(1, round(test_fraction * n)), n - 2)
        test_sets = [stratified_sample(names, n_test, strata, rng)]

    rows: list[tuple[int, str, str]] = []
    for fold, test_set in enumerate(test_sets):
        tested = set(test_set)
        non_test = [name for name in names if name not in tested]
        n_val = min(max(1, round(val_fraction * len(non_test))), len(non_test) - 1)
        val_set = set(stratified_sample(non_test, n_val, strata, rng))
        rows.extend((fold, name, "test") for name in test_set)
        rows.extend((fold, name, "val" if name in val_set else "train") for name in non_test)
    return _sorted_fold_table(pd.DataFrame(rows, columns=list(FOLD_COLUMNS)))


def _sorted_fold_table(folds: pd.DataFrame) -> pd.DataFrame:
    table = folds.loc[:, list(FOLD_COLUMNS)].astype({"fold": "int64", "subject_name": str, "role": str})
    order = np.lexsort(
        (table["subject_name"].to_numpy(), table["role"].map(_ROLE_RANK).to_numpy(), table["fold"].to_numpy())
    )
    return table.iloc[order].reset_index(drop=True)


# --- files -----------------------------------------------------------------------------------------------------------


def fold_parameters(
    protocol: str, seed: int, val_fraction: float, test_fraction: float | None = None
) -> dict[str, Any]:
    """The `make_folds` arguments that decide a fold file (`make_folds(subjects, **parameters, strata=...)`), as
    recorded in its sidecar and compared on every read.

    test_fraction is kept only for hold-out, the one protocol it changes (LOSO and k-fold choose their own test sets).
    """
    kind, _ = protocol_spec(protocol)
    parameters: dict[str, Any] = {"protocol": protocol, "seed": int(seed), "val_fraction": float(val_fraction)}
    if kind == "holdout":
        if test_fraction is None:
            raise ValueError("protocol 'holdout' needs a test_fraction")
        parameters["test_fraction"] = float(test_fraction)
    return parameters


def parameters_path(fold_file: Path) -> Path:
    """The sidecar that records how a fold file was made: kfold5_all87.csv -> kfold5_all87.json."""
    return Path(fold_file).with_suffix(".json")


def write_folds(folds: pd.DataFrame, path: Path, parameters: Mapping[str, Any] | None = None,
                excluded: Mapping[str, str] | None = None) -> None:
    """Check `folds`, then write them atomically as CSV with '\\n' line ends (byte-identical on every platform).

    With `parameters` (from `fold_parameters`), the sidecar is written too: those parameters, the number of subjects,
    the CSV's SHA-256 and, when given, `excluded` (participants left out of the subject set -> why) as
    "excluded_subjects". It is written first, so a run killed in between leaves no fold file that a stale record
    would seem to describe; without `parameters`, a sidecar left by an earlier file is removed.
    """
    check_folds(folds, source=str(path))
    text = folds.loc[:, list(FOLD_COLUMNS)].to_csv(index=False, lineterminator="\n")
    sidecar = parameters_path(path)
    if parameters is None:
        sidecar.unlink(missing_ok=True)
    else:
        record = {
            **parameters,
            "n_subjects": int(folds["subject_name"].nunique()),
            "fold_file_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            **({"excluded_subjects": dict(sorted(excluded.items()))} if excluded else {}),
        }
        atomic_write_text(sidecar, json.dumps(record, indent=2) + "\n")
    atomic_write_text(path, text)


def read_fold_parameters(path: Path) -> dict[str, Any] | None:
    """The parameters recorded beside a fold file, or None when it has no sidecar (files written before sidecars).

    A sidecar whose SHA-256 is not the fold file's is an error: the file was changed after the record was written.
    """
    path, sidecar = Path(path), parameters_path(path)
    if not sidecar.is_file():
        return None
    try:
        recorded = json.loads(sidecar.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise FoldError(f"{sidecar}: not valid JSON ({error})") from error
    if not isinstance(recorded, dict) or "fold_file_sha256" not in recorded:
        raise FoldError(f"{sidecar}: expected a JSON object with the fold parameters and 'fold_file_sha256'")
    actual = fold_file_sha256(path)
    if recorded["fold_file_sha256"] != actual:
        raise FoldError(
            f"{path}: SHA-256 {actual} differs from the {recorded['fold_file_sha256']} recorded in {sidecar}; "
            "the fold file was changed after it was written, so the parameters recorded there may not describe it"
        )
    return recorded


def check_fold_parameters(path: Path, expected: Mapping[str, Any], remedy: str = "") -> None:
    """Refuse a fold file whose recorded parameters differ from `expected` (a `fold_parameters` dict).

    The message names the fold file, its sidecar, and every differing key with both values, then `remedy` (how to
    get a fold file with the expected parameters). A fold file without a sidecar is accepted with a warning.
    """
    recorded = read_fold_parameters(path)
    if recorded is None:
        log.warning(
            "%s has no parameter record %s (written before fold files had one): cannot check that it was made "
            "with %s", path, parameters_path(path).name, ", ".join(f"{k}={v}" for k, v in expected.items())
        )
        return
    keys = [key for key in ("protocol", "seed", "val_fraction", "test_fraction") if key in expected or key in recorded]
    differing = [
        f"{key}: file {recorded.get(key, 'not recorded')!r}, config {expected.get(key, 'not applicable')!r}"
        for key in keys
        if recorded.get(key) != expected.get(key)
    ]
    if differing:
        raise FoldError(
            f"{path} was made with other fold parameters than the config asks for (recorded in "
            f"{parameters_path(path)}): {'; '.join(differing)}. {remedy}".rstrip()
        )


def read_folds(path: Path, subjects: Iterable[str] | None = None) -> pd.DataFrame:
    """Read and fully check a fold file (columns, types, roles, then `check_folds`), on every load."""
    path = Path(path)
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError as error:
        raise FoldError(f"{path}: empty file, expected a header {','.join(FOLD_COLUMNS)}") from error
    except pd.errors.ParserError as error:
        raise FoldError(f"{path}: not a well-formed CSV: {error}") from error
    missing = [column for column in FOLD_COLUMNS if column not in raw.columns]
    extra = [column for column in raw.columns if column not in FOLD_COLUMNS]
    if missing or extra:
        problems = [f"missing column(s) {missing}"] if missing else []
        problems += [f"extra column(s) {extra}"] if extra else []
        raise FoldError(f"{path}: {'; '.join(problems)}; expected exactly {list(FOLD_COLUMNS)}")

    for column in FOLD_COLUMNS:
        absent = (raw[column].isna() | (raw[column] == "")).to_numpy().nonzero()[0]
        if len(absent):
            raise FoldError(
                f"{where(str(path), int(absent[0]) + 1)}: no value in column {column!r} (empty cell or short row)"
            )
    not_integer = ~raw["fold"].str.fullmatch(r"[0-9]+")
    if not_integer.any():
        row = int(not_integer.to_numpy().nonzero()[0][0])
        raise FoldError(
            f"{where(str(path), row + 1)}, subject {raw['subject_name'].iloc[row]!r}: fold "
            f"{raw['fold'].iloc[row]!r} is not a non-negative integer"
        )

    folds = raw.loc[:, list(FOLD_COLUMNS)].astype({"fold": "int64", "subject_name": str, "role": str})
    check_folds(folds, source=str(path), subjects=subjects)
    return folds


def fold_subjects(folds: pd.DataFrame, fold: int) -> dict[str, list[str]]:
    """Role -> sorted subject names of one fold."""
    in_fold = folds[folds["fold"] == fold]
    if in_fold.empty:
        raise ValueError(f"fold {fold} is not in the fold table (folds: {sorted(folds['fold'].unique().tolist())})")
    return {role: sorted(in_fold.loc[in_fold["role"] == role, "subject_name"].tolist()) for role in ROLES}


def tested_in(folds: pd.DataFrame) -> dict[str, int]:
    """Subject -> the fold that tests it (role `test`): the fold whose trained models score that subject."""
    tested = folds[folds["role"] == "test"]
    return dict(zip(tested["subject_name"], tested["fold"].astype(int), strict=True))


def fold_file_sha256(path: Path) -> str:
    """Hex SHA-256 of a fold file's bytes: logged with each run to prove which split it used."""
    return file_sha256(path)


# --- strata of BioVid subject names ---------------------------------------------------------------------------------


def _age_band(age: int) -> str:
    if age <= 35:
        return "age<=35"
    return "age36-50" if age <= 50 else "age>50"


def subject_strata(subject_names: Iterable[str]) -> dict[str, str]:
    """Stratum label "sex/age band" (e.g. "w/age<=35") per BioVid subject name MMDDYY_sex_age."""
    strata: dict[str, str] = {}
    for name in subject_names:
        match = _BIOVID_SUBJECT_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"subject name {name!r} is not BioVid's MMDDYY_sex_age (e.g. '071309_w_21')")
        strata[name] = f"{match['sex']}{STRATUM_SEPARATOR}{_age_band(int(match['age']))}"
    return strata
