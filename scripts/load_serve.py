"""Load test of `make serve`: at least 400 requests from 24 clients at once, valid, broken and oversized mixed.

By default it makes what the issue served (issue 46): a MobileViT-XXS model at its own input size (random weights:
scoring costs what a trained one costs), logged as `make final` logs it, registered as `pain-mobilevit_xxs-<task>` and
promoted to champion in a store of its own, then started with `make serve` on a free loopback port. Then:

1. one valid request to warm the server up, and the server's memory (VmRSS) read;
2. the load (`pipeline.deployment.serve_load`): `--requests` requests (400) of four kinds in the shares of `--mix`
   (valid 2, valid without a face 1, broken base64 1, large frames 1; a valid request is `--frames` (8) PNG frames of
   the default twin, 320 x 240, or as many grey ones; a large one `--large-frames` (8) frames of `--large-side` (2000)
   px a side), sent by `--clients` (24) threads at once, each request on a connection of its own, a 503 retried after
   its Retry-After up to `--retries` times (0: a 503 is the answer);
3. the server's memory again (VmRSS, and its peak VmHWM) and the figures: statuses per kind, unanswered requests,
   answers that are not strict JSON (NaN), p50 / p95 latency, frames scored a second.

Run:
    .venv/bin/python scripts/load_serve.py                                  # the load above on a fresh server
    .venv/bin/python scripts/load_serve.py --retries 5                      # clients that honour Retry-After
    .venv/bin/python scripts/load_serve.py --serve-args "serve.max_in_flight=8"   # other serve settings
    .venv/bin/python scripts/load_serve.py --port 5001 --pid <server pid>   # a server already running
Writes reports/bench/load_serve.json (`--out`). Exits 1 when a request got no answer, an unintended status (any but
200, 400, 413, 503) or an answer that is not strict JSON. Timings on a shared machine are polluted by its other load:
the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from pipeline.deployment.serve_load import (
    process_usage,
    request_kinds,
    request_plan,
    run_load,
    serving_pid,
    summary,
)
from pipeline.utils.config import load_config
from pipeline.utils.paths import PROJECT_ROOT, resolve_path
from pipeline.utils.permissions import private_umask

MODEL = "mobilevit_xxs"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_champion(folder: Path, task: str) -> str:
    """A random-weight MobileViT-XXS logged and registered as `make final` does it, promoted to champion, in a sqlite
    store under `folder`; returns the store's URI."""
    import mlflow
    from mlflow import MlflowClient

    from pipeline.models.factory import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.runs.serving.mlflow_model import log_mlflow_model, model_config
    from pipeline.runs.store import tracking
    from pipeline.runs.store.registry import CHAMPION, registered_name

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    cfg = load_config([f"model={MODEL}", f"task={task}", f"mlflow.tracking_uri={uri}"])
    torch.manual_seed(0)
    net, source = create_model(MODEL, n_classes=2, pretrained=False, img_size=cfg.model.img_size)
    class_names = ["BL1", "PA4"]
    meta = model_meta(net, model_name=MODEL, img_size=cfg.model.img_size, class_names=class_names,
                      task=cfg.task.name, loader=dict(cfg.loader), weights=tracking.weights_tags(source))
    weights = save_model_file(net, meta, folder / f"{MODEL}.pt")
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("load", artifact_location=str(folder / "artifacts"))
    name = registered_name(MODEL, cfg.task.name)
    with mlflow.start_run(experiment_id=experiment):
        info = log_mlflow_model(weights, model_config(cfg, class_names, 0.5, "fixed"), {"model": MODEL},
                                registered_model_name=name)
    MlflowClient(uri).set_registered_model_alias(name, CHAMPION, str(info.registered_model_version))
    return uri


def start_server(stack: ExitStack, uri: str, port: int, task: str, serve_args: str, log: Path) -> int:
    """`make serve MODEL=mobilevit_xxs` of the store's champion on `port`; the serving process's pid once /ping
    answers."""
    from pipeline.utils.processes import stop_process_group

    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve", f"MODEL={MODEL}", f"TASK={task}",
               f"SERVE_PORT={port}", f"ARGS=mlflow.tracking_uri={uri} {serve_args}".strip()]
    output = stack.enter_context(log.open("w"))
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    stack.callback(stop_process_group, process)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"make serve stopped (exit {process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return serving_pid(process.pid)
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"make serve did not answer /ping within 300 s:\n{log.read_text()[-3000:]}")


def twin_frames(count: int) -> list:
    """`count` consecutive frames of the default twin (320 x 240), drawn faces only."""
    from dataclasses import replace
    from itertools import islice

    from pipeline.data.synthetic import PRESETS, make_samples, make_subjects, render_frames

    config = replace(PRESETS["default"], n_subjects=1)
    subject = make_subjects(config)[0]
    sample = next(s for s in make_samples(config, [subject]) if "PA4" in s.sample_name)
    return list(islice(render_frames(config, subject, sample), 60, 60 + count))


def result_frames(answers) -> int:
    return sum(answer.frames_scored for answer in answers)


