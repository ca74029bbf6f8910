"""Load on a scoring server (`make serve`): many clients at once, a mix of requests, every answer checked.

A load is a plan of requests (their kinds shuffled by a seed), sent by `clients` threads at once, each with its own
HTTP connection per request as independent clients would. Every answer is kept with its status, time and whether its
body is strict JSON (`strict_json`: `NaN` or `Infinity` are not JSON, RFC 8259, and a browser's `JSON.parse` rejects
them). A client told `503` waits the `Retry-After` it is given and asks again, up to `retries` times.

The kinds, as the issue that asked for this load described them (issue 46):

- `valid`: the frames of one sequence as PNG, all readable (the answer is 200, or 503 when the server is full);
- `valid_no_face`: as many grey frames, readable but without a face (200: every frame's `pain_probability` null and
  the reason said; the scorer searches them again rotated and with its second detector, BlazeFace);
- `broken_base64`: the same request with one frame's text that is not base64 (400 naming the row);
- `large_frames`: frames of `large_side` x `large_side` pixels (2000 by default): scored, refused by a frame or
  request limit (400) or by the body limit (413), depending on the server's `serve` settings.

`scripts/load_serve.py` runs a load of at least 400 requests from 24 clients and writes its figures;
`tests/test_serving_load.py` runs a small one in the suite.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

INTENDED = (200, 400, 413, 503)  # what the server may answer under load; anything else, or no answer, is a failure
KINDS = ("valid", "valid_no_face", "broken_base64", "large_frames")


@dataclass(frozen=True)
class LoadRequest:
    """One kind of request: its JSON body and how many frames it sends."""

    kind: str
    body: bytes
    frames: int


@dataclass
class Answer:
    """What one request of the plan got: the last attempt's status (None: no answer, `error` says why), seconds from
    the first attempt's start to the last answer, attempts (1 + the 503s retried), the Retry-After values seen,
    whether the body was strict JSON, and the frames scored (a 200's predictions)."""

    kind: str
    status: int | None = None
    seconds: float = 0.0
    attempts: int = 0
    retry_after: list[str] = field(default_factory=list)
    strict_json: bool = False
    frames_scored: int = 0
    error: str | None = None
    problem: str | None = None  # an answer that is not what its status promises (its body, its predictions)
    predictions: list[dict[str, Any]] | None = None  # a 200's


def refuse_constant(name: str) -> float:
    """`json.loads(..., parse_constant=refuse_constant)`: `NaN`, `Infinity` and `-Infinity` are not JSON."""
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def strict_json(body: bytes) -> Any:
    """The JSON of `body`, or ValueError where it is not strict JSON (NaN, Infinity, not UTF-8, not JSON at all)."""
    return json.loads(body.decode("utf-8"), parse_constant=refuse_constant)


def png_text(frame_bgr: np.ndarray) -> str:
    ok, encoded = cv2.imencode(".png", frame_bgr)
    if not ok:
        raise ValueError(f"cannot encode a frame of shape {frame_bgr.shape} as PNG")
    return base64.b64encode(encoded.tobytes()).decode("ascii")


def body_of(images: Sequence[str]) -> bytes:
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": [[image] for image in images]}}).encode()


def request_kinds(frames_bgr: Sequence[np.ndarray], large_side: int, large_frames: int) -> dict[str, LoadRequest]:
    """The kinds of request (see the module docstring) from frames of one sequence (BGR, as OpenCV decodes);
    `large_frames` frames of `large_side` pixels a side, the sequence's first frames enlarged."""
    images = [png_text(frame) for frame in frames_bgr]
    grey = [png_text(np.full_like(frame, 128)) for frame in frames_bgr]
    broken = [*images[:-1], "%%% not base64 %%%"]
    large = [png_text(cv2.resize(frames_bgr[index % len(frames_bgr)], (large_side, large_side),
                                 interpolation=cv2.INTER_LINEAR)) for index in range(large_frames)]
    return {"valid": LoadRequest("valid", body_of(images), len(images)),
            "valid_no_face": LoadRequest("valid_no_face", body_of(grey), len(grey)),
            "broken_base64": LoadRequest("broken_base64", body_of(broken), len(broken)),
            "large_frames": LoadRequest("large_frames", body_of(large), len(large))}


def request_plan(total: int, mix: Mapping[str, float], seed: int) -> list[str]:
    """`total` request kinds in the proportions of `mix` (largest remainders), shuffled by `seed`."""
    weights = {kind: float(share) for kind, share in mix.items() if share > 0}
    if not weights:
        raise ValueError("the mix of requests is empty")
    exact = {kind: total * share / sum(weights.values()) for kind, share in weights.items()}
    counts = {kind: int(value) for kind, value in exact.items()}
    for kind in sorted(exact, key=lambda k: counts[k] - exact[k])[: total - sum(counts.values())]:
        counts[kind] += 1
    plan = [kind for kind, count in counts.items() for _ in range(count)]
    random.Random(seed).shuffle(plan)
    return plan


def post(host: str, port: int, body: bytes, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """One POST to /invocations on a connection of its own: (status, headers with lower-case names, body)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("POST", "/invocations", body=body, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, {name.lower(): value for name, value in answer.getheaders()}, answer.read()
    finally:
        connection.close()


def checked(answer: Answer, request: LoadRequest, body: bytes) -> None:
    """Fills the answer's `strict_json`, `frames_scored` and `problem` from its body."""
    try:
        parsed = strict_json(body)
    except ValueError as error:
        answer.problem = f"not strict JSON: {error}"
        return
    answer.strict_json = True
    if answer.status == 200:
        predictions = parsed.get("predictions") if isinstance(parsed, dict) else None
        if not isinstance(predictions, list) or len(predictions) != request.frames:
            answer.problem = f"a 200 without one prediction per frame ({request.frames})"
            return
        answer.frames_scored, answer.predictions = len(predictions), predictions
        for row in predictions:
            probability = row.get("pain_probability")
            if probability is None and not row.get("no_score_reason"):
                answer.problem = "a frame without a probability and without a reason"
            elif probability is not None and not 0.0 <= probability <= 1.0:
                answer.problem = f"a pain probability of {probability}"
    elif not (isinstance(parsed, dict) and set(parsed) == {"error_code", "message"}):
        answer.problem = f"an error answer that is not {{error_code, message}}: {body[:200]!r}"


def ask(host: str, port: int, request: LoadRequest, timeout_s: float, retries: int) -> Answer:
    """One request of the plan, a 503 retried after its Retry-After (at most `retries` times)."""
    answer = Answer(request.kind)
    started = time.monotonic()
    while True:
        answer.attempts += 1
        try:
            status, headers, body = post(host, port, request.body, timeout_s)
        except (OSError, http.client.HTTPException) as error:
            answer.status, answer.error = None, f"{type(error).__name__}: {error}"
            break
        answer.status = status
        if status == 503 and "retry-after" in headers:
            answer.retry_after.append(headers["retry-after"])
        if status != 503 or answer.attempts > retries:
            checked(answer, request, body)
            break
        time.sleep(float(headers.get("retry-after") or 1))
    answer.seconds = time.monotonic() - started
    return answer


def run_load(host: str, port: int, plan: Sequence[str], requests: Mapping[str, LoadRequest], clients: int,
             timeout_s: float, retries: int, progress: bool = False) -> tuple[list[Answer], float]:
    """The plan sent by `clients` threads at once; (answers in plan order, wall seconds)."""
    answers: list[Answer | None] = [None] * len(plan)
    cursor = iter(range(len(plan)))
    lock = threading.Lock()
    done = [0]

    def client() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            answers[index] = ask(host, port, requests[plan[index]], timeout_s, retries)
            with lock:
                done[0] += 1
                if progress and done[0] % max(1, len(plan) // 10) == 0:
                    print(f"  {done[0]} of {len(plan)} requests answered", flush=True)

    started = time.monotonic()
    threads = [threading.Thread(target=client, name=f"client-{k}") for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    return [answer for answer in answers if answer is not None], wall


def percentile(values: Sequence[float], share: float) -> float | None:
    """The `share` quantile (0-1) of values, linear between ranks; None without values."""
    if not values:
        return None
    return float(np.quantile(np.asarray(values, dtype=float), share))


def process_usage(pid: int) -> dict[str, float]:
    """A Linux process's resident memory now and at its peak (VmRSS, VmHWM, bytes) and the CPU seconds it has used
    (user and system, all its threads)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
    return {"rss_bytes": fields["VmRSS"], "peak_bytes": fields["VmHWM"], "cpu_s": cpu_s}


def summary(answers: Sequence[Answer], wall_s: float) -> dict[str, Any]:
    """The load's figures: statuses (all, per kind), unanswered and unintended ones, latency, throughput."""
    statuses = Counter("none" if a.status is None else str(a.status) for a in answers)
    per_kind = {kind: dict(Counter("none" if a.status is None else str(a.status) for a in answers if a.kind == kind))
                for kind in KINDS if any(a.kind == kind for a in answers)}
    unintended = [a for a in answers if a.status not in INTENDED]
    scored = sum(a.frames_scored for a in answers)
    seconds = [a.seconds for a in answers if a.status is not None]
    ok_seconds = [a.seconds for a in answers if a.status == 200]
    return {
        "requests": len(answers), "wall_s": round(wall_s, 2), "statuses": dict(sorted(statuses.items())),
        "statuses_per_kind": per_kind, "unanswered": sum(a.status is None for a in answers),
        "unintended": len(unintended), "not_strict_json": sum(a.status is not None and not a.strict_json
                                                              for a in answers),
        "problems": sorted({a.problem for a in answers if a.problem}),
        "errors": sorted({a.error for a in answers if a.error})[:10],
        "first_attempt_503": sum(a.attempts > 1 or a.status == 503 for a in answers),
        "retries": sum(a.attempts - 1 for a in answers),
        "retry_after_values": sorted({value for a in answers for value in a.retry_after}),
        "latency_s": {"p50": percentile(seconds, 0.5), "p95": percentile(seconds, 0.95), "max": max(seconds or [0])},
        "latency_200_s": {"p50": percentile(ok_seconds, 0.5), "p95": percentile(ok_seconds, 0.95)},
        "frames_scored": scored, "frames_per_s": round(scored / wall_s, 2) if wall_s > 0 else None,
        "mean_seconds": round(statistics.fmean(seconds), 3) if seconds else None,
    }


def serving_pid(make_pid: int) -> int:
    """The python process that serves (`python -m pipeline serve`) among `make serve`'s process and its children."""
    def tree(pid: int) -> list[int]:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid] + [grandchild for child in children for grandchild in tree(int(child))]

    for pid in tree(make_pid):
        if b"pipeline\x00serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError(f"no `pipeline serve` process under {make_pid}")
