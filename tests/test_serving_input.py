"""How the scoring process reads a frame, piece by piece on real files: kinds told by their first bytes, sizes read
from headers (PNG and JPEG written by OpenCV, and a bomb built with zlib), `path` inputs opened without following
links, the limits read from configs/config.yaml, and OpenCV's own cap in a fresh process that loads the model as
`mlflow models serve` does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import cv2
import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.runs.serving.serving_input import (
    FrameRefused,
    ServingLimits,
    configured_serve_settings,
    frame_size,
    opencv_caps_at,
    read_beneath,
)
from pipeline.utils.config import CONFIG_DIR
from pipeline.utils.paths import PROJECT_ROOT
from tests.image_files import bomb_png


def encoded(suffix: str, height: int, width: int, *params: int) -> bytes:
    ok, data = cv2.imencode(suffix, np.full((height, width, 3), 120, np.uint8), list(params))
    assert ok
    return data.tobytes()


def test_sizes_come_from_the_header_of_real_pngs_and_jpegs() -> None:
    assert frame_size(encoded(".png", 37, 53)) == (53, 37)
    assert frame_size(encoded(".jpg", 37, 53)) == (53, 37)
    assert frame_size(encoded(".jpg", 37, 53, cv2.IMWRITE_JPEG_PROGRESSIVE, 1)) == (53, 37)  # SOF2
    # the bomb: its header is all that is read, whatever its image data
    bomb = bomb_png(30000, 30000)
    assert len(bomb) < 1_000_000 and frame_size(bomb) == (30000, 30000)
    assert frame_size(bomb[:33]) == (30000, 30000)
    # a JPEG with large segments before its frame header: they are walked by their lengths
    jpeg = encoded(".jpg", 20, 30)
    comment = b"\xff\xfe" + (2 + 60000).to_bytes(2, "big") + bytes(60000)
    assert frame_size(jpeg[:2] + comment * 3 + jpeg[2:]) == (30, 20)
    assert cv2.imdecode(np.frombuffer(jpeg[:2] + comment + jpeg[2:], np.uint8), cv2.IMREAD_COLOR).shape == (20, 30, 3)


def test_damaged_headers_are_refused() -> None:
    jpeg = encoded(".jpg", 20, 30)
    app0_end = 4 + int.from_bytes(jpeg[4:6], "big")  # the marker after the JFIF segment
    sof = next(i for i in range(2, len(jpeg) - 1) if jpeg[i] == 0xFF and jpeg[i + 1] in (0xC0, 0xC2))
    for data, reason in ((b"\x89PNG\r\n\x1a\n\x00\x00", "without its IHDR header"),
                         (bomb_png(0, 5, rows=0), "says 0 x 5 pixels"),
                         (jpeg[:sof], "without a frame header"),
                         (jpeg[:2] + b"\xff\xda\x00\x02" + jpeg[2:], "without a frame header"),  # image data first
                         (jpeg[:sof + 5] + b"\x00\x00" + jpeg[sof + 7:], "says 30 x 0 pixels"),
                         (jpeg[:app0_end] + b"\x00" + jpeg[app0_end + 1:], "markers are damaged"),
                         (b"", "not a PNG or JPEG"), (b"hello", "not a PNG or JPEG")):
        with pytest.raises(FrameRefused, match=reason):
            frame_size(data)


@pytest.mark.parametrize(("suffix", "kind"), [(".tiff", "TIFF"), (".webp", "WebP"), (".ppm", "PNM"), (".pam", "PNM"),
                                              (".jp2", "JPEG 2000"), (".bmp", "BMP"), (".gif", "GIF")])
def test_formats_opencv_decodes_but_the_server_does_not_take(suffix: str, kind: str) -> None:
    with pytest.raises(FrameRefused, match=f"the image is {kind}; this server takes PNG or JPEG only"):
        frame_size(encoded(suffix, 64, 64))


def test_path_inputs_open_regular_files_beneath_the_root_without_links(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    data = encoded(".png", 8, 8)
    (root / "sub" / "frame.png").write_bytes(data)
    (tmp_path / "outside.png").write_bytes(data)
    (root / "link.png").symlink_to(root / "sub" / "frame.png")
    (root / "loop").symlink_to(root / "loop")
    (root / "out").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")
    (root / "big.png").write_bytes(data + bytes(100))
    root = root.resolve()
    assert read_beneath("sub/frame.png", root, 1000) == data
    assert read_beneath(str(root / "sub" / "frame.png"), root, 1000) == data
    assert read_beneath("sub/../sub/./frame.png", root, 1000) == data
    for value, reason in (("link.png", "'link.png' is a symbolic link"), ("loop", "is a symbolic link"),
                          ("loop/x", "is a symbolic link"), ("out/outside.png", "outside the folder"),
                          ("../outside.png", "outside the folder"), (str(tmp_path / "outside.png"), "outside the"),
                          ("fifo", "not a regular file"), ("sub", "not a regular file"),
                          ("big.png", f"file of {len(data) + 100} bytes; the limit is {len(data) + 50}"),
                          ("no such.png", "no readable image file 'no such.png'"), ("a\x00b", "NUL character"),
                          ("y" * 300, "cannot be opened (File name too long)")):
        with pytest.raises(FrameRefused, match=re.escape(reason)) as refused:
            read_beneath(value, root, len(data) + 50)
        assert str(tmp_path) not in str(refused.value) or value.startswith(str(tmp_path)), refused.value
    with pytest.raises(FrameRefused, match="'path' inputs are off"):
        read_beneath("sub/frame.png", None, 1000)


def test_the_limits_are_the_configured_serve_settings(tmp_path: Path) -> None:
    configured = OmegaConf.load(CONFIG_DIR / "config.yaml").serve
    limits = ServingLimits.from_env({})
    assert limits == ServingLimits.from_settings(configured_serve_settings())
    assert (limits.max_frame_side, limits.max_frame_pixels, limits.max_request_pixels, limits.path_root) == (
        configured.max_frame_side, configured.max_frame_pixels, configured.max_request_pixels, None)
    given = ServingLimits.from_env({"PAIN_SERVE_MAX_FRAME_PIXELS": "1000", "PAIN_SERVE_PATH_ROOT": str(tmp_path)})
    assert given.max_frame_pixels == 1000 and given.path_root == tmp_path.resolve()
    assert ServingLimits.from_env(given.to_env()) == given
    for env, reason in (({"PAIN_SERVE_MAX_FRAME_SIDE": "1.5"}, "PAIN_SERVE_MAX_FRAME_SIDE=1.5: not a whole number"),
                        ({"PAIN_SERVE_MAX_REQUEST_PIXELS": "-1"}, "must be above 0"),
                        ({"PAIN_SERVE_PATH_ROOT": "/"}, "PAIN_SERVE_PATH_ROOT=/: the root of the file system"),
                        ({"PAIN_SERVE_PATH_ROOT": str(tmp_path / "none")}, "no such folder")):
        with pytest.raises(ValueError, match=reason):
            ServingLimits.from_env(env)
    with pytest.raises(FrameRefused, match="5 x 3 = 15 pixels; the limit is 14"):
        ServingLimits.from_settings({**configured_serve_settings(), "max_frame_pixels": 14}).check_frame(5, 3)


def test_opencv_is_capped_in_a_fresh_process_that_loads_the_model_as_mlflow_models_serve_does(untrained_model) -> None:
    """The model's code file sets OpenCV's cap before OpenCV loads (here to PAIN_SERVE_MAX_FRAME_PIXELS); in this
    process, where cv2 was loaded first, the same check says it is not capped. The old path that the code file of
    models logged before `runs/` was split imports first leaves OpenCV unloaded too."""
    assert not opencv_caps_at(1000)
    script = textwrap.dedent(f"""
        import sys
        from mlflow.pyfunc import scoring_server
        import pipeline.runs.serving_input
        assert "cv2" not in sys.modules
        scoring_server.load_model_with_mlflow_config({str(untrained_model["local"])!r})
        from pipeline.runs.serving.serving_input import opencv_caps_at
        print("capped", opencv_caps_at(250000), opencv_caps_at(249999))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PAIN_SERVE_MAX_FRAME_PIXELS": "250000",
                               "PYTHONPATH": str(PROJECT_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "capped True False" in done.stdout, done.stdout
