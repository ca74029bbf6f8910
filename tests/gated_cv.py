"""`python -m tests.gated_cv FOLD EPOCH WHEN MARKER <pipeline cv overrides...>`: `pipeline cv`, held for good at one
epoch checkpoint, so that a test can kill it at a defined point instead of at whatever moment a poll notices.

When fold FOLD's `last.ckpt` of epoch EPOCH is about to be written (WHEN=before: none of that fold's epoch
checkpoints exists yet if EPOCH is 0) or has been written (WHEN=after: that checkpoint is complete on disk), the
process writes MARKER and sleeps until it is killed. WHEN=until: MARKER is a folder; about to write that checkpoint,
the process writes MARKER/arrived_<pid> and waits until MARKER/release exists, then goes on. The gate wraps the
fold's checkpoint writer from the test side; the product has no such hook. WHEN=second_stage (EPOCH unused): the
process writes MARKER and sleeps when fold FOLD's temporal head is about to train, its frame model's embeddings
written to the fold's cache entry (a two-stage fold killed in its second stage).

`install_rendezvous` is the other gate: each listed fold, about to write its first epoch checkpoint, waits until
every listed fold has got that far, which proves that the folds ran at the same time without guessing how long they
take. Fold jobs in their own processes (the parallel launcher) get it through a `sitecustomize` on their PYTHONPATH
(`rendezvous_sitecustomize`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pytorch_lightning.plugins.io import TorchCheckpointIO

from pipeline.runs.jobs import fold_fit as fold_module


def install_gate(fold: int, epoch: int, when: str, marker: Path) -> None:
    write = fold_module.AtomicCheckpointIO.save_checkpoint

    def hold() -> None:
        marker.write_text("held\n")
        while True:
            time.sleep(60)

    def wait_for_release() -> None:
        (marker / f"arrived_{os.getpid()}").write_text("arrived\n")
        deadline = time.monotonic() + 600  # a bound for a broken test, never a wait of its own
        while not (marker / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def gated(self, checkpoint, path, storage_options=None) -> None:
        at_gate = (Path(path).name == "last.ckpt" and Path(path).parent.name == f"fold_{fold}"
                   and checkpoint["epoch"] == epoch)
        if at_gate and when == "before":
            hold()
        if at_gate and when == "until":
            wait_for_release()
        write(self, checkpoint, path, storage_options)
        if at_gate and when == "after":
            hold()

    fold_module.AtomicCheckpointIO.save_checkpoint = gated


def install_second_stage_gate(fold: int, marker: Path) -> None:
    from pipeline.runs.jobs import two_stage

    train = two_stage.train_head

    def gated(head, train_clips, val_clips, settings):
        if settings.stream == fold:  # the head's draws are keyed on its fold
            marker.write_text("held\n")
            while True:
                time.sleep(60)
        return train(head, train_clips, val_clips, settings)

    two_stage.train_head = gated


def install_rendezvous(folds: list[int], folder: Path, timeout_s: float = 600) -> None:
    # Lightning's writer, under the fold's own: the gate then holds whichever checkpoint writer the fold job uses.
    write = TorchCheckpointIO.save_checkpoint

    def gated(self, checkpoint, path, storage_options=None) -> None:
        if checkpoint["epoch"] == 0 and Path(path).parent.name.startswith("fold_"):
            (folder / Path(path).parent.name).write_text("arrived\n")
            deadline = time.monotonic() + timeout_s  # a bound for a broken run: the test then fails, never waits
            while not all((folder / f"fold_{f}").exists() for f in folds) and time.monotonic() < deadline:
                time.sleep(0.1)
        write(self, checkpoint, path, storage_options)

    TorchCheckpointIO.save_checkpoint = gated


JOB_PROCESSES = ("['-m', 'pipeline', 'fold-job']", "['-m', 'pipeline', 'job-worker']")  # where fold jobs run


def rendezvous_sitecustomize(site_dir: Path, folds: list[int], folder: Path) -> Path:
    """A sitecustomize.py in `site_dir` that installs the rendezvous in fold-job processes only (`python -m pipeline
    fold-job`, or the parallel launcher's `job-worker`)."""
    return _job_sitecustomize(site_dir, f"install_rendezvous({list(folds)!r}, Path({str(folder)!r}))")


def gate_sitecustomize(site_dir: Path, fold: int, epoch: int, when: str, marker: Path) -> Path:
    """A sitecustomize.py in `site_dir` that installs `install_gate` in fold-job processes only."""
    return _job_sitecustomize(site_dir, f"install_gate({fold}, {epoch}, {when!r}, Path({str(marker)!r}))")


def _job_sitecustomize(site_dir: Path, call: str) -> Path:
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(
        "import sys\n"
        f"if str(sys.orig_argv[1:4]) in {JOB_PROCESSES!r}:\n"
        "    from pathlib import Path\n"
        "    from tests.gated_cv import install_gate, install_rendezvous\n"
        f"    {call}\n")
    return site_dir


if __name__ == "__main__":
    fold, epoch, when, marker, *overrides = sys.argv[1:]
    if when not in ("before", "after", "until", "second_stage"):
        raise SystemExit(f"WHEN must be before, after, until or second_stage, got {when!r}")
    if when == "second_stage":
        install_second_stage_gate(int(fold), Path(marker))
    else:
        install_gate(int(fold), int(epoch), when, Path(marker))
    from pipeline.cli import main

    raise SystemExit(main(["cv", *overrides]))
