"""What one fold of `make cv` costs, end to end and step by step, and the same fold on another checkout.

Runs `python -m pipeline cv` for one fold of the default synthetic twin (`trainer.folds=[0]`, `--epochs` epochs, no
early stop), in a fresh MLflow store each time, `--repeats` times, and reports the wall and CPU time of each run
(CPU time is less disturbed by other load on the machine, wall time is what a user waits). Where the
checkout logs them (this one does), the fold's step times follow: set-up, fit, validation re-pass, test, threshold,
artifacts, model logging (`time/<step>_s` on the fold run). `--other PATH` runs the same fold on a second checkout
(e.g. a `git worktree` of an older commit), alternating with this one, so both see the same machine load.

The data are prepared once by this checkout (`make data`) and read by both.

Run:
    .venv/bin/python scripts/bench_fold.py                                  # MobileViT-S, 3 epochs, 2 repeats
    git worktree add /tmp/old 6d1eeff && .venv/bin/python scripts/bench_fold.py --other /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.utils.devices import cpu_description  # noqa: E402


def data_overrides() -> list[str]:
    """The default twin of this checkout (configs/data/synthetic.yaml's folders), for both checkouts."""
    processed = ROOT / "data" / "processed" / "synthetic"
    return [f"data.root={ROOT / 'data' / 'raw' / 'synthetic'}", f"data.processed_dir={processed}",
            f"data.manifest_dir={processed / 'manifests'}"]


def run_fold(tree: Path, model: str, epochs: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        command = [sys.executable, "-m", "pipeline", "cv", f"model={model}", "trainer.folds=[0]",
                   f"trainer.max_epochs={epochs}", f"trainer.patience={epochs + 1}", "cv.resume=never",
                   f"mlflow.tracking_uri={store}", f"mlflow.artifact_root={tmp}/mlartifacts",
                   f"cv.work_dir={tmp}/runs", f"reports_dir={tmp}/reports", *data_overrides(), *extra]
        started, cpu_before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                capture_output=True, text=True)
        wall = time.perf_counter() - started
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        if result.returncode != 0:
            raise SystemExit(f"{tree}: the fold failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        from mlflow import MlflowClient

        client = MlflowClient(store)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.fold = '0'")
        metrics = runs[0].data.metrics if runs else {}
        steps = {k.removeprefix("time/").removesuffix("_s"): v for k, v in metrics.items() if k.startswith("time/")}
        epochs_run = int(metrics.get("epochs_trained", -1))
        return {"tree": str(tree), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "epochs": epochs_run,
                "steps_s": steps, "load": round(os.getloadavg()[0], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilevit_s")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--other", type=Path, action="append", default=[],
                        help="another checkout to run the same fold on, alternating (may be given more than once)")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "bench" / "bench_fold.json")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for both checkouts")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "pipeline", "data", *data_overrides()], cwd=ROOT, check=True)
    trees = [ROOT] + [other.resolve() for other in args.other]
    print(f"CPU: {cpu_description()}")
    results = []
    for repeat in range(args.repeats):
        for tree in trees:
            result = run_fold(tree, args.model, args.epochs, args.overrides)
            results.append(result)
            steps = ", ".join(f"{k} {v:.1f} s" for k, v in result["steps_s"].items()) or "no step times logged"
            print(f"[{repeat + 1}/{args.repeats}] {tree}: {result['wall_s']:.1f} s wall, "
                  f"{result['cpu_s']:.0f} CPU-s, {result['epochs']} epochs, load {result['load']} ({steps})",
                  flush=True)
    for tree in trees:
        walls = [r["wall_s"] for r in results if r["tree"] == str(tree)]
        print(f"{tree}: wall {', '.join(f'{w:.1f}' for w in walls)} s (mean {sum(walls) / len(walls):.1f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu_description(), "model": args.model, "epochs": args.epochs,
                                    "runs": results}, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
