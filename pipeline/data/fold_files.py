"""Evaluation protocols as data: fold files that assign whole subjects to train / val / test.

Folds are generated once (`make_folds`), reviewed, committed and from then on only read (`read_folds`), so every
backbone is compared on identical subject splits, and a leak (one person's frames on both sides of a split) fails
loudly every time a file is loaded. The parameters a fold file was made with (protocol, seed, fractions) are recorded
in a JSON sidecar beside it (`kfold5_all87.csv` -> `kfold5_all87.json`), so a config asking for other ones is refused
(`check_fold_parameters`) instead of silently getting the old folds.

    python -m pipeline fold-files write-biovid              # regenerate data_manifests/biovid/*.csv and *.json (seed 0)
    python -m pipeline fold-files check PATH... [--subject-set all87]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.data.biovid import NON_RESPONDERS
from pipeline.utils.atomic_io import atomic_write_text
from pipeline.utils.paths import PROJECT_ROOT

ROLES = ("train", "val", "test")
FOLD_COLUMNS = ("fold", "subject_name", "role")
MIN_SUBJECTS = 3  # one train, one val and one test subject at the very least
STRATUM_SEPARATOR = "/"  # "w/age<=35": the part before the separator is the coarser stratum ("w")

SUBJECT_SETS = ("all87", "responders67")  # the committed ones
USABLE_SUFFIX = "_usable"
"""`all87_usable`, `responders67_usable`: the participants of the set that have face crops. Their fold files are not
committed: written once on first use (outside data_manifests/), with the excluded participants and why recorded in the
sidecar, then only read like any other."""
USABLE_SUBJECT_SETS = tuple(f"{name}{USABLE_SUFFIX}" for name in SUBJECT_SETS)
BIOVID_PROTOCOLS = ("loso", "kfold5", "kfold10", "holdout")
BIOVID_SEED = 0
BIOVID_VAL_FRACTION = 0.15
BIOVID_TEST_FRACTION = 0.3
BIOVID_MANIFEST_DIR = PROJECT_ROOT / "data_manifests" / "biovid"
BIOVID_SUBJECTS_CSV = BIOVID_MANIFEST_DIR / "subjects.csv"

_BIOVID_SUBJECT_NAME = re.compile(r"(?P<date>\d{6})_(?P<sex>[wm])_(?P<age>\d{1,3})")
_ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}

log = logging.getLogger(__name__)


class FoldError(ValueError):
    """A fold table breaks the fold contract; the message names the file, the row, the fold and the subject."""


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


# --- checking --------------------------------------------------------------------------------------------------------


def _where(source: str, row: int) -> str:
    """Locate a 1-based data row; in a file, data row r sits on line r + 1 (after the header)."""
    if source == "<memory>":
        return f"{source}, row {row}"
    return f"{source}, data row {row} (line {row + 1})"


def check_folds(folds: pd.DataFrame, source: str = "<memory>", subjects: Iterable[str] | None = None) -> None:
    """Raise FoldError unless `folds` is a leak-free fold table (over `subjects`, when given).

    Checks: known roles; no subject twice in one fold (in particular not in two roles: a train/val/test leak); every
    subject in every fold; every fold with train, val and test subjects; with `subjects`, the file's subjects are
    exactly the dataset's; and in a multi-fold file whose test sets cover all subjects (loso, kfold) each subject
    is test exactly once.
    """
    missing_columns = [column for column in FOLD_COLUMNS if column not in folds.columns]
    if missing_columns:
        raise FoldError(f"{source}: missing column(s) {missing_columns}; expected {list(FOLD_COLUMNS)}")
    if folds.empty:
        raise FoldError(f"{source}: no rows")
    if not pd.api.types.is_integer_dtype(folds["fold"]):
        raise FoldError(f"{source}: column 'fold' must hold integers, found dtype {folds['fold'].dtype}")

    role_and_row: dict[tuple[int, str], tuple[str, int]] = {}
    first_row: dict[str, int] = {}
    members: dict[int, dict[str, list[str]]] = {}
    rows = zip(folds["fold"].tolist(), folds["subject_name"].tolist(), folds["role"].tolist(), strict=True)
    for row, (fold, subject, role) in enumerate(rows, start=1):
        where = _where(source, row)
        if fold < 0:
            raise FoldError(f"{where}, subject {subject!r}: negative fold {fold}")
        if not isinstance(subject, str) or not subject or subject != subject.strip():
            raise FoldError(
                f"{where}, fold {fold}: invalid subject_name {subject!r} "
                "(must be a non-empty name without surrounding spaces)"
            )
        if role not in ROLES:
            raise FoldError(
                f"{where}, fold {fold}, subject {subject!r}: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        if (fold, subject) in role_and_row:
            earlier_role, earlier_row = role_and_row[(fold, subject)]
            if earlier_role != role:
                raise FoldError(
                    f"{where}, fold {fold}, subject {subject!r}: leak, subject is both {earlier_role} "
                    f"(row {earlier_row}) and {role} in the same fold"
                )
            raise FoldError(
                f"{where}, fold {fold}, subject {subject!r}: listed twice as {role} "
                f"(also row {earlier_row}); each subject appears once per fold"
            )
        role_and_row[(fold, subject)] = (role, row)
        first_row.setdefault(subject, row)
        members.setdefault(fold, {r: [] for r in ROLES})[role].append(subject)

    file_subjects = set(first_row)
    if subjects is not None:
        dataset_subjects = set(subjects)
        unknown = sorted(file_subjects - dataset_subjects, key=first_row.__getitem__)
        if unknown:
            subject = unknown[0]
            fold = folds["fold"].iloc[first_row[subject] - 1]
            raise FoldError(
                f"{_where(source, first_row[subject])}, fold {fold}, subject {subject!r}: not in the "
                f"dataset ({len(unknown)} such subject(s), first few: {unknown[:5]})"
            )
        absent = sorted(dataset_subjects - file_subjects)
        if absent:
            raise FoldError(
                f"{source}: {len(absent)} dataset subject(s) missing from the fold file, "
                f"e.g. subject {absent[0]!r} (first few: {absent[:5]})"
            )

    for fold in sorted(members):
        by_role = members[fold]
        in_fold = {subject for role_subjects in by_role.values() for subject in role_subjects}
        absent = sorted(file_subjects - in_fold)
        if absent:
            raise FoldError(
                f"{source}, fold {fold}, subject {absent[0]!r}: missing from this fold "
                f"({len(absent)} missing; every subject must appear exactly once per fold)"
            )
        for role in ROLES:
            if not by_role[role]:
                raise FoldError(f"{source}, fold {fold}: no {role} subjects (every fold needs train, val and test)")

    tested_in: dict[str, int] = {}
    if len(members) > 1 and {s for by_role in members.values() for s in by_role["test"]} == file_subjects:
        for fold in sorted(members):
            for subject in members[fold]["test"]:
                if subject in tested_in:
                    row = role_and_row[(fold, subject)][1]
                    raise FoldError(
                        f"{_where(source, row)}, fold {fold}, subject {subject!r}: test in fold "
                        f"{tested_in[subject]} too; in a loso/k-fold file every subject is test once"
                    )
                tested_in[subject] = fold


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
                f"{_where(str(path), int(absent[0]) + 1)}: no value in column {column!r} (empty cell or short row)"
            )
    not_integer = ~raw["fold"].str.fullmatch(r"[0-9]+")
    if not_integer.any():
        row = int(not_integer.to_numpy().nonzero()[0][0])
        raise FoldError(
            f"{_where(str(path), row + 1)}, subject {raw['subject_name'].iloc[row]!r}: fold "
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


def fold_file_sha256(path: Path) -> str:
    """Hex SHA-256 of a fold file's bytes: logged with each run to prove which split it used."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- BioVid ----------------------------------------------------------------------------------------------------------


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


