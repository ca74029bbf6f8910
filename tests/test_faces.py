"""Face detection, box smoothing and square crops on real images and real (tiny) videos."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from skimage import data

from pipeline.data.crop_geometry import square_crop
from pipeline.data.face_tracks import smooth_track
from pipeline.data.faces import DETECTORS, HaarFaceDetector, build_detector, detection_rate, register_detector

# The astronaut's face in skimage's 512 x 512 photograph lies roughly inside this region (x0, y0, x1, y1).
ASTRONAUT_FACE = (150, 40, 290, 200)


@pytest.fixture(scope="module")
def astronaut_bgr() -> np.ndarray:
    return cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR)


def _centre(box):
    x, y, w, h = box
    return x + w / 2, y + h / 2


def test_haar_finds_the_astronauts_face(astronaut_bgr):
    box = HaarFaceDetector().detect(astronaut_bgr)
    assert box is not None
    cx, cy = _centre(box)
    x0, y0, x1, y1 = ASTRONAUT_FACE
    assert x0 < cx < x1 and y0 < cy < y1
    assert 60 <= box[2] <= 200 and 60 <= box[3] <= 200


def test_haar_boxes_are_in_frame_pixels_after_downscaling(astronaut_bgr):
    """A frame larger than max_side is searched downscaled; the box must come back in the frame's pixels."""
    detector = HaarFaceDetector(max_side=256)
    small_box = detector.detect(astronaut_bgr)
    large = cv2.resize(astronaut_bgr, (1388, 1038), interpolation=cv2.INTER_LINEAR)
    large_box = detector.detect(large)
    assert small_box is not None and large_box is not None
    sx, sy = 1388 / 512, 1038 / 512
    (cx, cy), (lx, ly) = _centre(small_box), _centre(large_box)
    assert abs(lx - cx * sx) < 0.1 * large_box[2] and abs(ly - cy * sy) < 0.1 * large_box[3]
    assert 0 <= large_box[0] and large_box[0] + large_box[2] <= 1388 and large_box[1] + large_box[3] <= 1038


def test_haar_accepts_grey_frames_and_finds_nothing_in_a_blank_one(astronaut_bgr):
    detector = HaarFaceDetector()
    assert detector.detect(cv2.cvtColor(astronaut_bgr, cv2.COLOR_BGR2GRAY)) is not None
    assert detector.detect(np.full((240, 320, 3), 128, np.uint8)) is None
    with pytest.raises(ValueError, match="non-empty"):
        detector.detect(np.zeros((0, 0, 3), np.uint8))


def test_haar_rejects_a_missing_cascade():
    with pytest.raises(FileNotFoundError, match="no_such_cascade.xml"):
        HaarFaceDetector(cascade="no_such_cascade.xml")


def test_build_detector_by_name_and_unknown_names():
    detector = build_detector("haar", min_neighbors=3)
    assert isinstance(detector, HaarFaceDetector) and detector.min_neighbors == 3 and detector.name == "haar"
    with pytest.raises(ValueError, match=r"unknown face detector 'retinaface'.*haar"):
        build_detector("retinaface")


