"""The committed BioVid fold files (data_manifests/biovid/): its subject sets, protocols and fold parameters, and the
command that writes and checks them.

Every committed fold file is made by `make_biovid_folds` (`pipeline.data.fold_files.make_folds`, seed 0, stratified by
sex and age band from the subject names), written with its parameter sidecar, and from then on only read.

    python -m pipeline fold-files write-biovid              # regenerate data_manifests/biovid/*.csv and *.json (seed 0)
    python -m pipeline fold-files check PATH... [--subject-set all87]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.data.biovid import NON_RESPONDERS
from pipeline.data.fold_checks import FoldError, where
from pipeline.data.fold_files import (
    fold_file_sha256,
    fold_parameters,
    make_folds,
    read_fold_parameters,
    read_folds,
    subject_strata,
    write_folds,
)
from pipeline.utils.paths import PROJECT_ROOT

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
            f"{where(str(subjects_csv), row)}, subject {table['subject_name'].iloc[row - 1]!r}: "
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
            f"{where(str(subjects_csv), row)}, subject {name!r}: facial_responder "
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
