"""Atomic file writes: a killed run leaves either the old file or the complete new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd


class SettingsMismatch(ValueError):
    """A folder holds data made with other settings than those asked for (a twin, crops): never mixed, never resumed."""


def _file_mode() -> int:
    """The mode a plain open() gives a new file under the current umask (mkstemp's temporary files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on error it is removed.

    The temporary file keeps `path`'s suffix by default because some writers (OpenCV's VideoWriter, cv2.imwrite)
    choose the format from the extension.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=suffix if suffix is not None else path.suffix,
                                    dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, _file_mode())  # readable as any other file the user writes, e.g. by a team on a shared server
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_csv(path: str | os.PathLike, frame: pd.DataFrame, sep: str = ",") -> None:
    """Write a DataFrame as CSV (no index) atomically."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, sep=sep, index=False)
