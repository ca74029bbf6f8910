"""The scoring server reads only what it is sent: one real `make serve` on loopback (MLflow's scoring app behind the
request guard), the untrained session model, every kind of request against that one server."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException

from pipeline.deployment.predict import run_predict, sampled_frames
from pipeline.runs.launchers import stop_process_group
from pipeline.runs.mlflow_model import ServingLimits, encode_image, frames_from_input
from pipeline.utils.paths import PROJECT_ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_FRAMES, MAX_BODY_MB = 8, 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def twin_clip(cfg) -> Path:
    return sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]


@pytest.fixture(scope="module")
def server(untrained_model, tmp_path_factory):
    """`make serve` of the untrained model, path inputs allowed under a folder of its own, small limits."""
    own = tmp_path_factory.mktemp("serving")
    allowed = own / "allowed frames"
    allowed.mkdir()
    port = free_port()
    cfg = untrained_model["cfg"]
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve", f"SERVE_PORT={port}",
               f"MODEL_URI={untrained_model['local']}", f"SERVE_PATH_ROOT={allowed}",
               f"ARGS=mlflow.tracking_uri={cfg.mlflow.tracking_uri} serve.max_frames={MAX_FRAMES} "
               f"serve.max_body_mb={MAX_BODY_MB} serve.timeout_s=20"]
    log = (own / "server.log").open("w")
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if request(port, "GET", "/ping")[0] == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, (own / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the scoring server did not answer /ping within 180 s"
            time.sleep(0.5)
        yield {"port": port, "allowed": allowed, "own": own, "log": own / "server.log"}
    finally:
        stop_process_group(process)
        log.close()


def request(port: int, method: str, url: str, body: bytes | None = None, chunked: bool = False) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            connection.request(method, url, body=iter([body or b""]), headers=headers, encode_chunked=True)
        else:
            connection.request(method, url, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def invoke(port: int, columns: list[str], rows: list[list], params: dict | None = None) -> tuple[int, dict]:
    payload: dict = {"dataframe_split": {"columns": columns, "data": rows}}
    if params:
        payload["params"] = params
    status, body = request(port, "POST", "/invocations", json.dumps(payload).encode())
    return status, json.loads(body)


def assert_one_line_error(answer: dict, *words: str) -> None:
    assert set(answer) == {"error_code", "message"}, answer
    message = answer["message"]
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message, message
    for word in words:
        assert word in message, message


def test_the_server_answers_as_predict_and_refuses_what_it_must(server, untrained_model, tmp_path) -> None:
    port, allowed = server["port"], server["allowed"]
    cfg = untrained_model["cfg"]
    video = twin_clip(cfg)
    run_predict(cfg, video=str(video), model_uri=untrained_model["uri"], out=str(tmp_path / "predict"))
    expected = pd.read_csv(tmp_path / "predict" / f"{video.name}.csv").head(6)
    _, _, frames = next(sampled_frames(video, 5))

    # the normal request: what `make predict` says of the same frames
    status, answer = invoke(port, ["image"], [[encode_image(f)] for f in frames[:6]])
    assert status == 200, answer
    served = pd.DataFrame(answer["predictions"])
    assert list(served.frame) == list(range(6)) and list(served.face_found) == list(expected.face_found)
    # float32 noise only: predict scored the whole video in batches of 32, the server these 6 frames as one batch,
    # and oneDNN picks its kernels by batch shape (up to 2e-5 apart on an Intel Xeon with AMX; the ONNX parity bound)
    np.testing.assert_allclose(served.pain_probability.astype(float), expected.pain_probability, atol=1e-4)

    # a path under the allowed folder is read, and gives the same answer as the frame sent
    cv2.imwrite(str(allowed / "frame 0.png"), frames[0])
    status, answer = invoke(port, ["path"], [["frame 0.png"], [str(allowed / "frame 0.png")]])
    assert status == 200, answer
    assert [row["pain_probability"] for row in answer["predictions"]] == pytest.approx(
        [served.pain_probability[0]] * 2, abs=1e-6)

    # outside it: refused alike whether the file exists or not, through `..`, an absolute path or a symlink
    outside = server["own"] / "outside.png"
    cv2.imwrite(str(outside), frames[0])
    (allowed / "link.png").symlink_to(outside)
    for path in ("/etc/passwd", "/etc/no-such-file", "../outside.png", str(outside), "link.png"):
        status, answer = invoke(port, ["path"], [[path]])
        assert status == 400, (path, answer)
        assert_one_line_error(answer, "row 0", "outside the folder this server reads from")

    # a non-image under it, bad base64, a picture that is no image: one line naming the row, no stack trace
    (allowed / "notes.png").write_text("not an image\n")
    status, answer = invoke(port, ["path"], [["notes.png"]])
    assert status == 400 and "no readable image file" in answer["message"]
    assert_one_line_error(answer, "row 0")
    status, answer = invoke(port, ["image"], [[encode_image(frames[0])], ["%%% not base64"]])
    assert status == 400
    assert_one_line_error(answer, "row 1", "base64")

    # over the frames limit: 400 naming it
    status, answer = invoke(port, ["image"], [[encode_image(frames[0])]] * (MAX_FRAMES + 1))
    assert status == 400
    assert_one_line_error(answer, f"{MAX_FRAMES + 1} frames", f"limit is {MAX_FRAMES}")

    # over the body limit: 413 naming it, with a declared length and without one (chunked)
    big = json.dumps({"dataframe_split": {"columns": ["image"], "data": [["A" * (MAX_BODY_MB * 1024 * 1024)]]}})
    for chunked in (False, True):
        status, body = request(port, "POST", "/invocations", big.encode(), chunked=chunked)
        assert status == 413, (chunked, body[:300])
        assert_one_line_error(json.loads(body), f"limit of {MAX_BODY_MB} MB")

    # over the time limit (a client may shorten its own): 504 naming it
    status, answer = invoke(port, ["image"], [[encode_image(f)] for f in frames[:2]], params={"timeout_s": 1e-6})
    assert status == 504
    assert_one_line_error(answer, "time limit of 1e-06 s")

    # and the server still answers
    assert invoke(port, ["image"], [[encode_image(frames[0])]])[0] == 200
    assert "Traceback" not in server["log"].read_text()  # errors are answers, not crashes


def test_path_inputs_are_off_unless_a_folder_is_allowed(tmp_path) -> None:
    cv2.imwrite(str(tmp_path / "frame.png"), np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(MlflowException, match="'path' inputs are off"):
        frames_from_input(pd.DataFrame({"path": [str(tmp_path / "frame.png")]}), ServingLimits())
    limits = ServingLimits.from_env({"PAIN_SERVE_PATH_ROOT": str(tmp_path), "PAIN_SERVE_MAX_FRAMES": "2"})
    assert limits.path_root == tmp_path.resolve() and limits.max_frames == 2
    assert len(frames_from_input(pd.DataFrame({"path": ["frame.png"]}), limits)) == 1
    with pytest.raises(ValueError, match="PAIN_SERVE_TIMEOUT_S=soon: not a number"):
        ServingLimits.from_env({"PAIN_SERVE_TIMEOUT_S": "soon"})
