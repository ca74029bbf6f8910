"""MTCNN and aligned crops on a real face: scikit-image's astronaut photograph, as is and pasted into real mp4 clips
at several sizes, rolls, brightness levels and backgrounds (tests.photo_clips)."""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipeline.data.crop_geometry import (
    CANONICAL_LANDMARKS,
    aligned_crop,
    apply_transform,
    similarity_transform,
    square_crop,
    square_crop_transform,
)
from pipeline.data.face_tracks import smooth_faces
from pipeline.data.faces import (
    DETECTORS,
    Face,
    HaarFaceDetector,
    MTCNNFaceDetector,
    build_detector,
    find_faces,
    gives_landmarks,
)
from pipeline.data.video import read_sampled_frames
from tests.photo_clips import PhotoClip, astronaut, clip_frames, clip_grid, write_clips

# small tensors: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The astronaut's eye centres, nose tip and mouth corners, read off the photograph by eye (x, y pixels).
ASTRONAUT_LANDMARKS = np.array([[204, 101], [247, 103], [224, 129], [201, 139], [246, 141]], dtype=float)


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return astronaut()


@pytest.fixture(scope="module")
def mtcnn() -> MTCNNFaceDetector:
    return MTCNNFaceDetector(device="cpu")


def test_mtcnn_places_the_five_landmarks_on_the_photograph(photo, mtcnn):
    face = mtcnn.detect_faces([photo])[0]
    assert face is not None and face.score > 0.95
    np.testing.assert_allclose(face.landmarks, ASTRONAUT_LANDMARKS, atol=4.0)
    x, y, w, h = face.box
    assert x < 204 and x + w > 247 and y < 101 and y + h > 141  # the box holds the landmarks
    assert 70 < w < 110 and 90 < h < 130
    # `detect` gives the same face as an integer box; a frame without a face gives None
    box = mtcnn.detect(photo)
    assert box == (round(x), round(y), round(x + w) - round(x), round(y + h) - round(y))
    assert mtcnn.detect_faces([np.full_like(photo, 128), photo])[0] is None


def test_mtcnn_is_registered_and_checks_its_inputs(photo):
    assert set(DETECTORS) >= {"haar", "mtcnn"}
    assert gives_landmarks("mtcnn") and not gives_landmarks("haar")
    detector = build_detector("mtcnn", device="cpu", batch_size=2)
    faces = detector.detect_faces([photo, cv2.cvtColor(photo, cv2.COLOR_BGR2GRAY), photo])  # batches of 2, grey too
    assert all(face is not None for face in faces)
    with pytest.raises(ValueError, match="min_face_fraction"):
        build_detector("mtcnn", device="cpu", min_size_fraction=0.0)
    with pytest.raises(ValueError, match="non-empty"):
        detector.detect_faces([np.zeros((0, 0, 3), np.uint8)])


def test_a_detector_with_only_detect_still_works_per_frame(photo):
    class Haarlike:
        name = "box-only"

        def detect(self, frame):
            return HaarFaceDetector().detect(frame)

    faces = find_faces(Haarlike(), [photo, np.full_like(photo, 90)])
    assert faces[0] is not None and faces[0].landmarks is None and faces[1] is None


def test_similarity_transform_recovers_rotation_scale_and_shift():
    angle, scale, shift = math.radians(17), 1.7, np.array([12.0, -5.0])
    linear = scale * np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    source = ASTRONAUT_LANDMARKS
    matrix = similarity_transform(source, source @ linear.T + shift)
    np.testing.assert_allclose(matrix, np.hstack([linear, shift[:, None]]), atol=1e-9)
    with pytest.raises(ValueError, match="coincide"):
        similarity_transform(np.ones((5, 2)), source)


def test_aligned_crops_remove_the_roll(photo, mtcnn):
    """The same face rolled by -20..20 degrees gives nearly the same aligned crop, but different square crops."""
    aligned, square = [], []
    for roll in (-20, -10, 0, 10, 20):
        clip = PhotoClip(0.3, roll, width=480, height=360, n_frames=1, motion_px=0)
        frame = clip_frames(photo, clip)[0]
        face = mtcnn.detect_faces([frame])[0]
        crop, matrix = aligned_crop(frame, face.landmarks, margin=0.2, size=96)
        # the eyes land level, at the canonical place and distance (a least-squares fit of all five points)
        eyes, canonical_eyes = apply_transform(matrix, face.landmarks[:2]), (CANONICAL_LANDMARKS[:2] + 0.2) / 1.4 * 96
        dx, dy = eyes[1] - eyes[0]
        assert abs(math.degrees(math.atan2(dy, dx))) < 3.0
        np.testing.assert_allclose(eyes.mean(0), canonical_eyes.mean(0), atol=2.5)
        assert math.hypot(dx, dy) == pytest.approx(canonical_eyes[1, 0] - canonical_eyes[0, 0], rel=0.12)
        aligned.append(cv2.cvtColor(crop, cv2.COLOR_BGR2GRAY).astype(float))
        square.append(cv2.cvtColor(square_crop(frame, face.box, 0.2, 96), cv2.COLOR_BGR2GRAY).astype(float))
    aligned_spread = np.mean([np.abs(crop - aligned[2]).mean() for crop in aligned])
    square_spread = np.mean([np.abs(crop - square[2]).mean() for crop in square])
    assert aligned_spread < 0.4 * square_spread, (aligned_spread, square_spread)


