"""`make predict` fails loudly and loses nothing: exit status and per-status counts for broken, faceless and mixed
inputs, lost frames of a damaged file, a `VIDEO=` path with a space and non-ASCII characters through the Makefile;
outputs of their own for names that shared one before, exit 4 for a folder scored in part, an error OpenCV raises
in one video, unreadable folders and files and a name that is not UTF-8 reported and counted. The model is the
untrained session fixture (what predict does with its input, not the scores)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipeline.deployment.predict import PredictFailed, run_predict
from pipeline.deployment.video_frames import sampled_frames
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
    with pytest.raises(PredictFailed) as failed:  # scored in part: 4 (a faceless video alone would not make it 4)
        run_predict(predict_cfg, video=str(folder), model_uri=untrained_model["uri"], out=str(tmp_path / "o"))
    assert failed.value.code == 4
    summary = failed.value.summary
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
    table = pd.read_csv(out / "vidéo ü's.mp4.csv")
    assert len(table) == 6 and table.face_found.any()  # 5.5 s at one frame per second


def grey_video(path: Path, frames: int) -> Path:
    """A faceless clip of `frames` frames (Motion-JPEG for .avi, mp4v otherwise)."""
    return write_clip(path, [np.full((120, 160, 3), 110, np.uint8)] * frames,
                      "MJPG" if path.suffix == ".avi" else "mp4v")


def test_every_video_of_a_folder_has_outputs_of_its_own(untrained_model, predict_cfg, tmp_path) -> None:
    """Names that shared an output before (clip.v1 and clip.v2, a.mp4 and a.avi, videos.mp4 and the summary, the
    same names in a subfolder): every clip has another length and every frame is scored, so each CSV's length says
    whose frames it holds."""
    from omegaconf import OmegaConf

    cfg = predict_cfg.copy()
    OmegaConf.update(cfg, "predict.fps", 0)
    folder, out = tmp_path / "names", tmp_path / "out"
    lengths = {"clip.v1.mp4": 3, "clip.v2.mp4": 4, "a.mp4": 5, "a.avi": 6, "videos.mp4": 7, "sub/a.mp4": 8,
               "sub/clip.v1.mp4": 9}
    for name, frames in lengths.items():
        grey_video(folder / name, frames)
    with pytest.raises(PredictFailed) as failed:  # read, no face in any: 3
        run_predict(cfg, video=str(folder), model_uri=untrained_model["uri"], out=str(out))
    assert failed.value.code == 3
    summary = failed.value.summary.set_index(failed.value.summary.video.map(lambda v: Path(v).relative_to(folder)))
    assert sorted(summary.index) == sorted(map(Path, lengths)) and set(summary.status) == {"no face"}
    for name, frames in lengths.items():
        assert summary.csv[Path(name)] == str(out / f"{name}.csv")
        assert len(pd.read_csv(out / f"{name}.csv")) == frames, name
        assert cv2.imread(str(out / f"{name}.png")) is not None, name
    assert sorted(path.relative_to(out) for path in out.rglob("*.csv")) == sorted(
        [Path(f"{name}.csv") for name in lengths] + [Path("videos.csv")])
    assert len(pd.read_csv(out / "videos.csv")) == len(lengths)


def test_a_subfolder_named_like_an_output_is_a_failed_row_not_an_overwrite(untrained_model, predict_cfg,
                                                                          tmp_path) -> None:
    """`a.mp4.csv/b.mp4` beside `a.mp4` and `videos.csv/c.mp4` would need a folder where a.mp4's CSV or the summary
    is: those videos fail with the reason, a.mp4's CSV and the summary stay what they are."""
    folder, out = tmp_path / "clash", tmp_path / "out"
    for name in ("a.mp4", "a.mp4.csv/b.mp4", "videos.csv/c.mp4"):
        grey_video(folder / name, 10)
    with pytest.raises(PredictFailed) as failed:
        run_predict(predict_cfg, video=str(folder), model_uri=untrained_model["uri"], out=str(out))
    assert failed.value.code == 1  # none scored, two failed
    rows = pd.read_csv(out / "videos.csv").set_index("video")
    assert rows.status.to_dict() == {str(folder / "a.mp4"): "no face", str(folder / "a.mp4.csv" / "b.mp4"): "failed",
                                     str(folder / "videos.csv" / "c.mp4"): "failed"}
    assert f"which is an output file of {folder / 'a.mp4'}" in rows.error[str(folder / "a.mp4.csv" / "b.mp4")]
    assert "output file of the folder's summary" in rows.error[str(folder / "videos.csv" / "c.mp4")]
    assert (out / "a.mp4.csv").is_file() and not pd.read_csv(out / "a.mp4.csv").face_found.any()


