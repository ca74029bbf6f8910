"""Sealing a fold run: what a cross-validation reads of a finished fold run is safe before the run is marked
FINISHED, and a FINISHED run whose files have since gone from the store is retired.

`seal_fold`: the run's files flushed to disk (a file artifact store's copies; the work folder's were, before upload),
the prediction tables (`SEALED`) and the kept model read back from the store and compared with the local files by
size and SHA-256; that record is kept on the run (`STORED_ARTIFACTS_TAG`). `retire_unreadable`: a FINISHED run whose
recorded files are not in the store at their size is marked FAILED with the reason, so that its fold is trained again.
`keep_only_artifacts`: a sealed fold's work folder keeps only the local copies of what it stored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

from mlflow import MlflowClient
from mlflow.entities import Run

from pipeline.models.model_file import MODEL_ARTIFACT
from pipeline.runs.store.run_record import RunRecord
from pipeline.runs.store.tracking import FAILED, FAILED_REASON_TAG, FINISHED, FOLD_TAG, STORED_ARTIFACTS_TAG
from pipeline.utils.atomic_io import fsync_tree

FRAME_PREDICTIONS = "predictions_frames.csv"
VIDEO_PREDICTIONS = "predictions_videos.csv"
SEALED = (FRAME_PREDICTIONS, VIDEO_PREDICTIONS)  # what a CV reads of a fold run (result_from_run); the kept model too


class ArtifactsNotStored(RuntimeError):
    """What a fold run logged is not in the store as written: the run is not marked FINISHED."""


def file_facts(path: Path) -> dict[str, int | str]:
    """A file's size and SHA-256, as a fold run's stored-artifacts record holds them."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def local_artifact_folder(artifact_uri: str) -> Path | None:
    """The folder of a file artifact store's run artifacts (file:// or a plain path); None for any other store."""
    parts = urlsplit(artifact_uri)
    if parts.scheme == "file":
        return Path(url2pathname(parts.path))
    return Path(artifact_uri) if not parts.scheme else None


def keep_only_artifacts(work_dir: Path) -> None:
    """A sealed fold's work folder keeps the local copies of what it stored (`artifacts/`, kilobytes) until the CV
    is FINISHED; its epoch checkpoints, kept model and embeddings (up to a gigabyte or more a fold: a LOSO CV of a
    ViT-B/16 would hold about 100 GB) are in the store or no longer needed, and go now."""
    for path in work_dir.iterdir() if work_dir.is_dir() else ():
        if path.name == "artifacts":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def seal_fold(run: RunRecord, work_dir: Path, keep_model: bool) -> dict[str, dict]:
    """Make what a finished fold run is read for safe before it is marked FINISHED: with a file artifact store the
    uploaded copies flushed to disk (the local ones were, before upload), then the prediction tables the CV
    aggregates and the kept model (when logged) read back from the run's artifact store and compared with the local
    files by size and SHA-256. Returns that record (artifact path -> size, sha256); `ArtifactsNotStored` names a file
    that differs."""
    run_id = run.run_id
    local = {name: work_dir / "artifacts" / name for name in SEALED}
    if keep_model:
        local[MODEL_ARTIFACT] = work_dir / Path(MODEL_ARTIFACT).name
    stored = local_artifact_folder(run.artifact_uri)
    if stored is not None and stored.is_dir():
        fsync_tree(stored, parents=2)  # the run's folder and its experiment's: where a new folder's entry lies
    repository = run.artifact_repository()
    record = {}
    with tempfile.TemporaryDirectory(prefix="painvit-seal-") as tmp:
        for name, path in local.items():
            written = file_facts(path)
            try:
                copy = Path(repository.download_artifacts(name, tmp))
            except Exception as error:  # noqa: BLE001 - any store's "not there": said with the file's name
                raise ArtifactsNotStored(f"run {run_id}: {name} cannot be read back from the store: {error}") from error
            read = file_facts(copy)
            if read != written:
                raise ArtifactsNotStored(f"run {run_id}: {name} reads back as {read['size']} bytes, sha256 "
                                         f"{read['sha256']}; written as {written['size']} bytes, sha256 "
                                         f"{written['sha256']} ({path})")
            record[name] = written
    return record


def unreadable(client: MlflowClient, run: Run) -> str:
    """Why a FINISHED fold run can no longer be read ("" when it can): a file of its stored-artifacts record that is
    not in the store at the size it was stored with (a run from before that record: a missing prediction table)."""
    try:
        record = json.loads(run.data.tags.get(STORED_ARTIFACTS_TAG) or "{}")
    except json.JSONDecodeError:
        record = {}
    expected: dict[str, int | None] = ({name: int(facts["size"]) for name, facts in record.items()} if record
                                       else dict.fromkeys(SEALED))
    listed: dict[str, int | None] = {}
    for folder in sorted({str(Path(name).parent) for name in expected}):
        listed.update({info.path: info.file_size for info in
                       client.list_artifacts(run.info.run_id, None if folder == "." else folder) if not info.is_dir})
    problems = []
    for name, size in expected.items():
        if name not in listed:
            problems.append(f"{name} is missing")
        elif size is not None and listed[name] is not None and listed[name] != size:
            problems.append(f"{name} holds {listed[name]} bytes, {size} when it was stored")
    return "; ".join(problems)


def retire_unreadable(client: MlflowClient, runs: list[Run]) -> list[Run]:
    """The FINISHED fold runs among `runs` whose artifacts the store no longer holds (`unreadable`), each marked
    FAILED with the reason (tag `painvit.failed_reason`), so that its fold is trained again rather than counted done
    on results nobody can read."""
    retired = []
    for run in runs:
        if run.info.status != FINISHED:
            continue
        reason = unreadable(client, run)
        if reason:
            message = f"its artifacts are no longer in the store ({reason}): the fold is trained again"
            print(f"fold {run.data.tags.get(FOLD_TAG)}: finished run {run.info.run_id} marked FAILED: {message}",
                  flush=True)
            client.set_tag(run.info.run_id, FAILED_REASON_TAG, message)
            client.set_terminated(run.info.run_id, FAILED)
            retired.append(run)
    return retired