def base_subject_set(subject_set: str) -> str:
    """The set a `<set>_usable` subject set is drawn from ("all87_usable" -> "all87"); other names are returned."""
    return subject_set.removesuffix(USABLE_SUFFIX)


def biovid_subjects(subject_set: str, subjects_csv: Path = BIOVID_SUBJECTS_CSV) -> list[str]:
    """Sorted subject names of a BioVid subject set: all87, or responders67 (without the 20 non-responders); for
    `<set>_usable`, the names of <set> (the ones without crops are dropped when its fold file is written).

    The non-responders are `pipeline.data.biovid.NON_RESPONDERS`; the file's facial_responder column must agree with
    them.
    """
    if subject_set not in SUBJECT_SETS + USABLE_SUBJECT_SETS:
        raise ValueError(f"unknown subject set {subject_set!r}: expected one of "
                         f"{', '.join(SUBJECT_SETS + USABLE_SUBJECT_SETS)}")
    subject_set = base_subject_set(subject_set)
    table = pd.read_csv(subjects_csv, dtype=str, keep_default_na=False)
    for column in ("subject_name", "facial_responder"):
        if column not in table.columns:
            raise ValueError(f"{subjects_csv}: missing column {column!r}")
    bad = ~table["facial_responder"].isin(["0", "1"])
    if bad.any():
        row = int(bad.to_numpy().nonzero()[0][0]) + 1
        raise ValueError(
            f"{_where(str(subjects_csv), row)}, subject {table['subject_name'].iloc[row - 1]!r}: "
            f"facial_responder must be 0 or 1, got {table['facial_responder'].iloc[row - 1]!r}"
        )
    duplicated = table["subject_name"][table["subject_name"].duplicated()].tolist()
    if duplicated:
        raise ValueError(f"{subjects_csv}: duplicated subject_name(s) {duplicated[:5]}")
    disagree = (table["facial_responder"] == "0") != table["subject_name"].isin(NON_RESPONDERS)
    if disagree.any():
        row = int(disagree.to_numpy().nonzero()[0][0]) + 1
        name = table["subject_name"].iloc[row - 1]
        raise ValueError(
            f"{_where(str(subjects_csv), row)}, subject {name!r}: facial_responder "
            f"{table['facial_responder'].iloc[row - 1]} disagrees with pipeline.data.biovid.NON_RESPONDERS "
            f"({'listed' if name in NON_RESPONDERS else 'not listed'} there)"
        )
    if subject_set == "responders67":
        table = table[~table["subject_name"].isin(NON_RESPONDERS)]
    return sorted(table["subject_name"].tolist())


