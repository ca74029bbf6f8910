"""Who may read what the project writes. On a shared machine (a login node) loopback is not private and neither is a
folder made under the usual umask 022: other accounts could read the store, its password hashes, the models and the
face crops. So every command creates its files under umask 077 (`private_umask`, set once where the commands start),
and a store, artifact, runs or crops folder (or a sqlite file) that group or others can read or write is refused,
with its path and mode, unless the user says that it is shared on purpose (`PAINVIT_STORE_SHARED_OK=1`)."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

PRIVATE_UMASK = 0o077
SHARED_OK_ENV = "PAINVIT_STORE_SHARED_OK"  # 1: the user keeps a store readable by group or others on purpose
OPEN_BITS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH


class StoreNotPrivate(RuntimeError):
    """A store (or crops) folder or file that other accounts can read or write: the message names it and its mode."""


def private_umask() -> int:
    """Umask 077 for this process and everything it starts (servers, fold jobs); returns the one it had."""
    return os.umask(PRIVATE_UMASK)


def refuse_open_stores(paths: Iterable[Path], environ: Mapping[str, str] | None = None) -> None:
    """Raise StoreNotPrivate for the first existing path that group or others can read or write; paths not there
    yet are fine (they are created private). Nothing is refused when SHARED_OK_ENV=1."""
    environ = os.environ if environ is None else environ
    if environ.get(SHARED_OK_ENV, "") == "1":
        return
    for path in paths:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue
        if mode & OPEN_BITS:
            raise StoreNotPrivate(
                f"{path} is {stat.filemode(mode)} ({stat.S_IMODE(mode):04o}): other accounts on this machine can "
                f"read or write it (runs, models, password hashes or face crops). Make it yours alone with "
                f"`chmod -R go-rwx {shlex.quote(str(path))}`, or say {SHARED_OK_ENV}=1 to keep it shared")
