"""`make serve`: MLflow's scoring server for a pain model, behind a guard that bounds what a request may ask.

The app that answers is MLflow's own (`mlflow.pyfunc.scoring_server`: `/invocations`, `/ping`, `/health`,
`/version`, the same JSON formats as `mlflow models serve`), served by uvicorn in this process. Before it starts:

- a `serve.host` that is not loopback is refused unless `serve.insecure=true`: the server has no authentication or
  TLS (put a reverse proxy that adds them in front, on loopback);
- the model folder is checked to be the project's before MLflow loads it (`pipeline.runs.serving.model_trust`), so a
  folder handed over or a moved alias cannot run its code here;
- OpenCV's own pixel cap is set to `serve.max_frame_pixels` before OpenCV loads, and checked to hold.

In front of the app, `RequestGuard`:

- refuses a body over `serve.max_body_mb` with 413 before the model sees it (the declared length, or the bytes
  received so far: a body without a length cannot go round the limit);
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

import json
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from omegaconf import DictConfig

from pipeline.data.personalise import not_served
from pipeline.runs.serving.model_trust import UntrustedModel, check_model_folder
from pipeline.runs.serving.serving_input import ServingLimits, cap_opencv_pixels, one_line, opencv_caps_at
from pipeline.runs.store import tracking
from pipeline.runs.store.registry import champion_uri
from pipeline.runs.store.tracking_server import is_loopback

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestGuard:
    """ASGI middleware: a body limit and one-line error answers around an ASGI app (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: ServingLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        too_large = (413, "REQUEST_TOO_LARGE", f"request body over the limit of {self.limits.max_body_mb:g} MB "
                                               f"({ServingLimits.ENV['max_body_mb']}): send fewer or smaller frames")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self.answer(send, *too_large)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await self.answer(send, *too_large)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        start: Message = {}
        held = bytearray()

        async def guarded_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                if message["status"] < 400:
                    await send(message)
                return
            if message["type"] != "http.response.body" or start.get("status", 200) < 400:
                await send(message)
                return
            held.extend(message.get("body", b""))
            if not message.get("more_body", False):
                await self.answer(send, start["status"], *self.error_of(start["status"], bytes(held)))

        await self.app(scope, replay, guarded_send)

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

    @staticmethod
    async def answer(send: Send, status: int, code: str, message: str) -> None:
        content = json.dumps({"error_code": code, "message": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode())]})
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
    personalise = model.unwrap_python_model().scorer.personalise
    if personalise.personal:  # said once at start, not as the answer to every request
        raise SystemExit(f"serve: {not_served(personalise)}")
    return RequestGuard(scoring_server.init(model), limits)


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
    import uvicorn
    from mlflow.exceptions import MlflowException


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
          f"{limits.max_frame_pixels} pixels, OpenCV capped at that{opened})", flush=True)
    uvicorn.run(app, host=str(cfg.serve.host), port=int(cfg.serve.port), log_level="warning")
