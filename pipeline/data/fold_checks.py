"""The fold contract, checked: a fold table assigns whole subjects to train / val / test, and a leak (one person's
frames on both sides of a split) is an error naming the file, the row, the fold and the subject (`FoldError`).

`check_folds` is what `pipeline.data.fold_files` runs before writing a fold file and on every read.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

ROLES = ("train", "val", "test")
FOLD_COLUMNS = ("fold", "subject_name", "role")


class FoldError(ValueError):
    """A fold table breaks the fold contract; the message names the file, the row, the fold and the subject."""


def where(source: str, row: int) -> str:
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
    check_table(folds, source)
    rows = FoldRows(folds, source)
    if subjects is not None:
        check_same_subjects(rows, set(subjects))
    check_every_fold_whole(rows)
    check_tested_once(rows)


def check_table(folds: pd.DataFrame, source: str) -> None:
    """The columns, at least one row, integer folds."""
    missing_columns = [column for column in FOLD_COLUMNS if column not in folds.columns]
    if missing_columns:
        raise FoldError(f"{source}: missing column(s) {missing_columns}; expected {list(FOLD_COLUMNS)}")
    if folds.empty:
        raise FoldError(f"{source}: no rows")
    if not pd.api.types.is_integer_dtype(folds["fold"]):
        raise FoldError(f"{source}: column 'fold' must hold integers, found dtype {folds['fold'].dtype}")


class FoldRows:
    """A fold table read row by row, each row checked on its own (fold, name, role, no subject twice in a fold):
    each (fold, subject)'s role and row, each subject's first row, and each fold's subjects by role."""

    def __init__(self, folds: pd.DataFrame, source: str) -> None:
        self.folds, self.source = folds, source
        self.role_and_row: dict[tuple[int, str], tuple[str, int]] = {}
        self.first_row: dict[str, int] = {}
        self.members: dict[int, dict[str, list[str]]] = {}
        rows = zip(folds["fold"].tolist(), folds["subject_name"].tolist(), folds["role"].tolist(), strict=True)
        for row, (fold, subject, role) in enumerate(rows, start=1):
            self.add(row, fold, subject, role)

    @property
    def subjects(self) -> set[str]:
        return set(self.first_row)

    def add(self, row: int, fold: int, subject: str, role: str) -> None:
        at = where(self.source, row)
        if fold < 0:
            raise FoldError(f"{at}, subject {subject!r}: negative fold {fold}")
        if not isinstance(subject, str) or not subject or subject != subject.strip():
            raise FoldError(
                f"{at}, fold {fold}: invalid subject_name {subject!r} "
                "(must be a non-empty name without surrounding spaces)"
            )
        if role not in ROLES:
            raise FoldError(
                f"{at}, fold {fold}, subject {subject!r}: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        if (fold, subject) in self.role_and_row:
            earlier_role, earlier_row = self.role_and_row[(fold, subject)]
            if earlier_role != role:
                raise FoldError(
                    f"{at}, fold {fold}, subject {subject!r}: leak, subject is both {earlier_role} "
                    f"(row {earlier_row}) and {role} in the same fold"
                )
            raise FoldError(
                f"{at}, fold {fold}, subject {subject!r}: listed twice as {role} "
                f"(also row {earlier_row}); each subject appears once per fold"
            )
        self.role_and_row[(fold, subject)] = (role, row)
        self.first_row.setdefault(subject, row)
        self.members.setdefault(fold, {r: [] for r in ROLES})[role].append(subject)


def check_same_subjects(rows: FoldRows, dataset_subjects: set[str]) -> None:
    """The file's subjects are exactly the dataset's."""
    unknown = sorted(rows.subjects - dataset_subjects, key=rows.first_row.__getitem__)
    if unknown:
        subject = unknown[0]
        fold = rows.folds["fold"].iloc[rows.first_row[subject] - 1]
        raise FoldError(
            f"{where(rows.source, rows.first_row[subject])}, fold {fold}, subject {subject!r}: not in the "
            f"dataset ({len(unknown)} such subject(s), first few: {unknown[:5]})"
        )
    absent = sorted(dataset_subjects - rows.subjects)
    if absent:
        raise FoldError(
            f"{rows.source}: {len(absent)} dataset subject(s) missing from the fold file, "
            f"e.g. subject {absent[0]!r} (first few: {absent[:5]})"
        )


def check_every_fold_whole(rows: FoldRows) -> None:
    """Every subject in every fold, and every fold with train, val and test subjects."""
    for fold in sorted(rows.members):
        by_role = rows.members[fold]
        in_fold = {subject for role_subjects in by_role.values() for subject in role_subjects}
        absent = sorted(rows.subjects - in_fold)
        if absent:
            raise FoldError(
                f"{rows.source}, fold {fold}, subject {absent[0]!r}: missing from this fold "
                f"({len(absent)} missing; every subject must appear exactly once per fold)"
            )
        for role in ROLES:
            if not by_role[role]:
                raise FoldError(f"{rows.source}, fold {fold}: no {role} subjects "
                                "(every fold needs train, val and test)")


def check_tested_once(rows: FoldRows) -> None:
    """In a multi-fold file whose test sets cover all subjects (loso, kfold), each subject is test exactly once."""
    members = rows.members
    if len(members) <= 1 or {s for by_role in members.values() for s in by_role["test"]} != rows.subjects:
        return
    tested_in: dict[str, int] = {}
    for fold in sorted(members):
        for subject in members[fold]["test"]:
            if subject in tested_in:
                row = rows.role_and_row[(fold, subject)][1]
                raise FoldError(
                    f"{where(rows.source, row)}, fold {fold}, subject {subject!r}: test in fold "
                    f"{tested_in[subject]} too; in a loso/k-fold file every subject is test once"
                )
            tested_in[subject] = fold
