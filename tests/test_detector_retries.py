"""Faces found where MTCNN alone gives up: a real photograph (scikit-image's astronaut), in grey and rolled 50
degrees, is missed upright and found by the rotated retry that `make predict` uses; the box and landmarks come back
in the frame's own coordinates."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from pipeline.data.faces import retry_rotated
from pipeline.data.mtcnn import MTCNN
from pipeline.models.scoring import CropSettings
from tests.photo_clips import ASTRONAUT_FACE_BOX, PhotoClip, astronaut, clip_frames, photo_transform

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_rolled_grey_face_is_found_by_the_rotated_retry() -> None:
    grey = cv2.cvtColor(cv2.cvtColor(astronaut(), cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    clip = PhotoClip(0.12, 50.0, n_frames=1, motion_px=0.0)
    frame = clip_frames(grey, clip)[0]
    detector = MTCNN("cpu", min_face_fraction=0.05)
    upright = detector.detect([frame])
    assert not len(upright[0])  # MTCNN alone: nothing
    found = retry_rotated(detector.detect, [frame], upright, CropSettings().retry_rolls)[0]
    assert len(found)
    # where the face really is: the photo's face centre, moved as the clip moved it
    x, y, w, h = ASTRONAUT_FACE_BOX
    matrix = photo_transform((x + w / 2, y + h / 2), clip.roll_deg, clip.face_fraction * clip.height / h,
                             (clip.width / 2, 0.45 * clip.height))
    centre = matrix @ np.array([x + w / 2, y + h / 2, 1.0])
    best = found[np.argmax(found[:, 4])]
    box_centre = np.array([(best[0] + best[2]) / 2, (best[1] + best[3]) / 2])
    face_height = clip.face_fraction * clip.height
    assert np.linalg.norm(box_centre - centre) < 0.35 * face_height
    eyes = np.stack([best[5:7], best[10:12]], axis=1)  # the two eyes, (x, y) each
    angle = np.degrees(np.arctan2(eyes[1, 1] - eyes[0, 1], eyes[1, 0] - eyes[0, 0]))
    assert abs(abs(angle) - 50) < 15  # the landmarks keep the head's roll: alignment turns it upright
