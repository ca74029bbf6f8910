"""The scoring server reads only what it is sent: one real `make serve` on loopback (MLflow's scoring app behind the
request guard), the untrained session model, every kind of request against that one server; and one real `mlflow
models serve` of the same model, whose errors are one line too."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from omegaconf import OmegaConf

from pipeline.deployment.predict import run_predict
from pipeline.deployment.serve_load import serving_pid
from pipeline.deployment.video_frames import sampled_frames
from pipeline.runs.serving.mlflow_model import encode_image, frames_from_input
from pipeline.runs.serving.serving_input import ServingLimits
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group
from tests.image_files import bomb_png

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_FRAMES, MAX_BODY_MB = 8, 1
# small caps, so that real frames a test makes cheaply are over them (the twin's frames are 160 x 120)
MAX_SIDE, MAX_FRAME_PIXELS, MAX_REQUEST_PIXELS = 1024, 250_000, 400_000
GIB = 1024 ** 3


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
               f"serve.max_body_mb={MAX_BODY_MB} serve.timeout_s=20 serve.max_frame_side={MAX_SIDE} "
               f"serve.max_frame_pixels={MAX_FRAME_PIXELS} serve.max_request_pixels={MAX_REQUEST_PIXELS}"]
    log = (own / "server.log").open("w")
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    try:
        wait_for_ping(port, process, own / "server.log")
        yield {"port": port, "allowed": allowed, "own": own, "log": own / "server.log", "pid": serving_pid(process.pid)}
    finally:
        stop_process_group(process)
        log.close()




def peak_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def wait_for_ping(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    """Until the scoring server `process` started answers /ping on `port`; its log's tail if it dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if request(port, "GET", "/ping")[0] == 200:
                return
        except OSError:
            pass
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the scoring server did not answer /ping within {timeout_s:.0f} s"
        time.sleep(0.5)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


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