def biovid_manifest_path(protocol: str, subject_set: str, manifest_dir: Path = BIOVID_MANIFEST_DIR) -> Path:
    """Where the committed fold file for a BioVid protocol and subject set lives."""
    return Path(manifest_dir) / f"{protocol}_{subject_set}.csv"


def biovid_fold_parameters(protocol: str) -> dict[str, Any]:
    """The parameters of the committed BioVid fold files (seed 0, val 15 %, hold-out test 30 %)."""
    return fold_parameters(protocol, BIOVID_SEED, BIOVID_VAL_FRACTION, BIOVID_TEST_FRACTION)


def make_biovid_folds(protocol: str, subject_set: str, subjects_csv: Path = BIOVID_SUBJECTS_CSV) -> pd.DataFrame:
    """The committed BioVid folds: `biovid_fold_parameters`, stratified by sex and age band."""
    names = biovid_subjects(subject_set, subjects_csv)
    return make_folds(names, **biovid_fold_parameters(protocol), strata=subject_strata(names))


def write_biovid_manifests(
    manifest_dir: Path = BIOVID_MANIFEST_DIR, subjects_csv: Path = BIOVID_SUBJECTS_CSV
) -> list[Path]:
    """(Re)write every committed BioVid fold file and its parameter sidecar; returns the fold files written."""
    written = []
    for subject_set in SUBJECT_SETS:
        for protocol in BIOVID_PROTOCOLS:
            path = biovid_manifest_path(protocol, subject_set, manifest_dir)
            write_folds(make_biovid_folds(protocol, subject_set, subjects_csv), path, biovid_fold_parameters(protocol))
            written.append(path)
    return written


# --- command line ----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline fold-files", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write-biovid", help="regenerate the committed BioVid fold files and sidecars")
    write.add_argument("--out-dir", type=Path, default=BIOVID_MANIFEST_DIR, help="default: %(default)s")
    check = commands.add_parser("check", help="validate fold files (and their sidecars); exit 1 if any is broken")
    check.add_argument("paths", nargs="+", type=Path)
    check.add_argument("--subject-set", choices=SUBJECT_SETS, help="also require exactly this BioVid subject set")
    args = parser.parse_args(argv)

    if args.command == "write-biovid":
        for path in write_biovid_manifests(args.out_dir):
            print(f"wrote {path}  sha256 {fold_file_sha256(path)}")
        return 0

    subjects = biovid_subjects(args.subject_set) if args.subject_set else None
    failures = 0
    for path in args.paths:
        try:
            folds = read_folds(path, subjects)
            parameters = read_fold_parameters(path)
        except (FoldError, OSError) as error:
            print(f"FAIL {error}", file=sys.stderr)
            failures += 1
            continue
        made_with = "no parameter record" if parameters is None else ", ".join(
            f"{key}={value}" for key, value in parameters.items() if key != "fold_file_sha256"
        )
        print(
            f"ok {path}: {folds['fold'].nunique()} fold(s), {folds['subject_name'].nunique()} subjects, "
            f"sha256 {fold_file_sha256(path)} ({made_with})"
        )
    return 1 if failures else 0

