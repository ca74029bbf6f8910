"""A clip model in use: kept as a model file, loaded through the one scorer factory, scoring a sliding window of the
last T frames with a face over a real-face clip (scikit-image's astronaut through MTCNN; a tiny random network)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.models.factory import create_model
from pipeline.models.model_file import load_model_file, model_meta, save_model_file
from pipeline.models.scoring import WINDOW_COLUMN
from pipeline.models.temporal_heads import ClipNet, HeadConfig, build_temporal_head
from pipeline.runs.serving.mlflow_model import WEIGHTS_ARTIFACT, build_scorer
from pipeline.runs.store import tracking
from tests.photo_clips import PhotoClip, astronaut, clip_frames

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEAD = {"name": "transformer", "mode": "two_stage", "hidden": 16, "layers": 1, "attention_heads": 4, "dropout": 0.0,
        "max_frames": 8, "epochs": 1, "patience": 1}
T = 3
SCORING = {"threshold": 0.5, "aggregation": "mean", "topk": 3}  # a model_config's decision and aggregation


@pytest.fixture(scope="module")
def clip_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClipNet, Path]:
    torch.manual_seed(0)
    frame_net, source = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    head = build_temporal_head(HeadConfig.from_model_file(HEAD), frame_net.backbone.num_features, 2)
    net = ClipNet(frame_net.backbone, head)
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={"crop_fraction": 1.0, "clip_frames": T}, weights=tracking.weights_tags(source), head=HEAD)
    return net.eval(), save_model_file(net, meta, tmp_path_factory.mktemp("clip") / "model.pt")


def test_a_kept_clip_model_rebuilds_itself(clip_model) -> None:
    net, path = clip_model
    loaded, meta = load_model_file(path)
    assert isinstance(loaded, ClipNet) and meta["loader"]["clip_frames"] == T
    clips = torch.randn(2, T, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(clips), net(clips))


def test_predict_scores_a_sliding_window_of_the_last_frames_with_a_face(clip_model) -> None:
    net, path = clip_model
    scorer = build_scorer({WEIGHTS_ARTIFACT: str(path)}, {**SCORING, "crop": {"crop_size": 64}})
    frames = clip_frames(astronaut(), PhotoClip(face_fraction=0.3, n_frames=5))
    frames[2] = np.full_like(frames[2], 128)  # a frame without a face: no score, the window skips it
    table = scorer.score(frames)
    assert table["face_found"].tolist() == [True, True, False, True, True]
    assert table[WINDOW_COLUMN].tolist()[:2] == [1, 2] and np.isnan(table[WINDOW_COLUMN].iloc[2])
    assert table[WINDOW_COLUMN].tolist()[3:] == [3, 3]
    assert np.isnan(table["pain_probability"].iloc[2]) and table["pain"].iloc[2] is None
    # the last window is the clip model on the crops of frames 1, 3 and 4, in that order
    follower = scorer.follower()
    faces = [follower.step(found) for found in scorer.find_faces(frames)]
    crops = torch.stack([scorer.transform(image=scorer.crop(frames[i], faces[i]))["image"] for i in (1, 3, 4)])
    with torch.no_grad():
        expected = net(crops[None]).softmax(dim=1)[0, 1].item()
    assert table["pain_probability"].iloc[4] == pytest.approx(expected, abs=1e-5)
    # scored in two chunks with one follower, the windows carry over
    follower = scorer.follower()
    chunked = pd.concat([scorer.score(frames[:2], follower), scorer.score(frames[2:], follower)], ignore_index=True)
    np.testing.assert_allclose(chunked["pain_probability"], table["pain_probability"], atol=1e-6)
    assert 0 <= scorer.video_score(table) <= 1


def test_predict_spaces_a_windows_crops_as_the_training_clips_were(clip_model, tmp_path: Path) -> None:
    """A clip model that records its training clips' spacing (0.42 s) scored at 5 frames a second: the window at
    0.8 s holds the crops nearest 0.8, 0.38 and -0.04 s (frames 4, 1 and 0; frame 2 has no face), not the last three
    with a face."""
    net, _ = clip_model
    _, source = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={"crop_fraction": 1.0, "clip_frames": T, "clip_spacing_s": 0.42},
                      weights=tracking.weights_tags(source), head=HEAD)
    path = save_model_file(net, meta, tmp_path / "model.pt")
    scorer = build_scorer({WEIGHTS_ARTIFACT: str(path)}, {**SCORING, "crop": {"crop_size": 64}})
    frames = clip_frames(astronaut(), PhotoClip(face_fraction=0.3, n_frames=5))
    frames[2] = np.full_like(frames[2], 128)
    table = scorer.score(frames, times_s=[0.2 * i for i in range(5)])
    # at 0.2 s frames 0 and 1; at 0.6 s the crops nearest 0.6, 0.18 and -0.24 s: frames 3, 1 and 0
    assert table[WINDOW_COLUMN].tolist()[:2] == [1, 2] and table[WINDOW_COLUMN].tolist()[3:] == [3, 3]
    follower = scorer.follower()
    faces = [follower.step(found) for found in scorer.find_faces(frames)]
    crops = torch.stack([scorer.transform(image=scorer.crop(frames[i], faces[i]))["image"] for i in (0, 1, 4)])
    with torch.no_grad():
        expected = net(crops[None]).softmax(dim=1)[0, 1].item()
    assert table["pain_probability"].iloc[4] == pytest.approx(expected, abs=1e-5)
