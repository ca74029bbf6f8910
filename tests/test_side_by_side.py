"""Two different cross-validations of one backbone run at once from one checkout, one store and one work folder (their
driver locks and checkpoint folders are keyed by their full identity and store), and two identical ones do not."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.utils.paths import PROJECT_ROOT
from tests.test_launchers import RUN_ENV, cv_command, cv_parent, fold_metrics, gated_cv_command

# one fold of one epoch (held at its checkpoint, it is still mid-fold: tested, sealed after), the same numbers on
# every run of it
ONE_FOLD = ("trainer.folds=[0]", "trainer.max_epochs=1", "trainer.patience=1", "trainer.deterministic=true",
            "cv.log_models=false")
STRATEGIES = {"full": ("model.finetune=full",), "top_blocks": ("model.finetune=top_blocks",
                                                                "model.finetune_blocks=1")}


def where(base: Path, name: str) -> tuple[str, ...]:
    return (f"mlflow.tracking_uri=sqlite:///{base / name / 'mlflow.db'}", f"mlflow.artifact_root={base / name / 'art'}",
            f"cv.work_dir={base / name / 'runs'}", f"reports_dir={base / name / 'reports'}")


def by_strategy(client: MlflowClient) -> dict[str, dict]:
    return {parent.data.tags["finetune"]: fold_metrics(client, parent.info.run_id) for parent in cv_parent(client)}


@pytest.mark.slow
def test_two_strategies_of_one_backbone_run_at_once_and_an_identical_cv_refuses(tiny_base: Path,
                                                                                 tmp_path: Path) -> None:
    """CV `full` is held at its fold's first epoch checkpoint; meanwhile CV `top_blocks` (the same backbone, data and
    task, another strategy) starts from the same checkout against the same store and work folder and finishes, and
    a second driver of `full` is refused, naming the first (its pid and what it is). Once released, `full` finishes
    too, and both CVs have the fold metrics of the same two run one after the other."""
    shared = where(tmp_path, "shared")
    gate = tmp_path / "gate"
    gate.mkdir()
    log = (tmp_path / "full.log").open("w")
    held = subprocess.Popen(gated_cv_command(tiny_base, (0, 0, "until"), gate, *ONE_FOLD, *STRATEGIES["full"],
                                             *shared), cwd=PROJECT_ROOT, env=RUN_ENV, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600  # a bound for a broken run, not a guess at how long it takes
        while not list(gate.glob("arrived_*")):
            assert held.poll() is None, (tmp_path / "full.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the held CV never reached its first epoch checkpoint"
            time.sleep(0.2)
        other = subprocess.run(cv_command(tiny_base, *ONE_FOLD, *STRATEGIES["top_blocks"], *shared), cwd=PROJECT_ROOT,
                               env=RUN_ENV, capture_output=True, text=True)
        assert other.returncode == 0, other.stdout[-2000:] + other.stderr[-3000:]
        twin = subprocess.run(cv_command(tiny_base, *ONE_FOLD, *STRATEGIES["full"], *shared), cwd=PROJECT_ROOT,
                              env=RUN_ENV, capture_output=True, text=True)
        assert held.poll() is None  # both ran while the first was held: side by side
        (gate / "release").write_text("go\n")
        assert held.wait(timeout=600) == 0, (tmp_path / "full.log").read_text()[-3000:]
    finally:
        if held.poll() is None:
            held.kill()
        log.close()
    assert twin.returncode != 0
    refusal = twin.stderr.strip().splitlines()[-1]
    assert f"the same cross-validation is already running: pid {held.pid}, `make cv` of mobilevit_xxs on synthetic " \
           f"kfold5 bl1_vs_pa4 (full, config " in refusal, twin.stderr[-2000:]
    locks = sorted(path.name for path in (tmp_path / "shared" / "runs" / "locks").iterdir())
    assert len(locks) == 2 and all(name.startswith("mobilevit_xxs-synthetic-kfold5-bl1_vs_pa4-") for name in locks)

    for name in ("full", "top_blocks"):  # the same two, one after the other, in a store of their own
        alone = subprocess.run(cv_command(tiny_base, *ONE_FOLD, *STRATEGIES[name], *where(tmp_path, "sequential")),
                               cwd=PROJECT_ROOT, env=RUN_ENV, capture_output=True, text=True)
        assert alone.returncode == 0, alone.stderr[-3000:]
    side_by_side = by_strategy(MlflowClient(f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}"))
    one_after_the_other = by_strategy(MlflowClient(f"sqlite:///{tmp_path / 'sequential' / 'mlflow.db'}"))
    assert sorted(side_by_side) == ["full", "top_blocks1"]
    assert all(client.get_run(parent.info.run_id).info.status == "FINISHED"
               for client in [MlflowClient(f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}")]
               for parent in cv_parent(client))
    assert side_by_side == one_after_the_other