def test_image_bombs_are_refused_from_their_header_with_the_server_under_1_gib(server) -> None:
    """A 0.9 MB PNG whose header says 30000 x 30000 (2.7 GB as BGR; a file under the path root, as the body limit
    keeps it out of a request here), its header alone sent as an image, and a real PNG and JPEG written by OpenCV just
    over the caps: refused from the header, before decoding, and the serving process's peak memory (VmHWM) stays as
    it was and under 1 GiB. First in the module, so that the peak is the server's start (0.96 GiB on a 2-core Xeon,
    0.57 of it torch's import) and not that of the frames other tests have it score (1.03 GiB). Before headers were
    read, the path request took 43 s and grew VmHWM from 0.96 to 6.0 GiB."""
    port, allowed, pid = server["port"], server["allowed"], server["pid"]
    bomb = bomb_png(30000, 30000)
    assert len(bomb) < 1_000_000
    (allowed / "bomb.png").write_bytes(bomb)
    side = cv2.imencode(".png", np.zeros((4, MAX_SIDE + 1, 3), np.uint8))[1].tobytes()
    pixels = cv2.imencode(".jpg", np.zeros((500, 501, 3), np.uint8), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    before = peak_bytes(pid)
    started = time.monotonic()
    for column, value, words in (
            ("path", "bomb.png", ("row 0", "30000 x 30000 pixels", f"limit is {MAX_SIDE} on either side")),
            ("image", b64(bomb_png(30000, 30000, rows=0)), ("row 0", "30000 x 30000 pixels")),
            ("image", b64(side), ("row 0", f"{MAX_SIDE + 1} x 4 pixels", "on either side")),
            ("image", b64(pixels), ("row 0", "501 x 500 = 250500 pixels", f"limit is {MAX_FRAME_PIXELS}"))):
        status, answer = invoke(port, [column], [[value]])
        assert status == 400, (column, answer)
        assert_one_line_error(answer, *words)
    seconds = time.monotonic() - started
    after = peak_bytes(pid)
    print(f"serving process VmHWM {before / 2**20:.0f} MiB before the bombs, {after / 2**20:.0f} MiB after; "
          f"4 refusals in {seconds:.2f} s")
    assert after - before < 64 * 2**20, f"the bombs raised the peak from {before / 2**20:.0f} to " \
                                        f"{after / 2**20:.0f} MiB"
    assert after < GIB, f"peak {after / 2**20:.0f} MiB ({before / 2**20:.0f} MiB before the bombs)"
    assert invoke(port, ["path"], [["bomb.png"], ["bomb.png"]])[0] == 400  # and the server still answers


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
    for path in ("/etc/passwd", "/etc/no-such-file", "../outside.png", str(outside)):
        status, answer = invoke(port, ["path"], [[path]])
        assert status == 400, (path, answer)
        assert_one_line_error(answer, "row 0", "outside the folder this server reads from")
    status, answer = invoke(port, ["path"], [["link.png"]])  # a link is not followed, wherever it leads
    assert status == 400, answer
    assert_one_line_error(answer, "row 0", "'link.png' is a symbolic link")

    # a non-image under it, bad base64, a picture that is no image: one line naming the row, no stack trace
    (allowed / "notes.png").write_text("not an image\n")
    status, answer = invoke(port, ["path"], [["notes.png"]])
    assert status == 400, answer
    assert_one_line_error(answer, "row 0", "not a PNG or JPEG image")
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
    # the limit covers reading the frames: this row's error would be a 400, but time ran out before it was read
    status, answer = invoke(port, ["image"], [["%%% not base64"]], params={"timeout_s": 1e-6})
    assert status == 504, answer

    # and the server still answers
    assert invoke(port, ["image"], [[encode_image(frames[0])]])[0] == 200
    assert "Traceback" not in server["log"].read_text()  # errors are answers, not crashes


def test_path_inputs_are_off_unless_a_folder_is_allowed(tmp_path) -> None:
    cv2.imwrite(str(tmp_path / "frame.png"), np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(MlflowException, match="'path' inputs are off"):
        frames_from_input(pd.DataFrame({"path": [str(tmp_path / "frame.png")]}), ServingLimits.from_env({}))
    limits = ServingLimits.from_env({"PAIN_SERVE_PATH_ROOT": str(tmp_path), "PAIN_SERVE_MAX_FRAMES": "2"})
    assert limits.path_root == tmp_path.resolve() and limits.max_frames == 2
    assert len(frames_from_input(pd.DataFrame({"path": ["frame.png"]}), limits)) == 1
    with pytest.raises(ValueError, match="PAIN_SERVE_TIMEOUT_S=soon: not a number"):
        ServingLimits.from_env({"PAIN_SERVE_TIMEOUT_S": "soon"})


def test_only_png_and_jpeg_are_read_told_by_their_first_bytes(server) -> None:
    """TIFF, WebP, PNM, JPEG 2000, HDR, BMP, GIF (all of which OpenCV decodes), and a PNG named .jpg: the kind is
    what the first bytes say, whatever the name; a request over the pixels of a request is refused at the row that
    passes them."""
    port, allowed = server["port"], server["allowed"]
    picture = np.full((64, 64, 3), 90, np.uint8)  # OpenJPEG's default resolutions need at least 32 px a side
    for suffix, kind in ((".tiff", "TIFF"), (".webp", "WebP"), (".ppm", "PNM"), (".pfm", "PNM"), (".jp2", "JPEG 2000"),
                         (".hdr", "HDR"), (".bmp", "BMP"), (".gif", "GIF")):
        ok, encoded = cv2.imencode(suffix, picture.astype(np.float32) / 255 if suffix in (".hdr", ".pfm") else picture)
        assert ok, suffix
        status, answer = invoke(port, ["image"], [[encode_image(picture)], [b64(encoded.tobytes())]])
        assert status == 400, (suffix, answer)
        assert_one_line_error(answer, "row 1", f"the image is {kind}", "PNG or JPEG only")
        (allowed / f"frame{suffix}").write_bytes(encoded.tobytes())
        status, answer = invoke(port, ["path"], [[f"frame{suffix}"]])
        assert status == 400 and kind in answer["message"], (suffix, answer)
    (allowed / "really a png.jpg").write_bytes(base64.b64decode(encode_image(picture)))
    assert invoke(port, ["path"], [["really a png.jpg"]])[0] == 200

    half = encode_image(np.zeros((450, 450, 3), np.uint8), ".jpg")  # 202500 pixels: two are over the request's cap
    status, answer = invoke(port, ["image"], [[half], [half]])
    assert status == 400, answer
    assert_one_line_error(answer, "row 1", "405000 pixels", f"limit is {MAX_REQUEST_PIXELS}")


def test_path_inputs_read_regular_files_only_never_through_a_link(server) -> None:
    """Under the path root: a link to a file beside it, a link to a folder outside, a loop of links, a FIFO (which
    would block a plain open until a writer came), a folder and a 300-character name: each one line naming the row,
    no path of the server's, and the server answers at once."""
    port, allowed, own = server["port"], server["allowed"], server["own"]
    frame = np.full((40, 48, 3), 90, np.uint8)
    cv2.imwrite(str(allowed / "plain.png"), frame)
    (allowed / "beside.png").symlink_to(allowed / "plain.png")
    (allowed / "loop a").symlink_to(allowed / "loop b")
    (allowed / "loop b").symlink_to(allowed / "loop a")
    os.mkfifo(allowed / "fifo.png")
    (allowed / "sub").mkdir()
    outside = own / "elsewhere"
    outside.mkdir()
    cv2.imwrite(str(outside / "plain.png"), frame)
    (allowed / "up").symlink_to(outside)
    assert invoke(port, ["path"], [["plain.png"]])[0] == 200
    for path, words in (("beside.png", ("is a symbolic link",)), ("loop a", ("is a symbolic link",)),
                        ("loop a/x.png", ("symbolic link",)), ("fifo.png", ("not a regular file",)),
                        ("sub", ("not a regular file",)), ("up/plain.png", ("outside the folder",)),
                        ("x" * 300, ("cannot be opened", "File name too long"))):
        started = time.monotonic()
        status, answer = invoke(port, ["path"], [["plain.png"], [path]])
        assert status == 400, (path, answer)
        assert_one_line_error(answer, "row 1", *words)
        assert str(allowed) not in answer["message"] and str(own) not in answer["message"], answer
        assert time.monotonic() - started < 10, path


def test_the_server_says_opencv_is_capped(server) -> None:
    """`make serve` set OpenCV's own cap before OpenCV loaded and checked it (it refuses to start otherwise)."""
    log = server["log"].read_text()
    assert f"a frame at most {MAX_SIDE} px a side and {MAX_FRAME_PIXELS} pixels, OpenCV capped at that" in log, log


def test_serve_refuses_an_open_host_and_the_file_system_root(untrained_model) -> None:
    """Checked before anything is loaded: a host others reach without serve.insecure=true, and path_root=/."""
    from pipeline.deployment.serving import check_host, run_serve

    cfg = untrained_model["cfg"]
    for host in ("0.0.0.0", "192.168.1.1", "::", "example.org"):
        with pytest.raises(SystemExit, match=f"serve.host={host} is not a loopback address.*serve.insecure=true"):
            run_serve(OmegaConf.merge(cfg, {"serve": {"host": host}}), model_uri=str(untrained_model["local"]))
        check_host(host, insecure=True)  # said, then allowed
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_host(host, insecure=False)
    with pytest.raises(SystemExit, match="SERVE_PATH_ROOT=/: the root of the file system"):
        run_serve(cfg, model_uri=str(untrained_model["local"]), path_root="/")
    with pytest.raises(ValueError, match="serve.path_root=/: the root"):
        ServingLimits.from_settings({**cfg.serve, "path_root": "/"})


@pytest.fixture(scope="module")
def mlflow_server(untrained_model, tmp_path_factory):
    """`mlflow models serve` (MLflow's own command, --env-manager local) of the untrained model on loopback, path
    inputs allowed under a folder of its own: what runs when the project is not asked first."""
    own = tmp_path_factory.mktemp("mlflow_serve")
    allowed = own / "allowed"
    allowed.mkdir()
    port = free_port()
    env = {**os.environ, "PAIN_SERVE_PATH_ROOT": str(allowed),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port), "-m", str(untrained_model["local"])]
    log = (own / "server.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_ping(port, process, own / "server.log")
        yield {"port": port, "allowed": allowed, "own": own}
    finally:
        stop_process_group(process)
        log.close()


def test_mlflow_models_serve_answers_every_bad_row_in_one_line(mlflow_server) -> None:
    """What escaped as a stack trace with server paths before (an OSError of a 300-character name, the
    RuntimeError of a loop of links, OpenCV's error on a PNG header wider than 2^20), a TIFF, and a bomb: each a
    400 whose message is one line naming the row, with no stack trace, echo of the request or path of the server's."""
    port, allowed = mlflow_server["port"], mlflow_server["allowed"]
    (allowed / "loop a").symlink_to(allowed / "loop b")
    (allowed / "loop b").symlink_to(allowed / "loop a")
    frame = np.full((40, 48, 3), 90, np.uint8)
    tiff = cv2.imencode(".tiff", frame)[1].tobytes()
    for column, value, words in (("path", "x" * 300, ("cannot be opened", "File name too long")),
                                 ("path", "loop a/frame.png", ("symbolic link",)),
                                 ("image", b64(bomb_png(2**20 + 1, 1, rows=0)), ("1048577 x 1 pixels",)),
                                 ("image", b64(tiff), ("the image is TIFF",)),
                                 ("image", b64(bomb_png(30000, 30000, rows=0)), ("30000 x 30000",)),
                                 ("image", "%%% not base64", ("base64",))):
        second = [value, None] if column == "image" else [None, value]
        status, body = request(port, "POST", "/invocations", json.dumps({"dataframe_split": {
            "columns": ["image", "path"], "data": [[encode_image(frame), None], second]}}).encode())
        answer = json.loads(body)
        assert status == 400, (column, value[:40], answer)
        assert "stack_trace" not in answer and answer["error_code"] == "INVALID_PARAMETER_VALUE", answer
        message = answer["message"]
        assert message.startswith("row 1: ") and "\n" not in message and "Traceback" not in message, message
        assert "Failed to predict" not in message and str(mlflow_server["own"]) not in message, message
        assert "/site-packages/" not in message and "/io/opencv" not in message, message
        for word in words:
            assert word in message, message
    status, body = request(port, "POST", "/invocations", json.dumps(
        {"dataframe_split": {"columns": ["image"], "data": [[encode_image(frame)]]}}).encode())
    assert status == 200, body
