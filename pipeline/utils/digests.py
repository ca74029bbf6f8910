"""The one SHA-256 of a file's bytes, read in 1 MiB chunks: weights' identity, the embedding cache's key and its
arrays' check, a served model folder's trusted files, a power study's weights."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