def test_an_error_opencv_raises_in_one_video_is_its_row_and_the_others_are_scored(untrained_model, predict_cfg,
                                                                                  tmp_path, capsys) -> None:
    """A 2 x 1600 strip of video makes OpenCV's resize raise inside face detection (cv2.error, not one of predict's
    own errors; it ended the folder before, without videos.csv): a failed row with the one-line reason, the face
    video scored, exit 4. A FIFO and a broken link named like videos (left out silently before) are failed rows."""
    folder = tmp_path / "mixed"
    (folder / "face.mp4").parent.mkdir(parents=True)
    shutil.copyfile(twin_clip(predict_cfg), folder / "face.mp4")
    write_clip(folder / "strip.avi", [np.full((2, 1600, 3), 90, np.uint8)] * 10, "MJPG")
    (folder / "text.mp4").write_text("not a video\n")
    os.mkfifo(folder / "pipe.mp4")
    (folder / "gone.mp4").symlink_to(tmp_path / "missing.mp4")
    with pytest.raises(PredictFailed) as failed:
        run_predict(predict_cfg, video=str(folder), model_uri=untrained_model["uri"], out=str(tmp_path / "out"))
    assert failed.value.code == 4
    rows = pd.read_csv(tmp_path / "out" / "videos.csv")
    rows = rows.set_index(rows.video.map(lambda v: Path(v).name))
    assert rows.status.to_dict() == {"face.mp4": "scored", "gone.mp4": "failed", "pipe.mp4": "failed",
                                     "strip.avi": "failed", "text.mp4": "failed"}
    assert rows.error["pipe.mp4"] == f"{folder / 'pipe.mp4'} is not a regular file"
    assert rows.error["gone.mp4"] == f"cannot read {folder / 'gone.mp4'}: No such file or directory"
    assert rows.error["strip.avi"].startswith("error: OpenCV(") and "resize" in rows.error["strip.avi"]
    assert "cannot open video" in rows.error["text.mp4"]
    assert not pd.read_csv(tmp_path / "out" / "face.mp4.csv").empty
    err = capsys.readouterr().err
    assert f"{folder / 'strip.avi'}: failed (error: OpenCV(" in err
    assert "predict: not every video scored (5 videos: 1 scored, 0 without a face, 4 failed)" in err


def test_unreadable_folders_files_and_names_are_reported_and_counted(untrained_model, predict_cfg, tmp_path) -> None:
    """`python -m pipeline predict` on a folder with a face video, a folder and a video of mode 000, a video whose
    name is not UTF-8 (OpenCV's binding crashed the whole run on it) and a link to a folder: exit 4, every one a row
    of videos.csv with its reason, counted on stderr. As root, permissions bind only without CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH: the run drops both (setpriv) and is skipped where that cannot deny a read."""
    folder, out = tmp_path / "in", tmp_path / "out"
    (folder / "locked").mkdir(parents=True)
    shutil.copyfile(twin_clip(predict_cfg), folder / "face.mp4")
    grey_video(folder / "locked" / "inside.mp4", 10)
    grey_video(folder / "secret.mp4", 10)
    os.rename(grey_video(folder / "latin1.mp4", 10), folder / os.fsdecode(b"caf\xe9.mp4"))
    grey_video(tmp_path / "elsewhere" / "linked.mp4", 10)
    (folder / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, and no setpriv to drop the capabilities that bypass file permissions")
        caps = "-dac_override,-dac_read_search"
        drop = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", "--"]
    (folder / "locked").chmod(0o000)
    (folder / "secret.mp4").chmod(0o000)
    try:
        if subprocess.run([*drop, "cat", str(folder / "secret.mp4")], capture_output=True).returncode == 0:
            pytest.skip("this process reads a file of mode 000 even without its DAC capabilities")
        done = subprocess.run([*drop, sys.executable, "-m", "pipeline", "predict", f"--video={folder}",
                               f"--model_uri={untrained_model['uri']}", f"--out={out}", "predict.fps=2",
                               f"mlflow.tracking_uri={predict_cfg.mlflow.tracking_uri}"],
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        (folder / "locked").chmod(0o755)
        (folder / "secret.mp4").chmod(0o644)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    rows = pd.read_csv(out / "videos.csv", keep_default_na=False)
    rows = rows.set_index(rows.video.map(lambda v: Path(v).name))
    assert rows.status.to_dict() == {"face.mp4": "scored", "caf\\xe9.mp4": "failed", "secret.mp4": "failed",
                                     "link": "folder not read", "locked": "folder not read"}
    assert rows.error["secret.mp4"] == f"cannot read {folder / 'secret.mp4'}: Permission denied"
    assert "the file name is not valid UTF-8" in rows.error["caf\\xe9.mp4"]
    assert rows.error["locked"] == "cannot list the folder: Permission denied"
    assert "not followed" in rows.error["link"]
    assert f"{folder / 'locked'}: folder not read (cannot list the folder: Permission denied)" in done.stderr
    assert "3 videos: 1 scored, 0 without a face, 2 failed; 2 folders not read" in done.stderr
    assert (out / "face.mp4.csv").is_file()