def server_figures(before: dict, after: dict, wall_s: float, frames: int) -> dict:
    """The serving process over the load: its memory before, after and at its peak, and the CPU it used."""
    cpu_s = after["cpu_s"] - before["cpu_s"]
    return {"rss_before_mib": before["rss_bytes"] / 2**20, "rss_after_mib": after["rss_bytes"] / 2**20,
            "rss_growth_mib": (after["rss_bytes"] - before["rss_bytes"]) / 2**20,
            "peak_mib": after["peak_bytes"] / 2**20,
            "peak_growth_mib": (after["peak_bytes"] - before["rss_bytes"]) / 2**20,
            "cpu_s": cpu_s, "cores_busy": cpu_s / wall_s,
            "cpu_ms_per_frame": round(1000 * cpu_s / frames, 1) if frames else None}


def parse_mix(text: str) -> dict[str, float]:
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    return {name.strip(): float(share) for name, share in pairs}


def print_figures(result: dict) -> None:
    figures = result["figures"]
    server = result["server"]
    print(f"{figures['requests']} requests from {result['clients']} clients in {figures['wall_s']} s: statuses "
          f"{figures['statuses']}; per kind {figures['statuses_per_kind']}")
    print(f"unanswered {figures['unanswered']}, unintended statuses {figures['unintended']}, not strict JSON "
          f"{figures['not_strict_json']}, 503 at first {figures['first_attempt_503']} (retries {figures['retries']}, "
          f"Retry-After {figures['retry_after_values']})")
    latency, ok = figures["latency_s"], figures["latency_200_s"]
    print(f"latency p50 {latency['p50']:.2f} s, p95 {latency['p95']:.2f} s (200s: p50 {ok['p50'] or 0:.2f} s, p95 "
          f"{ok['p95'] or 0:.2f} s); {figures['frames_scored']} frames scored, {figures['frames_per_s']} frames/s")
    if server:
        print(f"server memory: VmRSS {server['rss_before_mib']:.0f} MiB before, {server['rss_after_mib']:.0f} MiB "
              f"after (+{server['rss_growth_mib']:.0f} MiB), peak {server['peak_mib']:.0f} MiB; CPU "
              f"{server['cpu_s']:.0f} s ({server['cores_busy']:.2f} cores busy, {server['cpu_ms_per_frame']} ms a "
              f"frame scored)")
    for line in figures["problems"] + figures["errors"]:
        print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--mix", default="valid=2,valid_no_face=1,broken_base64=1,large_frames=1")
    parser.add_argument("--frames", type=int, default=8, help="frames of a valid request")
    parser.add_argument("--large-side", type=int, default=2000)
    parser.add_argument("--large-frames", type=int, default=8)
    parser.add_argument("--retries", type=int, default=0, help="times a client asks again after a 503")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a client waits for an answer")
    parser.add_argument("--task", default="bl1_vs_pa4")
    parser.add_argument("--serve-args", default="", help="more ARGS for make serve (key=value ...)")
    parser.add_argument("--port", type=int, default=None, help="a server already running on 127.0.0.1:PORT")
    parser.add_argument("--pid", type=int, default=None, help="its process id (for its memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(resolve_path("reports/bench/load_serve.json")))
    args = parser.parse_args(argv)
    private_umask()  # the store and the model are made as every command makes them: this user's alone
    frames = twin_frames(args.frames)
    kinds = request_kinds(frames, args.large_side, args.large_frames)
    plan = request_plan(args.requests, parse_mix(args.mix), args.seed)
    sizes = {kind: f"{len(request.body) / 2**20:.1f} MiB" for kind, request in kinds.items()}
    with ExitStack() as stack:
        port, pid = args.port, args.pid
        if port is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            uri = make_champion(folder, args.task)
            port = free_port()
            settings = args.serve_args or "the default serve settings"
            print(f"make serve of a {MODEL} champion on port {port} ({settings})", flush=True)
            pid = start_server(stack, uri, port, args.task, args.serve_args, folder / "server.log")
        run_load("127.0.0.1", port, ["valid"], kinds, 1, args.timeout, 5)  # warm-up: first calls allocate
        before = process_usage(pid) if pid else None
        load_before = os.getloadavg()
        print(f"{len(plan)} requests ({dict((k, plan.count(k)) for k in sorted(set(plan)))}; bodies {sizes}) from "
              f"{args.clients} clients; load average {load_before}", flush=True)
        answers, wall = run_load("127.0.0.1", port, plan, kinds, args.clients, args.timeout, args.retries,
                                 progress=True)
        after = process_usage(pid) if pid else None
    result = {"clients": args.clients, "retries": args.retries, "mix": parse_mix(args.mix), "frames": args.frames,
              "large_side": args.large_side, "large_frames": args.large_frames, "serve_args": args.serve_args,
              "body_sizes": sizes, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "figures": summary(answers, wall),
              "server": server_figures(before, after, wall, result_frames(answers)) if before and after else None}
    print_figures(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {load_before} -> {result['load_average_after']}; {out}")
    figures = result["figures"]
    failed = figures["unanswered"] or figures["unintended"] or figures["not_strict_json"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
