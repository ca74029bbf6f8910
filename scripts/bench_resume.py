"""Resume check: a cross-validation killed with SIGKILL and run again ends with the metrics of one never interrupted.

Numbers for a release note, not a test (tests/test_launchers.py asserts the same on a smaller run). On a tiny twin
(generated once into --work-dir) it runs the same seeded command (`python -m pipeline cv`, deterministic algorithms)
three ways and prints each fold's test metrics side by side:

- straight through;
- killed while fold 1 is about to write its first epoch checkpoint (none of its checkpoints exists), then run again;
- killed once fold 1's epoch-1 checkpoint is on disk, then run again (it continues from that checkpoint).

The kill points are held, not guessed: tests/gated_cv.py stops the process at the checkpoint writer and this script
kills it there. It also prints the size of an epoch checkpoint, and what the keyed draws cost: the time to load and
augment one crop with its own seed (what training does now) against without (what it did before), interleaved over
the same crops, and the time of the per-batch reseed.

Run:
    .venv/bin/python scripts/bench_resume.py                       # 3 folds, 4 epochs, no loader workers
    .venv/bin/python scripts/bench_resume.py --workers 2 model.img_size=64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.runs.store import tracking  # noqa: E402
from pipeline.utils.devices import cpu_description  # noqa: E402
from tests.conftest import tiny_overrides  # noqa: E402

SETTINGS = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.batch_size=8",
            "trainer.max_epochs=4", "trainer.patience=4", "trainer.folds=[0,1,2]", "augment=light",
            "trainer.deterministic=true")


def run(command: list[str], marker: Path | None = None) -> float:
    """Run a driver to its end, or (with a gate's marker) until it holds, then SIGKILL it; returns the wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    if marker is None:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command[:5])} ... failed:\n{stderr[-3000:]}")
        return time.perf_counter() - started
    while not marker.exists():
        if process.poll() is not None:
            raise SystemExit(f"the driver ended before its gate:\n{process.stderr.read()[-3000:]}")
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return time.perf_counter() - started


def fold_metrics(db: Path) -> dict[str, dict[str, float]]:
    client = MlflowClient(f"sqlite:///{db}")
    (parent,) = client.search_runs([client.get_experiment_by_name("pain-cv").experiment_id],
                                   f"tags.`{tracking.RUN_KIND_TAG}` = '{tracking.CV_RUN}'")
    return {str(fold): dict(sorted(run.data.metrics.items()))
            for fold, run in sorted(tracking.finished_fold_runs(client, parent.info.run_id).items())}


def checkpoint_size_without_datamodule_state(path: Path) -> int:
    """The checkpoint's size as the code before exact resume wrote it: the same file less the DataModule's state."""
    import io

    import torch

    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    checkpoint.pop("PainDataModule", None)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getbuffer().nbytes


def draw_cost(base: Path, rounds: int = 5, items: int = 200) -> dict[str, float]:
    """Microseconds per crop: load + augment with a per-item seed (EpochSampler) against without; per-batch reseed."""
    import numpy as np
    import torch

    from pipeline.data.datamodule import LoaderConfig, PainDataModule, SubjectRoles
    from pipeline.data.tasks import get_task
    from pipeline.models.backbones import create_backbone
    from pipeline.utils.config import load_config
    from pipeline.utils.paths import resolve_path
    from pipeline.utils.seeds import derived_seed

    cfg = load_config(tiny_overrides(base, *SETTINGS, "augment=heavy"))
    backbone, _ = create_backbone(cfg.model.name, img_size=cfg.model.img_size)
    from omegaconf import OmegaConf

    datamodule = PainDataModule(Path(cfg.data.processed_dir), SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                get_task(cfg.task.name),
                                backbone.data_config, OmegaConf.to_container(cfg.augment),
                                LoaderConfig.from_config(cfg.loader, num_workers=0), seed=cfg.seed)
    datamodule.setup()
    dataset = datamodule.dataset("train")
    count = min(items, len(dataset))
    seeds = np.random.default_rng(0).integers(0, 2**63 - 1, size=count).tolist()
    plain, keyed = [], []
    for _ in range(rounds):  # A B A B: the machine's drift hits both alike
        started = time.perf_counter()
        for item in range(count):
            dataset[item]
        plain.append((time.perf_counter() - started) / count)
        started = time.perf_counter()
        for item in range(count):
            dataset[(item, seeds[item])]
        keyed.append((time.perf_counter() - started) / count)
    started = time.perf_counter()
    for batch in range(1000):
        torch.manual_seed(derived_seed(0, 0, 1, batch))
    reseed = (time.perf_counter() - started) / 1000
    return {"crop_us_before": 1e6 * float(np.median(plain)), "crop_us_keyed": 1e6 * float(np.median(keyed)),
            "batch_reseed_us": 1e6 * reseed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "reports" / "bench" / "resume")
    parser.add_argument("--workers", type=int, default=0, help="loader workers (default 0)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides on top of the tiny settings")
    args = parser.parse_args()
    base = args.work_dir.resolve()
    base.mkdir(parents=True, exist_ok=True)
    settings = (*SETTINGS, f"loader.num_workers={args.workers}", *args.overrides)

    def command(db: str, *gate: str) -> list[str]:
        overrides = tiny_overrides(base, *settings, f"mlflow.tracking_uri=sqlite:///{base / db}",
                                   f"cv.work_dir={base / ('runs_' + db)}")
        if gate:
            return [sys.executable, "-m", "tests.gated_cv", *gate, *overrides]
        return [sys.executable, "-m", "pipeline", "cv", *overrides]

    print(f"CPU: {cpu_description()}; loader workers {args.workers}")
    for db in ("straight.db", "killed_early.db", "killed_late.db"):  # every run from nothing
        (base / db).unlink(missing_ok=True)
        shutil.rmtree(base / f"runs_{db}", ignore_errors=True)
    seconds = {"straight": run(command("straight.db"))}
    marker = base / "held"
    marker.unlink(missing_ok=True)
    run(command("killed_early.db", "1", "0", "before", str(marker)), marker)
    marker.unlink()
    seconds["killed before fold 1's first checkpoint, then rerun"] = run(command("killed_early.db"))
    run(command("killed_late.db", "1", "1", "after", str(marker)), marker)
    checkpoint = next((base / "runs_killed_late.db").glob("*/fold_1/last.ckpt"))
    size = checkpoint.stat().st_size
    size_without = checkpoint_size_without_datamodule_state(checkpoint)
    marker.unlink()
    seconds["killed after fold 1's epoch-1 checkpoint, then rerun"] = run(command("killed_late.db"))

    results = {name: fold_metrics(base / db) for name, db in
               (("straight", "straight.db"), ("killed early", "killed_early.db"), ("killed late", "killed_late.db"))}
    shown = ("test/video_auroc", "test/video_accuracy", "test/frame_auroc", "val/loss", "train/loss", "best_epoch")
    print(f"\n{'fold':<5}{'metric':<22}" + "".join(f"{name:>15}" for name in results))
    for fold in results["straight"]:
        for metric in shown:
            values = [results[name][fold].get(metric, float("nan")) for name in results]
            print(f"{fold:<5}{metric:<22}" + "".join(f"{value:>15.6f}" for value in values))
    identical = all(results[name] == results["straight"] for name in results)
    print(f"\nevery metric of every fold identical to the straight run: {identical}")
    print(f"epoch checkpoint (last.ckpt) of fold 1 after epoch 1: {size:,} bytes; without the state this change "
          f"adds (the DataModule's next epoch): {size_without:,} bytes")
    for name, value in seconds.items():
        print(f"wall time, {name}: {value:.1f} s")
    cost = draw_cost(base)
    print(f"load + heavy augmentation of one crop: {cost['crop_us_before']:.0f} us without a per-crop seed, "
          f"{cost['crop_us_keyed']:.0f} us with it (median of 5 interleaved rounds); per-batch reseed "
          f"{cost['batch_reseed_us']:.0f} us")
    (base / "resume_check.json").write_text(json.dumps({"identical": identical, "checkpoint_bytes": size,
                                                         "seconds": seconds, "cost": cost, "metrics": results},
                                                        indent=1))


if __name__ == "__main__":
    main()
