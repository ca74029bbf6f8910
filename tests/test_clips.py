"""Clip models: temporal heads (shapes, gradients, sizes) and clips as data (time order, one augmentation per clip)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.data.clips import ClipDataset, clip_rows, clip_spacing_s
from pipeline.data.datamodule import EpochSampler
from pipeline.models.backbones import create_backbone
from pipeline.models.clip_window import ClipWindow
from pipeline.models.temporal_heads import HEADS, ClipNet, HeadConfig, build_temporal_head, head_parameters
from pipeline.runs.jobs.head_modes import head_mode
from tests.conftest import head_config
from tests.test_datamodule import FOLDS, make_datamodule, make_processed, write_fold_file

HEAD = {"hidden": 16, "layers": 2, "attention_heads": 4, "dropout": 0.0, "max_frames": 8}


@pytest.mark.parametrize("name", HEADS)
def test_every_head_maps_a_clip_to_logits_and_trains_every_weight(name: str) -> None:
    torch.manual_seed(0)
    head = build_temporal_head(head_config(name=name, **HEAD), in_features=24, n_classes=3)
    embeddings = torch.randn(5, 6, 24, requires_grad=True)
    logits = head(embeddings)
    assert logits.shape == (5, 3) and torch.isfinite(logits).all()
    logits.logsumexp(dim=1).sum().backward()
    assert embeddings.grad is not None and embeddings.grad.abs().sum() > 0
    without = [n for n, p in head.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not without, f"{name}: no gradient reaches {without}"
    assert head_parameters(head) == sum(p.numel() for p in head.parameters()) > 0


def test_temporal_heads_see_order_and_the_linear_head_does_not() -> None:
    torch.manual_seed(0)
    clip = torch.randn(2, 6, 24)
    reversed_clip = clip.flip(1)
    for name in ("gru", "transformer"):
        head = build_temporal_head(head_config(name=name, **HEAD), 24, 2).eval()
        assert not torch.allclose(head(clip), head(reversed_clip), atol=1e-5), name
    for name in ("linear", "attention"):  # pooling over time: the order does not matter
        head = build_temporal_head(head_config(name=name, **HEAD), 24, 2).eval()
        torch.testing.assert_close(head(clip), head(reversed_clip))


def test_transformer_refuses_a_clip_longer_than_its_time_positions() -> None:
    head = build_temporal_head(head_config(name="transformer", **HEAD), 24, 2)
    with pytest.raises(ValueError, match="max_frames=8"):
        head(torch.randn(1, 9, 24))


def test_head_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="model.head.name='lstm'"):
        head_config(name="lstm", **HEAD)
    with pytest.raises(ValueError, match="model.head.mode='joint': expected one of two_stage, end_to_end"):
        head_mode(head_config(name="gru", mode="joint", **HEAD))  # the head modes' registry names the modes
    with pytest.raises(ValueError, match="model.head: unknown setting"):
        HeadConfig.from_config({"name": "gru", "width": 3, **HEAD})


def test_clip_net_trains_a_real_backbone_end_to_end_through_the_head() -> None:
    torch.manual_seed(0)
    backbone, _ = create_backbone("vit_ref", img_size=32)
    net = ClipNet(backbone, build_temporal_head(head_config(name="transformer", **HEAD), backbone.num_features, 2))
    clips = torch.randn(2, 3, 3, 32, 32)
    logits = net(clips)
    assert logits.shape == (2, 2)
    logits.sum().backward()
    assert all(p.grad is not None for p in net.backbone.parameters() if p.requires_grad)
    with torch.no_grad():
        embeddings = net.backbone(clips.flatten(0, 1)).reshape(2, 3, -1)
        torch.testing.assert_close(net.forward_embeddings(embeddings), net(clips))


def test_a_clip_is_its_videos_crops_in_time_order(tmp_path: Path) -> None:
    processed = make_processed(tmp_path)
    datamodule = make_datamodule(processed, write_fold_file(tmp_path / "folds.csv", FOLDS))
    frames = datamodule.frames("train").sample(frac=1.0, random_state=0)  # shuffled: the order must come from time
    for length in (2, 5):
        videos = clip_rows(frames, length)
        assert len(videos) == frames["sample_name"].nunique()
        for video in videos.itertuples():
            picked = frames.loc[video.rows]
            assert len(picked) == length and set(picked["sample_name"]) == {video.sample_name}
            assert np.all(np.diff(picked["time_s"].to_numpy()) >= 0)
            assert picked["time_s"].iloc[0] == frames.loc[frames["sample_name"] == video.sample_name, "time_s"].min()


def test_the_clip_spacing_is_the_step_between_a_training_clips_crops(tmp_path: Path) -> None:
    processed = make_processed(tmp_path)
    datamodule = make_datamodule(processed, write_fold_file(tmp_path / "folds.csv", FOLDS))
    frames = datamodule.frames("train")
    for length in (2, 3):
        steps = [np.diff(frames.loc[video.rows, "time_s"].to_numpy()).mean()
                 for video in clip_rows(frames, length).itertuples()]
        assert clip_spacing_s(frames, length) == pytest.approx(float(np.median(steps)))
    assert clip_spacing_s(frames, 1) is None  # a clip of one crop has no step


def test_a_window_spaces_its_crops_as_training_clips_were_spaced() -> None:
    """At 5 frames a second with a training spacing of 0.4 s, a window of 3 ends with the newest crop and holds the
    crops nearest 0.4 s and 0.8 s before it (every other frame), not the last three; fewer at the start."""
    window = ClipWindow(3, spacing_s=0.4)
    held = [[int(e) for e in window.add(torch.tensor(float(i)), time_s=i * 0.2)] for i in range(8)]
    assert held[0] == [0] and held[2] == [0, 2] and held[4] == [0, 2, 4]
    assert held[7] == [3, 5, 7]
    # a frame without the face (7): the nearest crop to its time stands in
    window = ClipWindow(3, spacing_s=0.42)
    held = [[int(e) for e in window.add(torch.tensor(float(i)), time_s=i * 0.2)] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    assert held[-1] == [5, 6, 9]
    # without a spacing (a model kept before it was recorded) or without times (images): the last T crops
    for window, time_s in ((ClipWindow(3), 1.0), (ClipWindow(3, spacing_s=0.4), None)):
        held = [[int(e) for e in window.add(torch.tensor(float(i)), time_s)] for i in range(5)]
        assert held[1] == [0, 1] and held[4] == [2, 3, 4]


def test_one_augmentation_draw_for_every_frame_of_a_clip_keyed_by_the_sampler(tmp_path: Path) -> None:
    # every crop is the same picture: frames of one clip must come out identical, clips of other draws not
    processed = make_processed(tmp_path, same_image=True)
    datamodule = make_datamodule(processed, write_fold_file(tmp_path / "folds.csv", FOLDS), augment="heavy")
    clips = ClipDataset(datamodule.frames("train"), processed, datamodule.train_transform, clip_frames=4)
    keys = list(EpochSampler(len(clips), seed=0, stream=0, epoch=3))
    first, label, video = clips[keys[0]]
    assert first.shape == (4, 3, 32, 32) and int(video) == keys[0][0]
    assert int(label) == clips.labels[keys[0][0]]
    for frame in first[1:]:
        torch.testing.assert_close(frame, first[0], rtol=0, atol=0)
    second = clips[keys[1]][0]
    assert not torch.equal(second[0], first[0])  # another clip, another draw
    # exact resume: the same epoch's keys give the same clips, in a fresh sampler and dataset
    again = ClipDataset(datamodule.frames("train"), processed, datamodule.train_transform, clip_frames=4)
    assert list(EpochSampler(len(again), seed=0, stream=0, epoch=3)) == keys
    torch.testing.assert_close(again[keys[0]][0], first, rtol=0, atol=0)


def test_a_transformer_head_kept_before_its_blocks_were_written_out_loads_and_computes_the_same() -> None:
    """The head once used `nn.TransformerEncoder`: its state dict (other key names, the same packing) loads into
    today's head, which then gives that encoder's outputs."""
    torch.manual_seed(0)
    config = head_config(name="transformer", hidden=16, layers=2, attention_heads=4, dropout=0.0, max_frames=8)
    old = build_temporal_head(config, 12, 2)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
    old.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # the head as it was built then
    for parameter in old.parameters():
        nn.init.normal_(parameter, std=0.2)
    new = build_temporal_head(config, 12, 2)
    new.load_state_dict(old.state_dict(), strict=True)
    clips = torch.randn(3, 5, 12)
    with torch.no_grad():
        torch.testing.assert_close(new.eval()(clips), old.eval()(clips), atol=1e-5, rtol=1e-5)
