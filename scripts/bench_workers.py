"""Short folds on every core: one CV of in-memory probes (a frozen backbone's cached embeddings, `model.head.fit=
in_memory`) under LAUNCHER=local and under LAUNCHER=parallel with JOBS workers, each into a store of its own, with
the embedding cache built first (`make embed`) so that both read the same entry.

    .venv/bin/python scripts/bench_workers.py --weights data/pretrained/resnet10t_identity_synthetic1_64px.pt \\
        [--data synthetic] [--protocol loso] [--folds 20] [--jobs 2]

Prints, per launcher: wall seconds, seconds a fold, the CPU seconds of the command and everything it started (user +
system: how many cores it kept busy on average), the machine's busy share of its cores over the same time (from
/proc/stat: other users' work included) and the load average before and after; then the speed-up. A loaded machine
shows in the last two: numbers taken under load are marked so.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROBE = ("model.img_size=64 model.finetune=frozen model.head.fit=in_memory cv.log_models=false cv.fold_plots=false")


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of every core since boot (/proc/stat's first line)."""
    fields = [float(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def make(target: str, variables: dict[str, str]) -> float:
    """`make <target> VAR=value ...`; its wall seconds. Stops the script on a failure, with make's output."""
    command = ["make", "--no-print-directory", target, *[f"{key}={value}" for key, value in variables.items()]]
    print("$", shlex.join(command), flush=True)
    started = time.monotonic()
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def fold_runs_in(store: Path) -> int:
    """How many finished fold runs the store at `store`/mlflow.db holds (the CV's folds)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return len(client.search_runs(experiments, "tags.`painvit.run_kind` = 'fold' and attributes.status = 'FINISHED'",
                                  max_results=10_000))


def measure(name: str, variables: dict[str, str], store: Path) -> dict[str, float]:
    load_before = os.getloadavg()
    busy0, total0 = cpu_times()
    cpu0 = children_cpu_s()
    wall = make("cv", variables)
    busy1, total1 = cpu_times()
    folds = fold_runs_in(store)
    row = {"folds": folds, "wall_s": wall, "s_per_fold": wall / folds, "cpu_s": children_cpu_s() - cpu0,
           "machine_busy": (busy1 - busy0) / max(1.0, total1 - total0), "load_before": load_before[0],
           "load_after": os.getloadavg()[0]}
    print(f"{name}: {folds} folds in {wall:.1f} s wall, {row['s_per_fold']:.2f} s a fold, {row['cpu_s']:.1f} CPU s "
          f"({row['cpu_s'] / wall:.2f} cores busy on average), machine {100 * row['machine_busy']:.0f} % busy "
          f"over {os.cpu_count()} cores, load {row['load_before']:.2f} -> {row['load_after']:.2f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True)
    parser.add_argument("--model", default="resnet10t")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--protocol", default="loso")
    parser.add_argument("--task", default="bl1_vs_pa4")
    parser.add_argument("--folds", type=int, default=0, help="the first N folds only (0: every fold)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    folds = f" trainer.folds=[{','.join(map(str, range(args.folds)))}]" if args.folds else ""
    base = {"MODEL": args.model, "DATA": args.data, "PROTOCOL": args.protocol, "TASK": args.task,
            "WEIGHTS": args.weights}
    import torch

    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores; load {os.getloadavg()}",
          flush=True)
    make("embed", {**base, "ARGS": PROBE})  # the cache entry both runs read, built once
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as own:
        for name, launcher in (("local", {"LAUNCHER": "local"}),
                               (f"parallel JOBS={args.jobs}", {"LAUNCHER": "parallel", "JOBS": str(args.jobs)})):
            store = Path(own) / name.split()[0]
            store.mkdir(mode=0o700)
            rows[name] = measure(name, {**base, **launcher, "ARGS": f"{PROBE}{folds} mlflow.tracking_uri=sqlite:///"
                                        f"{store / 'mlflow.db'} mlflow.artifact_root={store / 'art'} "
                                        f"cv.work_dir={store / 'runs'}"}, store)
    local, parallel = rows["local"], rows[f"parallel JOBS={args.jobs}"]
    print(f"speed-up {local['wall_s'] / parallel['wall_s']:.2f}x over {local['folds']:.0f} folds "
          f"({local['s_per_fold']:.2f} -> {parallel['s_per_fold']:.2f} s a fold)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
