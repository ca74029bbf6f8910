"""The second face detector (BlazeFace full-range, run by LiteRT) on real photographs: it finds the astronaut's face
and its landmarks make MTCNN's aligned crop; its weights are the pinned file; and in `make predict`'s face search
(`FaceFinder`) it finds the small, rolled face of an old black-and-white photograph in frames where MTCNN, with its
rotated retries, finds none, and nowhere else."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from skimage import data

from pipeline.data import blazeface
from pipeline.data.crop_geometry import (
    CANONICAL_LANDMARKS,
    aligned_crop_transform,
    apply_transform,
    square_crop_transform,
)
from pipeline.data.faces import (
    DETECTORS,
    BlazeFaceDetector,
    build_detector,
    five_landmarks,
    gives_landmarks,
    register_detector,
)
from pipeline.data.mtcnn import MTCNN
from pipeline.models.scoring import CropSettings, FaceFinder
from tests.photo_clips import ASTRONAUT_FACE_BOX, PhotoClip, astronaut, clip_frames, old_photograph, write_clip

pytestmark = pytest.mark.usefixtures("one_torch_thread")

try:
    WEIGHTS = blazeface.weights_path()
except FileNotFoundError as missing:  # `python -m pipeline.data.blazeface` puts them there; `pip install` does not
    pytest.skip(f"BlazeFace weights not installed: {missing}", allow_module_level=True)


@pytest.fixture(scope="module")
def detector() -> BlazeFaceDetector:
    return BlazeFaceDetector(min_size_fraction=0.05)


def test_five_landmarks_of_the_canonical_face_are_its_own() -> None:
    """The mouth corners placed about the mouth centre are the canonical corners on the canonical face, and follow
    the face when it is turned, scaled and moved."""
    eye_left, eye_right, nose = CANONICAL_LANDMARKS[:3]
    mouth = CANONICAL_LANDMARKS[3:].mean(axis=0)
    np.testing.assert_allclose(five_landmarks(eye_left, eye_right, nose, mouth), CANONICAL_LANDMARKS, atol=1e-9)
    angle = np.radians(30.0)
    turn = 80.0 * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    moved = CANONICAL_LANDMARKS @ turn.T + [300.0, 120.0]
    given = [*moved[:3], moved[3:].mean(axis=0)]
    np.testing.assert_allclose(five_landmarks(*given), moved, atol=1e-9)


def test_blazeface_finds_the_astronauts_face(detector: BlazeFaceDetector) -> None:
    face = detector.detect_faces([astronaut()])[0]
    assert face is not None and face.score > 0.8
    x, y, w, h = face.box
    ax, ay, aw, ah = ASTRONAUT_FACE_BOX  # MTCNN's box: brows to chin
    assert abs(x + w / 2 - (ax + aw / 2)) < 0.1 * ah and abs(y + h / 2 - (ay + ah / 2)) < 0.1 * ah
    assert abs(max(w, h) - ah) < 0.25 * ah
    eye_left, eye_right, nose, mouth_left, mouth_right = face.landmarks
    assert eye_left[0] < nose[0] < eye_right[0] and mouth_left[0] < mouth_right[0]  # the image's left and right
    assert max(eye_left[1], eye_right[1]) < nose[1] < min(mouth_left[1], mouth_right[1])
    assert build_detector("blazeface").name == "blazeface" and gives_landmarks("blazeface")


def test_its_landmarks_make_mtcnns_aligned_crop(detector: BlazeFaceDetector) -> None:
    """A crop from BlazeFace's landmarks is the crop training made from MTCNN's: on the astronaut, MTCNN's landmarks
    land within 3 % of the crop side of where MTCNN's own crop puts them, at the same scale and roll; the square crop
    around its box is MTCNN's square crop within 5 % of the side."""
    photo = astronaut()
    blaze = detector.detect_faces([photo])[0]
    rows = MTCNN("cpu").detect([photo])[0]
    mtcnn = rows[np.argmax(rows[:, 4])]
    landmarks = np.stack([mtcnn[5:10], mtcnn[10:15]], axis=1)
    ours, theirs = aligned_crop_transform(blaze.landmarks), aligned_crop_transform(landmarks)
    assert np.abs(apply_transform(ours, landmarks) - apply_transform(theirs, landmarks)).max() < 0.03 * 224
    assert abs(np.linalg.norm(ours[:, 0]) / np.linalg.norm(theirs[:, 0]) - 1) < 0.03
    x1, y1, x2, y2 = mtcnn[:4]
    square = square_crop_transform(tuple(round(v) for v in blaze.box))
    theirs_square = square_crop_transform((round(x1), round(y1), round(x2 - x1), round(y2 - y1)))
    assert abs(square[0, 0] / theirs_square[0, 0] - 1) < 0.05
    assert np.abs(apply_transform(square, landmarks) - apply_transform(theirs_square, landmarks)).max() < 0.05 * 224


def test_the_weights_are_the_pinned_file(tmp_path: Path) -> None:
    assert blazeface.check_weights(WEIGHTS) == WEIGHTS
    changed = tmp_path / "face_detection_full_range.tflite"
    shutil.copyfile(WEIGHTS, changed)
    with changed.open("r+b") as file:
        file.seek(1000)
        byte = file.read(1)
        file.seek(1000)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match=r"SHA-256 .* expected 99bf9494.*refusing other weights"):
        blazeface.BlazeFace(weights=changed)
    with pytest.raises(FileNotFoundError, match="missing"):
        blazeface.BlazeFace(weights=tmp_path / "none.tflite")


def decoded(path: Path) -> list[np.ndarray]:
    capture = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            return frames
        frames.append(frame)