def test_square_crop_transform_says_where_each_frame_pixel_lands():
    """A frame whose pixels hold their own coordinates: each crop pixel holds the frame position the matrix maps
    onto it, for a downscaled (area) and an upscaled (linear) crop."""
    ys, xs = np.mgrid[0:120, 0:160]
    frame = np.stack([xs, ys, np.zeros_like(xs)], axis=2).astype(np.uint8)
    box = (50, 30, 40, 36)
    for size in (24, 96):
        crop = square_crop(frame, box, margin=0.25, size=size).astype(float)
        inverse = cv2.invertAffineTransform(square_crop_transform(box, margin=0.25, size=size))
        us, vs = np.meshgrid(np.arange(size), np.arange(size))
        where = apply_transform(inverse, np.stack([us.ravel(), vs.ravel()], 1)).reshape(size, size, 2)
        np.testing.assert_allclose(crop[..., :2], where, atol=0.75)


def test_smooth_faces_smooths_landmarks_like_boxes():
    first = Face((10, 10, 40, 40), np.zeros((5, 2)))
    second = Face((30, 10, 40, 40), np.full((5, 2), 10.0))
    faces, statuses = smooth_faces([None, first, None, second], alpha=0.5)
    assert statuses == ["backfilled", "detected", "reused", "detected"]
    np.testing.assert_array_equal(faces[0].landmarks, first.landmarks)
    np.testing.assert_array_equal(faces[2].landmarks, first.landmarks)
    np.testing.assert_array_equal(faces[3].landmarks, np.full((5, 2), 5.0))
    assert faces[3].box == (20, 10, 40, 40)
    assert smooth_faces([None, None]) is None


def test_real_face_detection_rate_across_size_roll_light_and_background(tmp_path: Path, mtcnn):
    """The target of issue 9: MTCNN finds the face in >= 99 % of frames of real mp4 clips where it is 15-60 % of the
    frame height and rolled by up to 20 degrees, whatever the brightness and background; Haar's rate beside it."""
    clips = clip_grid([0.15, 0.3, 0.6], [-20, 0, 20], [0.6, 1.3], [(35, 35, 35), (225, 230, 235)],
                      width=320, height=240, n_frames=2)  # scripts/bench_data.py runs a larger grid
    paths = write_clips(tmp_path, clips)
    rows = []
    haar = HaarFaceDetector()
    for clip, path in paths.items():
        _, frames, _ = read_sampled_frames(path, 2, start_s=0.0)
        for name, detector in (("mtcnn", mtcnn), ("haar", haar)):
            found = find_faces(detector, frames)
            rows += [{"detector": name, "size": clip.face_fraction, "roll": clip.roll_deg,
                      "found": face is not None} for face in found]
            if name == "mtcnn":
                for face in found:  # and it is the pasted face: the box centre near where the clip put it
                    if face is not None:
                        x, y, w, h = face.box
                        assert abs(x + w / 2 - 160) < 0.5 * w + 4 and abs(y + h / 2 - 108) < 0.5 * h + 4
    table = pd.DataFrame(rows)
    rates = table.groupby("detector").found.mean()
    by_size = table.pivot_table(index="size", columns="detector", values="found")
    assert len(table) == 2 * 2 * len(clips)
    assert rates["mtcnn"] >= 0.99, f"MTCNN {rates['mtcnn']:.1%} vs Haar {rates['haar']:.1%}\n{by_size}"
    print(f"\nreal-face clips, share of frames with the face found: MTCNN {rates['mtcnn']:.1%}, "
          f"Haar {rates['haar']:.1%}\n{by_size}")


def test_photo_clips_put_the_face_where_asked(photo):
    clip = PhotoClip(0.4, roll_deg=0.0, width=400, height=300, n_frames=2, motion_px=0.0)
    frames = clip_frames(photo, clip)
    assert len(frames) == 2 and frames[0].shape == (300, 400, 3)
    face = HaarFaceDetector().detect(frames[0])
    assert face is not None
    assert abs(face[3] - 0.4 * 300) < 0.3 * 0.4 * 300  # about 40 % of the frame height
    assert clip.name == "face40_roll+00_light1.00_bg808080"