def test_a_registered_detector_plugs_in():
    class CentreDetector:
        name = "centre"

        def detect(self, frame_bgr):
            h, w = frame_bgr.shape[:2]
            return (w // 4, h // 4, w // 2, h // 2)

    register_detector("centre-test", CentreDetector)
    try:
        assert build_detector("centre-test").detect(np.zeros((40, 80, 3), np.uint8)) == (20, 10, 40, 20)
        with pytest.raises(ValueError, match="already registered"):
            register_detector("centre-test", CentreDetector)
    finally:
        DETECTORS.pop("centre-test")


def test_smooth_track_statuses_and_boxes():
    first, second = (10, 20, 40, 40), (30, 20, 60, 40)
    boxes, statuses = smooth_track([None, None, first, None, second, None], alpha=0.5)
    assert statuses == ["backfilled", "backfilled", "detected", "reused", "detected", "reused"]
    assert boxes[0] == boxes[1] == boxes[2] == first
    assert boxes[3] == first
    # Half way between the two detections: centre x 30 -> 60 gives 45, width 40 -> 60 gives 50.
    assert boxes[4] == (20, 20, 50, 40)
    assert boxes[5] == boxes[4]


def test_smooth_track_without_smoothing_returns_the_detections():
    detections = [(0, 0, 10, 10), (5, 5, 20, 20), (7, 3, 11, 13)]
    boxes, statuses = smooth_track(detections, alpha=1.0)
    assert boxes == detections and statuses == ["detected"] * 3


def test_smooth_track_is_none_without_any_detection_and_checks_alpha():
    assert smooth_track([None, None, None]) is None
    assert smooth_track([]) is None
    with pytest.raises(ValueError, match="alpha"):
        smooth_track([(0, 0, 1, 1)], alpha=0.0)


def _coordinate_frame(height: int = 60, width: int = 80) -> np.ndarray:
    """A frame whose pixels say where they are: channel 0 = x, channel 1 = y."""
    ys, xs = np.mgrid[0:height, 0:width]
    return np.stack([xs, ys, np.zeros_like(xs)], axis=2).astype(np.uint8)


def test_square_crop_inside_the_frame_is_the_square_around_the_box():
    frame = _coordinate_frame()
    crop = square_crop(frame, (30, 20, 20, 10), margin=0.25, size=30)  # side 20 * 1.5 = 30, centre (40, 25)
    assert crop.shape == (30, 30, 3)
    np.testing.assert_array_equal(crop, frame[10:40, 25:55])


def test_square_crop_replicates_the_border_outside_the_frame():
    frame = _coordinate_frame()
    crop = square_crop(frame, (0, 0, 20, 20), margin=0.5, size=40)  # side 40 centred on (10, 10): 10 px outside
    assert crop.shape == (40, 40, 3)
    np.testing.assert_array_equal(crop[10:, 10:], frame[0:30, 0:30])
    assert (crop[:, :10, 0] == 0).all() and (crop[:10, :, 1] == 0).all()  # replicated column 0 / row 0
    np.testing.assert_array_equal(crop[:10, 10:, 0], np.broadcast_to(frame[0, 0:30, 0], (10, 30)))


def test_square_crop_resizes_grey_frames_and_rejects_boxes_outside():
    frame = _coordinate_frame()[..., 0]
    crop = square_crop(frame, (20, 10, 40, 40), margin=0.0, size=20)
    assert crop.shape == (20, 20)
    np.testing.assert_array_equal(crop, cv2.resize(frame[10:50, 20:60], (20, 20), interpolation=cv2.INTER_AREA))
    with pytest.raises(ValueError, match="outside"):
        square_crop(frame, (200, 200, 10, 10))
    with pytest.raises(ValueError, match="no area"):
        square_crop(frame, (10, 10, 0, 10))


def _write_video(path, frames, fps=25):
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    assert writer.isOpened()
    for frame in frames:
        writer.write(frame)
    writer.release()


def test_detection_rate_over_real_videos(tmp_path, astronaut_bgr):
    face = tmp_path / "face.mp4"
    blank = tmp_path / "blank.mp4"
    _write_video(face, [astronaut_bgr] * 20)
    _write_video(blank, [np.full_like(astronaut_bgr, 90)] * 20)
    result = detection_rate([face, blank], HaarFaceDetector(), frames_per_video=4, start_s=0.2)
    assert result["per_video"] == {str(face): 1.0, str(blank): 0.0}
    assert result["n_frames"] == 8 and result["n_detected"] == 4 and result["overall"] == 0.5
    assert result["failed"] == {}
    # a clip that ends before the window starts gives no frames, as in preprocessing, and is listed with the reason
    short = detection_rate([face], HaarFaceDetector(), frames_per_video=4, start_s=1.0)
    assert short["n_frames"] == 0 and short["per_video"] == {}
    assert short["failed"] == {str(face): "too short: 20 frames at 25 fps, window starts at 1.0 s"}
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        detection_rate([tmp_path / "missing.mp4"], HaarFaceDetector())
