"""Scoring new recordings: small faces found with predict's own minimum, one person followed when two are in view
(MTCNN on scikit-image's astronaut photograph pasted into frames; a tiny random network behind it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.models.factory import create_model
from pipeline.models.model_file import model_meta
from pipeline.models.scoring import CropSettings, FaceFollower, FrameScorer
from pipeline.runs.store import tracking
from tests.photo_clips import PhotoClip, astronaut, clip_frames

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def follow_one_face(found_per_frame, max_jump: float = 1.0, reacquire_after: int = 10) -> list:
    """`FaceFollower` over a whole sequence, as `make predict` steps it frame by frame."""
    follower = FaceFollower(max_jump, reacquire_after)
    return [follower.step(found) for found in found_per_frame]


def scorer(min_face_fraction: float) -> FrameScorer:
    torch.manual_seed(0)
    net, source = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={"crop_fraction": 1.0}, weights=tracking.weights_tags(source))
    return FrameScorer(net, meta, CropSettings(crop_size=64, min_face_fraction=min_face_fraction), aggregation="mean",
                       topk=3, threshold=0.5)


def test_a_small_face_is_found_with_the_predict_minimum_not_with_the_crop_minimum() -> None:
    # a face (brows to chin) 5 % of the frame height: BioVid's crop minimum (10 %) loses most frames of it
    frames = clip_frames(astronaut(), PhotoClip(face_fraction=0.05, n_frames=4))
    small = scorer(0.05).score(frames)
    assert small.face_found.all() and small.pain_probability.between(0, 1).all()
    assert scorer(0.1).score(frames).face_found.mean() <= 0.5


def test_one_person_is_followed_when_another_is_in_view() -> None:
    photo = astronaut()
    left = clip_frames(photo, PhotoClip(face_fraction=0.3, width=400, n_frames=8, seed=1))
    right = clip_frames(photo, PhotoClip(face_fraction=0.2, width=400, n_frames=8, seed=2))
    empty = np.full_like(left[0], 128)
    # the larger person (left) leaves for frames 3-4 and comes back; the other one stays throughout
    frames = [np.hstack([empty if i in (3, 4) else a, b]) for i, (a, b) in enumerate(zip(left, right, strict=True))]
    found = scorer(0.05).find_faces(frames)
    assert all(len(faces) == (1 if i in (3, 4) else 2) for i, faces in enumerate(found))
    followed = follow_one_face(found)
    centres = [None if face is None else (face[0] + face[2]) / 2 for face in followed]
    assert all(centres[i] < 400 for i in (0, 1, 2, 5, 6, 7))  # the left person, before and after the gap
    assert centres[3] is None and centres[4] is None  # not the other person while the followed one is away
    # after `reacquire_after` frames without the person, the most plausible face in view is followed
    # (here after 1), and from then on that person, also when the first one is back
    reacquired = [None if face is None else (face[0] + face[2]) / 2 for face in follow_one_face(found, 1.0, 1)]
    assert reacquired[3] is None and all(reacquired[i] > 400 for i in (4, 5, 6, 7))


@pytest.mark.parametrize("aggregation", ["mean", "max", "topk"])
def test_a_video_is_scored_as_the_cross_validation_aggregates_it(aggregation: str) -> None:
    """The same crops through the CV's path (frame table -> metrics.aggregate_videos) and predict's
    (FrameScorer.score's class probabilities -> video_score) give the same video score, for every aggregation."""
    import pandas as pd

    from pipeline.evaluation.metrics import aggregate_videos

    base = scorer(0.05)
    frame_scorer = FrameScorer(base.net, base.meta, base.settings, aggregation=aggregation, topk=3)
    rng = np.random.default_rng(0)
    rows, predicted = [], []
    for video, n_frames in enumerate((2, 5, 7)):
        crops = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(n_frames)]
        probs = frame_scorer.class_probabilities(crops)
        rows += [{"subject_name": "s", "sample_name": f"v{video}", "label": 1, "prob_BL1": p[0], "prob_PA4": p[1]}
                 for p in probs]
        # predict's per-frame table for the same crops, with two faceless frames among them (ignored)
        table = pd.DataFrame({"face_found": [True] * n_frames + [False, False],
                              "prob_BL1": [*probs[:, 0], np.nan, np.nan], "prob_PA4": [*probs[:, 1], np.nan, np.nan]})
        predicted.append(frame_scorer.video_score(table))
    videos = aggregate_videos(pd.DataFrame(rows), aggregation, 3)
    assert videos.prob_BL1.std() > 0  # the videos differ: the comparison can tell them apart
    np.testing.assert_allclose(predicted, 1.0 - videos.prob_BL1.to_numpy(), atol=1e-6)
    assert np.isnan(frame_scorer.video_score(pd.DataFrame({"face_found": [False], "prob_BL1": [np.nan],
                                                           "prob_PA4": [np.nan]})))
