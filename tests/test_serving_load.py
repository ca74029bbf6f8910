"""Many clients at once: one real `make serve` on loopback (the untrained session model, two scorers, three requests
in flight at most, a 1 MB body limit) under 24 real HTTP clients sending valid, faceless, broken and oversized
requests at once (`pipeline.deployment.serve_load`, what `scripts/load_serve.py` runs at scale); and the model's own
`predict` from twelve threads at once, which failed for 10 of 12 requests before scorers were pooled."""

from __future__ import annotations

import http.client
import io
import json
import os
import subprocess
import threading

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.pyfunc.scoring_server import predictions_to_json

from pipeline.deployment.serve_load import INTENDED, request_kinds, request_plan, run_load, strict_json, summary
from pipeline.runs.serving.mlflow_model import (
    NO_FACE,
    NO_SCORE_COLUMN,
    NOT_FINITE,
    encode_image,
    served_table,
    synthetic_frames,
)
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group
from tests.test_serving import free_port, request, wait_for_ping

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_IN_FLIGHT, SCORERS, MAX_BODY_MB = 3, 2, 1
MIX = {"valid": 2, "valid_no_face": 1, "broken_base64": 1, "large_frames": 1}


@pytest.fixture(scope="module")
def kinds() -> dict:
    """The four kinds of request, from four frames of the tiny twin (160 x 120); the large one two frames of 1500 x
    1500 px, 2.8 MB of JSON: over the 1 MB limit, so 413."""
    kinds = request_kinds(synthetic_frames(4), large_side=1500, large_frames=2)
    assert MAX_BODY_MB * 2**20 < len(kinds["large_frames"].body) < 4 * 2**20
    return kinds


@pytest.fixture(scope="module")
def busy_server(untrained_model, tmp_path_factory):
    own = tmp_path_factory.mktemp("serving_load")
    port = free_port()
    cfg = untrained_model["cfg"]
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve", f"SERVE_PORT={port}",
               f"MODEL_URI={untrained_model['local']}",
               f"ARGS=mlflow.tracking_uri={cfg.mlflow.tracking_uri} serve.max_in_flight={MAX_IN_FLIGHT} "
               f"serve.scorers={SCORERS} serve.max_body_mb={MAX_BODY_MB} serve.timeout_s=60"]
    log = (own / "server.log").open("w")
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        wait_for_ping(port, process, own / "server.log")
        yield {"port": port, "log": own / "server.log"}
    finally:
        stop_process_group(process)
        log.close()


def test_24_clients_at_once_get_intended_answers_in_strict_json(busy_server, kinds) -> None:
    """48 requests from 24 clients at once, none retried: every one answered (no connection dropped), only 200, 400,
    413 and 503; every body strict JSON (a parser that refuses NaN); the 503s say when to come back (Retry-After) and
    name the limit; every valid answer equals the one the server gave alone, so no two requests' scorers mixed; a
    faceless frame is null with its reason."""
    port = busy_server["port"]
    status, alone = request(port, "POST", "/invocations", kinds["valid"].body)
    assert status == 200, alone
    alone_rows = strict_json(alone)["predictions"]
    assert any(row["face_found"] for row in alone_rows), alone_rows

    answers, wall = run_load("127.0.0.1", port, request_plan(48, MIX, seed=0), kinds, clients=24, timeout_s=120,
                             retries=0)
    figures = summary(answers, wall)
    print(f"48 requests from 24 clients, {MAX_IN_FLIGHT} in flight at most: {figures['statuses_per_kind']}, "
          f"{wall:.1f} s, p95 {figures['latency_s']['p95']:.2f} s")
    assert figures["unanswered"] == 0, figures["errors"]
    assert {answer.status for answer in answers} <= set(INTENDED), figures["statuses"]
    assert figures["not_strict_json"] == 0 and not figures["problems"], figures["problems"]
    expected = {"valid": 200, "valid_no_face": 200, "broken_base64": 400, "large_frames": 413}
    for answer in answers:
        assert answer.status in (expected[answer.kind], 503), (answer.kind, answer.status)
    busy = [answer for answer in answers if answer.status == 503]
    assert busy, "24 clients at once and no request beyond the 3 in flight was refused"
    assert all(answer.retry_after and answer.retry_after[0].isdigit() and int(answer.retry_after[0]) >= 1
               for answer in busy), [answer.retry_after for answer in busy]
    assert sum(answer.status != 503 for answer in answers) >= MAX_IN_FLIGHT  # the first ones taken were answered
    assert_answers_as_alone(answers, alone_rows)
    status, body = request(port, "POST", "/invocations", kinds["broken_base64"].body)
    assert status == 400 and "row 3" in strict_json(body)["message"] and "base64" in strict_json(body)["message"]
    assert "Traceback" not in busy_server["log"].read_text()