@pytest.mark.parametrize("roll", [20.0, -20.0])
def test_the_fallback_finds_a_small_rolled_face_mtcnn_loses(tmp_path: Path, roll: float) -> None:
    """scikit-image's camera photograph (a real black-and-white photograph of a man) as an old photograph is filmed:
    the face 12 % of a 694 x 519 frame's height, rolled by `roll`, soft, flat and grainy (`old_photograph`), 28
    frames through an mp4 file. Measured on this clip (printed): MTCNN with its rotated retries finds the face in
    8 of 28 frames (roll +20) and 7 of 28 (roll -20); with BlazeFace after it, 20 and 26. Asserted: more frames than
    MTCNN alone, every face the fallback returns lies on the man's face, and a crop from the fallback's landmarks
    shows the face about where MTCNN's crop of the clean frame puts it."""
    photo = cv2.cvtColor(data.camera(), cv2.COLOR_GRAY2BGR)
    rows = MTCNN("cpu").detect([photo])[0]
    x1, y1, x2, y2 = rows[np.argmax(rows[:, 4])][:4]
    clip = PhotoClip(0.12, roll, n_frames=28, motion_px=3.0)
    clean = clip_frames(photo, clip, (x1, y1, x2 - x1, y2 - y1))
    path = tmp_path / "old_photograph.mp4"
    write_clip(path, [old_photograph(frame, seed=index) for index, frame in enumerate(clean)], clip.fps)
    frames = decoded(path)
    assert len(frames) == 28

    finder = FaceFinder(CropSettings(), "cpu")
    found = finder.find(frames)
    searched = finder.fallback_searched  # the frames MTCNN, retries included, found no face in
    before = len(frames) - len(searched)
    after = sum(len(rows) > 0 for rows in found)
    print(f"roll {roll:+.0f}: MTCNN with retries {before}/28 frames, with the BlazeFace fallback {after}/28")
    assert after > before

    truth = MTCNN("cpu").detect(clean)  # where the face is: MTCNN on the clean frames (it finds all 28)
    face_height = clip.face_fraction * clip.height
    errors = []
    for index in searched:
        if not len(found[index]):
            continue
        reference = truth[index][np.argmax(truth[index][:, 4])]
        faces = found[index]
        centres = np.stack([(faces[:, 0] + faces[:, 2]) / 2, (faces[:, 1] + faces[:, 3]) / 2], axis=1)
        reference_centre = np.array([(reference[0] + reference[2]) / 2, (reference[1] + reference[3]) / 2])
        assert (np.linalg.norm(centres - reference_centre, axis=1) < 0.5 * face_height).all()  # no one else
        best = faces[np.argmax(faces[:, 4])]
        landmarks = np.stack([reference[5:10], reference[10:15]], axis=1)
        ours = aligned_crop_transform(np.stack([best[5:10], best[10:15]], axis=1))
        face_centre = apply_transform(ours, landmarks).mean(axis=0)
        errors.append(np.linalg.norm(face_centre - apply_transform(aligned_crop_transform(landmarks), landmarks)
                                     .mean(axis=0)))
    print(f"face centre in the fallback's crops, px of 224 from MTCNN's: median {np.median(errors):.0f}, "
          f"max {np.max(errors):.0f}")
    assert max(errors) < 0.5 * 224  # the face is inside every crop
    assert np.median(errors) < 0.1 * 224  # and about where training's crops have it


def test_the_fallback_searches_only_the_frames_without_a_face() -> None:
    """Haar's frontal cascade finds the upright astronaut and not the one rolled 40 degrees; BlazeFace, after it,
    finds the rolled one; the upright frame keeps Haar's face (a box, score 1, no landmarks)."""
    photo = astronaut()
    upright = clip_frames(photo, PhotoClip(0.35, 0.0, n_frames=1, motion_px=0.0))[0]
    rolled = clip_frames(photo, PhotoClip(0.35, 40.0, n_frames=1, motion_px=0.0))[0]
    settings = CropSettings(detector="haar", align=False, fallback_detector="blazeface", min_face_fraction=0.1)
    haar_only = FaceFinder(CropSettings(detector="haar", align=False, fallback_detector=None,
                                        min_face_fraction=0.1)).find([upright, rolled])
    assert len(haar_only[0]) == 1 and not len(haar_only[1])
    finder = FaceFinder(settings)
    found = finder.find([upright, rolled])
    assert finder.fallback_searched == [1]
    np.testing.assert_array_equal(found[0], haar_only[0])
    assert len(found[1]) and np.isfinite(found[1][:, 5:]).all()
    with pytest.raises(ValueError, match="gives only a box"):
        FaceFinder(CropSettings(fallback_detector="haar"))


def test_a_fallback_without_its_weights_is_said_once(tmp_path: Path) -> None:
    """A registered fallback whose weights file is not installed: one warning that names the file, then frames
    without a face; an unknown fallback name is an error."""
    absent = tmp_path / "face_detection_full_range.tflite"
    register_detector("blazeface-elsewhere", lambda **options: blazeface.BlazeFace(weights=absent))
    try:
        finder = FaceFinder(CropSettings(detector="haar", align=False, fallback_detector="blazeface-elsewhere"))
        blank = np.full((120, 160, 3), 128, np.uint8)
        with pytest.warns(UserWarning, match=f"'blazeface-elsewhere' is not available.*{absent}"):
            assert not len(finder.find([blank])[0])
        assert finder.fallback_error is not None and finder.fallback() is None  # not tried again
    finally:
        DETECTORS.pop("blazeface-elsewhere")
    with pytest.raises(ValueError, match="unknown face detector 'nothing'"):
        FaceFinder(CropSettings(fallback_detector="nothing"))
