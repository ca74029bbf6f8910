"""`make predict` fails loudly: exit status and per-status counts for broken, faceless and mixed inputs, lost frames of
a damaged file, and a `VIDEO=` path with a space and non-ASCII characters through the Makefile. The model is the
untrained session fixture (what predict does with its input, not the scores)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipeline.deployment.predict import PredictFailed, run_predict, sampled_frames
from pipeline.utils.paths import PROJECT_ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def twin_clip(cfg) -> Path:
    return sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]


def write_clip(path: Path, frames: list[np.ndarray], fourcc: str = "mp4v") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 25, (width, height))
    for frame in frames:
        writer.write(frame)
    writer.release()
    return path


def grey_clip(path: Path) -> Path:
    return write_clip(path, [np.full((120, 160, 3), 110, np.uint8)] * 10)


def damaged_face_clip(cfg, path: Path) -> Path:
    """The twin's clip re-encoded as Motion-JPEG AVI and cut at 60 %: it opens, its index announces every frame, and
    the last 40 % cannot be decoded."""
    frames = [f for _, _, chunk in sampled_frames(twin_clip(cfg), 0) for f in chunk]
    write_clip(path, frames, "MJPG")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 6 // 10])
    return path


def broken_files(folder: Path) -> list[Path]:
    """An empty file, a text file named .mp4 and an mp4 cut in half (its index, at the end, is lost)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "text.mp4").write_text("not a video\n")
    whole = grey_clip(folder / "whole.mp4").read_bytes()
    (folder / "truncated.mp4").write_bytes(whole[: len(whole) // 2])
    (folder / "whole.mp4").unlink()
    return sorted(folder.iterdir())


@pytest.fixture(scope="module")
def predict_cfg(untrained_model):
    from omegaconf import OmegaConf

    cfg = untrained_model["cfg"].copy()
    OmegaConf.update(cfg, "predict.fps", 2)
    return cfg


def test_a_broken_or_faceless_video_alone_exits_non_zero(untrained_model, predict_cfg, tmp_path, capsys) -> None:
    uri = untrained_model["uri"]
    for path in broken_files(tmp_path / "broken"):
        with pytest.raises(PredictFailed) as failed:
            run_predict(predict_cfg, video=str(path), model_uri=uri, out=str(tmp_path / "out"))
        assert failed.value.code == 1, path.name
        assert list(failed.value.summary.status) == ["failed"]
        err = capsys.readouterr().err
        assert f"{path}: failed (cannot open video" in err and "1 video: 0 scored, 0 without a face, 1 failed" in err
    with pytest.raises(PredictFailed) as failed:  # readable, but no face: no score either, its own status
        run_predict(predict_cfg, video=str(grey_clip(tmp_path / "grey.mp4")), model_uri=uri, out=str(tmp_path / "g"))
    assert failed.value.code == 3 and "0 scored, 1 without a face, 0 failed" in capsys.readouterr().err
    with pytest.raises(PredictFailed) as failed:  # a folder of broken files only
        run_predict(predict_cfg, video=str(tmp_path / "broken"), model_uri=uri, out=str(tmp_path / "all"))
    assert failed.value.code == 1
    listed = pd.read_csv(tmp_path / "all" / "videos.csv")
    assert list(listed.status) == ["failed"] * 3 and listed.error.str.contains("cannot open video").all()
    with pytest.raises(SystemExit, match="missing.mp4: no such file or folder"):
        run_predict(predict_cfg, video=str(tmp_path / "missing.mp4"), model_uri=uri)


def test_a_mixed_folder_counts_scored_faceless_and_failed_and_says_what_was_lost(untrained_model, predict_cfg,
                                                                                 tmp_path, capsys) -> None:
    folder = tmp_path / "mixed"
    (folder / "text.mp4").parent.mkdir(parents=True)
    (folder / "text.mp4").write_text("not a video\n")
    grey_clip(folder / "grey.mp4")
    damaged = damaged_face_clip(predict_cfg, folder / "damaged.avi")
    capture = cv2.VideoCapture(str(damaged))
    announced = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    capture.release()
    summary = run_predict(predict_cfg, video=str(folder), model_uri=untrained_model["uri"], out=str(tmp_path / "o"))
    captured = capsys.readouterr()
    assert "3 videos: 1 scored, 1 without a face, 1 failed" in captured.out
    rows = summary.set_index(summary.video.map(lambda v: Path(v).name))
    assert rows.status.to_dict() == {"damaged.avi": "scored", "grey.mp4": "no face", "text.mp4": "failed"}
    lost = int(rows.frames_lost["damaged.avi"])
    assert 0 < lost < announced and rows.frames_lost["grey.mp4"] == 0
    assert f"{damaged}: {lost} of {announced} frames could not be decoded" in captured.err
    assert list(pd.read_csv(tmp_path / "o" / "videos.csv").status) == list(summary.status)


def test_make_predict_takes_a_path_with_spaces_and_accents(untrained_model, tmp_path) -> None:
    cfg = untrained_model["cfg"]
    video = tmp_path / "folder with space" / "vidéo ü's.mp4"
    video.parent.mkdir()
    video.write_bytes(twin_clip(cfg).read_bytes())
    out = tmp_path / "out dir"
    # -o: the environment is installed already (the shared one; its stamp may predate this checkout's files)
    done = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "predict", f"VIDEO={video}",
                           f"MODEL_URI={untrained_model['uri']}", f"OUT={out}", "FPS=1",
                           f"ARGS=mlflow.tracking_uri={cfg.mlflow.tracking_uri}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = pd.read_csv(out / "vidéo ü's.csv")
    assert len(table) == 6 and table.face_found.any()  # 5.5 s at one frame per second
