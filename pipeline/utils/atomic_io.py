"""Atomic file writes: a killed run leaves either the old file or the complete new one, never half of one.

The new file's data is flushed to disk (fsync) before the rename, and the folder after it, so a node that loses power
also keeps the old file or the complete new one (`durable=False` skips both, for scratch files). `atomic_paths` writes
several files with the same guarantee for the price of about one: their data flushed in one flush of the filesystem
before any of them is renamed, the renames in a second (a video's crops: 2 flushes instead of 16 fsyncs)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd


class SettingsMismatch(ValueError):
    """A folder holds data made with other settings than those asked for (a twin, crops): never mixed, never resumed."""


def _umask() -> int:
    """The process umask. Linux shows it in /proc without changing it; elsewhere it is set and restored (a moment
    in which another thread's new file would get no umask)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def _file_mode(path: Path) -> int:
    """The mode the file gets: the one it has when replaced, else what a plain open() gives under the umask
    (mkstemp's temporary files are 0600)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None, mode: int | None = None,
                durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on error it is removed.

    The temporary file keeps `path`'s suffix by default because some writers (OpenCV's VideoWriter, cv2.imwrite)
    choose the format from the extension. The file gets `mode`, else the replaced file's mode, else the umask's.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=suffix if suffix is not None else path.suffix,
                                    dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with contextlib.suppress(OSError):  # some network filesystems refuse chmod; the file is still written
            os.chmod(tmp, mode if mode is not None else _file_mode(path))  # readable like the user's other files
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_folder(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_paths(paths: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """Temporary paths beside `paths` (each as `atomic_path` names it); once all are written, their data is flushed,
    then all are renamed onto `paths` and the renames flushed: each file is the old one or the complete new one,
    also after a power loss. On error every temporary file is removed and no path is replaced."""
    targets = [Path(path) for path in paths]
    temporaries: list[Path] = []
    try:
        for path in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
            os.close(fd)
            temporaries.append(Path(name))
        yield temporaries
        for tmp, path in zip(temporaries, targets, strict=True):
            with contextlib.suppress(OSError):
                os.chmod(tmp, _file_mode(path))
        flush_files(temporaries)
        for tmp, path in zip(temporaries, targets, strict=True):
            os.replace(tmp, path)
        flush_files([], folders=sorted({path.parent for path in targets}))
    except BaseException:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise


@functools.cache
def _syncfs():
    """libc's syncfs(2) (Linux), or None where the C library has none."""
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None


def flush_files(files: Sequence[Path], folders: Sequence[Path] = ()) -> None:
    """Flush written files' data and folders' entries to the disk: one syncfs(2) of their filesystem where the OS has
    it (one flush for all of them), else an fsync of each file and folder."""
    anchor = next(iter([*files, *folders]), None)
    syncfs = _syncfs()
    if anchor is not None and syncfs is not None:
        fd = os.open(anchor, os.O_RDONLY)
        try:
            if syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    for path in files:
        fsync_file(path)
    for folder in folders:
        fsync_folder(folder)


def fsync_file(path: Path) -> None:
    """Flush a written file's data and size to the disk."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to the disk; a filesystem that cannot (some network ones) is
    skipped."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(folder: Path, parents: int = 1) -> None:
    """Flush every file under `folder` and every folder's entries, then the entries of its `parents` nearest parent
    folders (where a new folder was made): files written in place, not through `atomic_path`, made durable."""
    folders = [folder, *(path for path in sorted(folder.rglob("*")) if path.is_dir() and not path.is_symlink())]
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            fsync_file(path)
    for path in [*reversed(folders), *list(folder.parents)[:parents]]:
        fsync_folder(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_csv(path: str | os.PathLike, frame: pd.DataFrame, sep: str = ",") -> None:
    """Write a DataFrame as CSV (no index) atomically."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, sep=sep, index=False)


def save_png(figure, path: str | os.PathLike) -> None:
    """Render a matplotlib figure to PNG atomically (temporary file beside `path`, then rename). Here, not beside the
    plots, so that a command that only draws one (make predict) need not import the metrics and scikit-learn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    with atomic_path(path, suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