def assert_answers_as_alone(answers: list, alone_rows: list[dict]) -> None:
    """Every valid answer is the one the server gave that request alone (no two requests' scorers mixed), and a
    faceless frame is null with its reason."""
    for answer in answers:
        if answer.kind == "valid" and answer.status == 200:
            assert [row["face_found"] for row in answer.predictions] == [row["face_found"] for row in alone_rows]
            np.testing.assert_allclose([row["pain_probability"] or np.nan for row in answer.predictions],
                                       [row["pain_probability"] or np.nan for row in alone_rows], atol=1e-6)
        if answer.kind == "valid_no_face" and answer.status == 200:
            assert all(row["pain_probability"] is None and row["pain"] is None and row[NO_SCORE_COLUMN] == NO_FACE
                       for row in answer.predictions), answer.predictions


def test_clients_that_honour_retry_after_all_get_their_answer(busy_server, kinds) -> None:
    """The same clients, each asking again after the Retry-After it is told: every request gets the answer of its
    kind (the valid ones, scored two at a time, as when alone), none is left at 503."""
    status, alone = request(busy_server["port"], "POST", "/invocations", kinds["valid"].body)
    assert status == 200, alone
    plan = request_plan(20, MIX, seed=1)
    answers, wall = run_load("127.0.0.1", busy_server["port"], plan, kinds, clients=20, timeout_s=120, retries=60)
    figures = summary(answers, wall)
    print(f"20 requests, retried after 503: {figures['statuses_per_kind']}, {figures['retries']} retries, "
          f"{wall:.1f} s")
    expected = {"valid": 200, "valid_no_face": 200, "broken_base64": 400, "large_frames": 413}
    assert [answer.status for answer in answers] == [expected[kind] for kind in plan], figures
    assert figures["not_strict_json"] == 0 and not figures["problems"], figures["problems"]
    assert_answers_as_alone(answers, strict_json(alone)["predictions"])


def test_every_answer_is_json_other_paths_and_errors_included(busy_server) -> None:
    """What MLflow answers in text (`/ping` and `/health` a newline, `/version` the bare version, 415 for another
    content type, FastAPI's 404 and 405) reaches the client as JSON too."""
    port = busy_server["port"]
    answers = {path: request(port, "GET", path) for path in ("/ping", "/health", "/version", "/no-such-path",
                                                            "/invocations")}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/invocations", body=b"image\nabc\n", headers={"Content-Type": "text/plain"})
    reply = connection.getresponse()
    answers["text/plain"] = (reply.status, reply.read())
    connection.close()
    assert {key: status for key, (status, _) in answers.items()} == {
        "/ping": 200, "/health": 200, "/version": 200, "/no-such-path": 404, "/invocations": 405, "text/plain": 415}
    parsed = {key: strict_json(body) for key, (_, body) in answers.items()}
    assert parsed["/ping"] == parsed["/health"] == {"status": "ok"}
    assert parsed["/version"] == {"version": mlflow.__version__}
    for key in ("/no-such-path", "/invocations", "text/plain"):
        assert set(parsed[key]) == {"error_code", "message"} and "\n" not in parsed[key]["message"], parsed[key]


def test_twelve_requests_at_once_on_a_fresh_model_are_all_scored(untrained_model) -> None:
    """The issue's first finding, in the model itself: twelve threads call `predict` of a freshly loaded model at once
    with frames without a face (MTCNN's retries, then BlazeFace, whose interpreter one thread at a time may use).
    Before the pool, 10 of 12 failed (RuntimeError); now each is scored, as when alone."""
    model = mlflow.pyfunc.load_model(str(untrained_model["local"]))
    frames = [np.full((120, 160, 3), 128, np.uint8)] * 4 + synthetic_frames(4)
    request_frame = pd.DataFrame({"image": [encode_image(frame) for frame in frames]})
    answers: list = [None] * 12

    def one(index: int) -> None:
        try:
            answers[index] = model.predict(request_frame)
        except Exception as error:  # noqa: BLE001 - what the request would have answered
            answers[index] = error

    threads = [threading.Thread(target=one, args=(index,)) for index in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [answer for answer in answers if isinstance(answer, Exception)]
    assert not failed, failed
    alone = model.predict(request_frame)
    for answer in answers:
        pd.testing.assert_frame_equal(answer, alone, atol=1e-6)
    assert list(alone[NO_SCORE_COLUMN][:4]) == [NO_FACE] * 4


def test_a_frame_without_a_score_is_null_with_its_reason_never_nan() -> None:
    """What the model returns is written by MLflow's own JSON writer: no face, and a face whose network gave NaN,
    come out as null with the reason; a strict parser reads every answer."""
    table = pd.DataFrame({"frame": [0, 1, 2], "face_found": [True, False, True],
                          "pain_probability": [0.25, np.nan, np.nan], "pain": [False, None, False]})
    written = io.StringIO()
    predictions_to_json(served_table(table), written)
    rows = strict_json(written.getvalue().encode())["predictions"]
    assert rows == [
        {"frame": 0, "face_found": True, "pain_probability": 0.25, "pain": False, NO_SCORE_COLUMN: None},
        {"frame": 1, "face_found": False, "pain_probability": None, "pain": None, NO_SCORE_COLUMN: NO_FACE},
        {"frame": 2, "face_found": True, "pain_probability": None, "pain": None, NO_SCORE_COLUMN: NOT_FINITE}]
    with pytest.raises(ValueError, match="NaN is not JSON"):
        strict_json(json.dumps({"pain_probability": float("nan")}).encode())
