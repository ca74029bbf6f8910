"""Atomic writes: all or nothing, and the same permissions as a plain write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pandas as pd
import pytest

from pipeline.utils.atomic_io import atomic_path, atomic_paths, atomic_write_csv, atomic_write_text, flush_files


def test_atomic_files_get_the_mode_a_plain_write_gets(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        (tmp_path / "plain.txt").write_text("x")
        atomic_write_text(tmp_path / "atomic.txt", "x")
        atomic_write_csv(tmp_path / "atomic.csv", pd.DataFrame({"a": [1]}))
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.txt", "x")
    finally:
        os.umask(previous)
    mode = lambda name: stat.S_IMODE((tmp_path / name).stat().st_mode)  # noqa: E731
    assert mode("atomic.txt") == mode("atomic.csv") == mode("plain.txt") == 0o644
    assert mode("private.txt") == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]


def test_several_files_are_replaced_together_or_not_at_all(tmp_path: Path) -> None:
    """`atomic_paths` (a video's crops, a twin's video and its regions): every file written, then all renamed at
    once, each with a plain write's mode; a failure leaves every old file and no temporary one."""
    targets = [tmp_path / "a.jpg", tmp_path / "sub" / "b.jpg", tmp_path / "c.csv"]
    targets[0].write_text("old a")
    with atomic_paths(targets) as temporaries:
        assert [t.suffix for t in temporaries] == [".jpg", ".jpg", ".csv"]  # encoders choose the format by it
        for index, temporary in enumerate(temporaries):
            temporary.write_text(f"new {index}")
        assert targets[0].read_text() == "old a" and not targets[1].exists()  # nothing replaced before the end
    assert [t.read_text() for t in targets] == ["new 0", "new 1", "new 2"]
    assert stat.S_IMODE(targets[1].stat().st_mode) == stat.S_IMODE(targets[0].stat().st_mode)
    with pytest.raises(RuntimeError):
        with atomic_paths(targets) as temporaries:
            temporaries[0].write_text("half")
            raise RuntimeError("killed")
    assert [t.read_text() for t in targets] == ["new 0", "new 1", "new 2"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["a.jpg", "b.jpg", "c.csv"]
    flush_files(targets, folders=[tmp_path])  # one syncfs on Linux, else an fsync of each


def test_a_replaced_file_keeps_its_mode_and_a_private_file_stays_private(tmp_path: Path) -> None:
    target = tmp_path / "shared.txt"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.read_text() == "new"
    with atomic_path(tmp_path / "job.json", mode=0o600) as tmp:
        tmp.write_text("{}")
    assert stat.S_IMODE((tmp_path / "job.json").stat().st_mode) == 0o600


def test_fold_job_files_are_private(tmp_path: Path) -> None:
    """A fold job's JSON is its owner's alone, and reads back as written; the store it names is written without its
    password (tests/test_store_privacy.py: a tracking URI with one is refused)."""
    from dataclasses import replace

    from pipeline.runs.jobs.fold_decisions import FoldDecisions
    from pipeline.runs.jobs.fold_run import FoldJob

    weights = {"kind": "random", "ref": "", "sha256": None}
    decisions = FoldDecisions(str(tmp_path / "folds.csv"), "32-true", "vit", weights)
    job = FoldJob({"a": 1}, 0, "parent", "http://127.0.0.1:5000", str(tmp_path / "work"), decisions,
                  store_uri="postgresql://user:secret@db/mlflow")
    path = job.write(tmp_path / "job.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert FoldJob.read(path) == replace(job, store_uri="postgresql://user:***@db/mlflow")
