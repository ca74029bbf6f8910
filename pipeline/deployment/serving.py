"""`make serve`: MLflow's scoring server for a pain model, behind a guard that bounds what a request may ask.

The app that answers is MLflow's own (`mlflow.pyfunc.scoring_server`: `/invocations`, `/ping`, `/health`,
`/version`, the same JSON formats as `mlflow models serve`), served by uvicorn in this process. Before it starts:

- a `serve.host` that is not loopback is refused unless `serve.insecure=true`: the server has no authentication or
  TLS (put a reverse proxy that adds them in front, on loopback);
- the model folder is checked to be the project's before MLflow loads it (`pipeline.runs.serving.model_trust`), so a
  folder handed over or a moved alias cannot run its code here;
- OpenCV's own pixel cap is set to `serve.max_frame_pixels` before OpenCV loads, and checked to hold.

In front of the app, `RequestGuard`:

- takes at most `serve.max_in_flight` requests to `/invocations` at once (read, waiting for a scorer, or scored:
  `serve.scorers` of them are scored at once, `pipeline.runs.serving.scorer_pool`); one beyond gets 503 with a
  `Retry-After` header (the mean seconds of the last requests scored) at once, its body unread
  (uvicorn reads and drops what the client still sends after the answer, so its connection is not reset);
- refuses a body over `serve.max_body_mb` with 413 before the model sees it (the declared length, or the bytes
  received so far: a body without a length cannot go round the limit);
- sends MLflow's plain answers to `/ping`, `/health` (`"\n"`) and `/version` (the bare version) as JSON objects;
- turns every error answer into one line of JSON, `{"error_code": ..., "message": ...}`: no stack trace, no echo of
  the request's data;
- names the time limit in the 504 of a request that ran over it.

The model itself (`pipeline.runs.serving.mlflow_model`, reading frames as `pipeline.runs.serving.serving_input` says)
refuses more than `serve.max_frames` frames, anything but PNG and JPEG, frames over `serve.max_frame_side` /
`max_frame_pixels` and requests over `serve.max_request_pixels` (from the headers, before decoding), `path` inputs
unless `serve.path_root` names a folder (then only regular files beneath it, opened without following links), and stops
reading and scoring at `serve.timeout_s`.

This module leaves OpenCV unloaded until `run_serve` has set its cap: what loads it is imported inside functions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omegaconf import DictConfig

from pipeline.data.personalise import not_served
from pipeline.runs.serving.model_trust import UntrustedModel, check_model_folder
from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels, one_line, opencv_caps_at
from pipeline.runs.store import tracking
from pipeline.runs.store.registry import champion_uri
from pipeline.runs.store.tracking_server import is_loopback
from pipeline.utils.cpus import available_cpus

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# MLflow's answers to these, as its content type says JSON: "\n" (/ping, /health) and the bare version (/version);
# sent as {"status": "ok"} and {"version": "3.17.2"} instead, so that every answer a client reads is JSON
PLAIN_ANSWERS = {"/ping": "status", "/health": "status", "/version": "version"}
RECENT_ANSWERS = 20  # the requests scored last, whose mean time gives a 503's Retry-After


class BodyTooLarge(Exception):
    """A request body over `serve.max_body_mb`, declared or received."""


class ClientGone(Exception):
    """The client closed the connection before its request was read."""


class RequestGuard:
    """ASGI middleware around an ASGI app: a bound on the requests in flight, a body limit and one-line error answers
    (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: ServingLimits) -> None:
        self.app, self.limits = app, limits
        self.in_flight = 0  # requests to /invocations taken and not yet answered (one event loop: no lock needed)
        self.recent: deque[float] = deque(maxlen=RECENT_ANSWERS)  # seconds of the last requests scored
        self.executor_set = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.executor_set:  # MLflow scores in the loop's default executor: a thread for each request taken
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(self.limits.max_in_flight, thread_name_prefix="scoring"))
            self.executor_set = True
        if scope.get("path") != "/invocations":
            await self.guarded(scope, receive, send)
            return
        if self.in_flight >= self.limits.max_in_flight:
            await self.refuse_busy(scope, send)
            return
        self.in_flight += 1
        started = time.monotonic()
        try:
            status = await self.guarded(scope, receive, send)
        finally:
            self.in_flight -= 1
        if status is not None and status < 400:
            self.recent.append(time.monotonic() - started)

    async def guarded(self, scope: Scope, receive: Receive, send: Send) -> int | None:
        """The app's answer to a request whose body is within the limit (413 otherwise), errors as one line of JSON;
        the status answered (None: the client went away first)."""
        try:
            body = await self.read_body(scope, receive)
        except BodyTooLarge:
            await self.answer(send, *self.too_large())
            return 413
        except ClientGone:
            return None
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Message = {}
        held = bytearray()
        plain = scope.get("path") in PLAIN_ANSWERS  # MLflow answers these in text that is not JSON

        async def guarded_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                if message["status"] < 400 and not plain:
                    await send(message)
                return
            if message["type"] != "http.response.body" or (start.get("status", 200) < 400 and not plain):
                await send(message)
                return
            held.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            if start["status"] < 400:
                text = held.decode("utf-8", "replace").strip() or "ok"
                await self.send_json(send, start["status"], {PLAIN_ANSWERS[scope["path"]]: text})
            else:
                await self.answer(send, start["status"], *self.error_of(start["status"], bytes(held)))

        await self.app(scope, replay, guarded_send)
        return start.get("status")

    async def read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request's body; BodyTooLarge over the limit, declared or received (uvicorn reads and drops the rest
        after the answer, so the client still gets it); ClientGone when the client went away."""
        limit = self.limits.max_body_bytes
        if self.declared_too_large(scope):
            raise BodyTooLarge
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            body += message.get("body", b"")
            if len(body) > limit:
                raise BodyTooLarge
            if not message.get("more_body", False):
                return bytes(body)

    def declared_too_large(self, scope: Scope) -> bool:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        return declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes

    async def refuse_busy(self, scope: Scope, send: Send) -> None:
        """503 with Retry-After to a request beyond `max_in_flight`, its body unread (413 for one declared over the
        limit: a smaller body is the first change its client must make)."""
        if self.declared_too_large(scope):
            await self.answer(send, *self.too_large())
            return
        retry_s = self.retry_after_s()
        await self.answer(send, 503, "TEMPORARILY_UNAVAILABLE",
                          f"the server is scoring {self.in_flight} requests, its limit "
                          f"({ServingLimits.ENV['max_in_flight']}): retry after {retry_s} s",
                          headers=[(b"retry-after", str(retry_s).encode())])

    def retry_after_s(self) -> int:
        """The mean seconds the last requests scored spent in flight (about the time the requests now in flight need
        to be through), rounded up; 1 before any. The time between two answers instead (that over the requests in
        flight) kept the server no busier under 24 clients and left 12 of 160 requests refused after 100 tries each,
        as the refused clients outran one another (scripts/load_serve.py --retries 100)."""
        return max(1, math.ceil(sum(self.recent) / len(self.recent))) if self.recent else 1

    def too_large(self) -> tuple[int, str, str]:
        return (413, "REQUEST_TOO_LARGE", f"request body over the limit of {self.limits.max_body_mb:g} MB "
                                          f"({ServingLimits.ENV['max_body_mb']}): send fewer or smaller frames")

    def error_of(self, status: int, body: bytes) -> tuple[str, str]:
        """(error_code, one-line message) of an error answer from the app."""
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "message" in parsed:
            code, message = str(parsed.get("error_code") or "BAD_REQUEST"), str(parsed["message"])
        else:
            code, message = "BAD_REQUEST", body.decode("utf-8", "replace")
        if status == 504 and "time limit" not in message:  # MLflow's own timeout, a little above the model's
            code, message = "DEADLINE_EXCEEDED", (f"the request ran over its time limit of {self.limits.timeout_s:g} s"
                                                  f" ({ServingLimits.ENV['timeout_s']})")
        return code, one_line(message)

    @classmethod
    async def answer(cls, send: Send, status: int, code: str, message: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await cls.send_json(send, status, {"error_code": code, "message": message}, headers)

    @staticmethod
    async def send_json(send: Send, status: int, answer: dict[str, str],
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
        content = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode()), *(headers or [])]})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def limits_of(serve: Mapping[str, Any], path_root: str | None = None) -> ServingLimits:
    """The `serve` group's settings as limits; `path_root` (`make serve SERVE_PATH_ROOT=`) before `serve.path_root`, a
    relative one taken from the current folder."""
    return ServingLimits.from_settings({**serve, "path_root": path_root or serve["path_root"]},
                                       names={"path_root": "SERVE_PATH_ROOT" if path_root else "serve.path_root"})


def check_host(host: str, insecure: bool) -> None:
    """A host (`serve.host`) other than loopback is refused unless `serve.insecure=true`: the server asks no one who
    they are."""
    if not is_loopback(host) and not insecure:
        raise SystemExit(f"serve: serve.host={host} is not a loopback address, and the scoring server has no "
                         f"authentication or TLS: serve on 127.0.0.1 behind a reverse proxy that adds them, or set "
                         f"serve.insecure=true to open it to every machine that reaches this one")


def guarded_app(model_path: str, limits: ServingLimits) -> ASGIApp:
    """MLflow's scoring app for the model at `model_path` (a local folder, checked to be the project's before MLflow
    loads it), its model loaded with `limits`."""
    from mlflow.pyfunc import scoring_server

    check_model_folder(model_path)
    os.environ.update(limits.to_env())  # what the model reads when it is loaded
    # MLflow's own per-request timeout, kept above the model's so the model's one-line 504 answers first
    os.environ["MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"] = str(int(limits.timeout_s) + 5)
    model = scoring_server.load_model_with_mlflow_config(model_path)
    python_model = model.unwrap_python_model()
    personalise = python_model.scorer.personalise
    if personalise.personal:  # said once at start, not as the answer to every request
        raise SystemExit(f"serve: {not_served(personalise)}")
    python_model.pool.fill()  # every scorer ready before the first request
    return RequestGuard(scoring_server.init(model), limits)


def threads_per_scorer(scorers: int) -> int:
    """Torch threads for each of `scorers` scoring at once: this process's CPUs shared among them (one at least),
    so that two scorers on two cores do not run four threads that wait for each other."""
    return max(1, available_cpus() // scorers)


def run_serve(cfg: DictConfig, model_uri: str | None = None, path_root: str | None = None) -> None:
    """`make serve [MODEL_URI=...] [SERVE_PATH_ROOT=...]`: the champion (or `model_uri`) on
    http://<serve.host>:<serve.port>."""
    check_host(str(cfg.serve.host), bool(cfg.serve.insecure))
    try:
        limits = limits_of(cfg.serve, path_root)
    except ValueError as error:
        raise SystemExit(f"serve: {error}") from None
    cap_opencv_pixels(limits.max_frame_pixels)  # before anything below loads OpenCV
    import mlflow
    import torch
    import uvicorn
    from mlflow.exceptions import MlflowException

    torch.set_num_threads(threads_per_scorer(limits.scorers))
    mlflow.set_tracking_uri(tracking.store_uri(cfg.mlflow.tracking_uri))
    uri = model_uri or champion_uri(cfg.model.name, cfg.task.name)
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri)
        app = guarded_app(local, limits)
    except UntrustedModel as error:
        raise SystemExit(f"serve: refused model {uri}: {error}") from None
    except MlflowException as error:
        raise SystemExit(f"serve: {error.message}") from None
    if not opencv_caps_at(limits.max_frame_pixels):
        raise SystemExit(f"serve: OpenCV was loaded before its pixel cap could be set to {limits.max_frame_pixels}")
    paths = f"path inputs under {limits.path_root}" if limits.path_root else "path inputs off"
    opened = "" if is_loopback(str(cfg.serve.host)) else "; OPEN to other machines: no authentication, no TLS"
    print(f"serving {uri} on http://{cfg.serve.host}:{cfg.serve.port}/invocations ({paths}; at most "
          f"{limits.max_frames} frames, {limits.max_body_mb:g} MB, {limits.max_request_pixels} pixels and "
          f"{limits.timeout_s:g} s per request; a frame at most {limits.max_frame_side} px a side and "
          f"{limits.max_frame_pixels} pixels, OpenCV capped at that; {limits.max_in_flight} requests at once, "
          f"{limits.scorers} scored at a time on {torch.get_num_threads()} torch threads each{opened})", flush=True)
    uvicorn.run(app, host=str(cfg.serve.host), port=int(cfg.serve.port), log_level="warning")
