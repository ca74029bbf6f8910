"""Clips: a video's T face crops in time order, the input of a temporal head (`pipeline.models.temporal_heads`).

`clip_rows` chooses the crops (T evenly spaced over the video's crops, in time order; a video with fewer crops repeats
some, still in order). `ClipDataset` loads them as one (T, 3, H, W) tensor with one augmentation draw for all of a
clip's frames: the transform is re-seeded with the clip's seed before each frame, so every frame gets the same flip,
crop, rotation and colour change and the motion left is the face's. Seeds come from `EpochSampler` as for single crops
(keyed on seed, fold and epoch), so a resumed fit sees the same clips.
"""

from __future__ import annotations

import albumentations as A
import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from pipeline.data.augment import seed_transform
from pipeline.data.frame_dataset import FrameDataset

VIDEO_KEYS = ["subject_name", "sample_name"]


def clip_rows(frames: pd.DataFrame, clip_frames: int) -> pd.DataFrame:
    """One row per video: its identity, label and `rows`, the frame-table rows (index of `frames`) of its
    `clip_frames` crops in time order."""
    if clip_frames < 1:
        raise ValueError(f"loader.clip_frames must be >= 1, got {clip_frames}")
    videos = []
    for (subject, sample), video in frames.sort_values("time_s", kind="stable").groupby(VIDEO_KEYS, sort=True):
        picks = clip_picks(len(video), clip_frames)
        videos.append({"subject_name": subject, "sample_name": sample, "class_name": video["class_name"].iloc[0],
                       "label": int(video["label"].iloc[0]), "rows": video.index.to_numpy()[picks]})
    return pd.DataFrame(videos)


def clip_picks(crops: int, clip_frames: int) -> np.ndarray:
    """Which of a video's `crops` (in time order) its clip holds: `clip_frames` spread evenly from first to last."""
    return np.linspace(0, crops - 1, clip_frames).round().astype(int)


def clip_spacing_s(frames: pd.DataFrame, clip_frames: int) -> float | None:
    """The time between consecutive crops of the clips `clip_rows` makes of `frames` (seconds, the median over the
    videos of each clip's mean step): what a scorer of the kept clip model spaces its windows by. None when no video
    has two distinct crops."""
    steps = []
    for _, video in frames.sort_values("time_s", kind="stable").groupby(VIDEO_KEYS, sort=False):
        times = video["time_s"].to_numpy(dtype=float)[clip_picks(len(video), clip_frames)]
        if clip_frames > 1 and times[-1] > times[0]:
            steps.append((times[-1] - times[0]) / (clip_frames - 1))
    return float(np.median(steps)) if steps else None


def prediction_table(videos: pd.DataFrame) -> pd.DataFrame:
    """`clip_rows`' videos as prediction rows: a video's identity and label, and `frames`, the crops in its clip."""
    return videos.drop(columns=["rows"]).assign(frames=[len(rows) for rows in videos["rows"]])


class ClipDataset(Dataset):
    """Clips of one split: (clip (T, 3, H, W) float tensor, label int64 tensor, video number int64 tensor).

    The video number indexes `self.videos` (`clip_rows` of the split's frames). A key is a video number, or
    (video number, augmentation seed) as `EpochSampler` yields them.
    """

    def __init__(self, frames: pd.DataFrame, processed_dir, transform: A.BaseCompose, clip_frames: int) -> None:
        self.frames = FrameDataset(frames, processed_dir, transform)
        self.position = {row: item for item, row in enumerate(self.frames.rows)}  # frame-table row -> item
        self.videos = clip_rows(frames, clip_frames)
        self.labels = self.videos["label"].to_numpy(dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.videos)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        video, draw_seed = key if isinstance(key, tuple) else (key, None)
        if draw_seed is None:  # a plain video number: a seed from this process's (worker-seeded) torch stream
            draw_seed = int(torch.randint(0, 2**62, ()))
        images = []
        for row in self.videos["rows"].iloc[video]:
            seed_transform(self.transform, draw_seed)  # the same seed before every frame: one draw for the clip
            images.append(self.transform(image=self.frames.read_image(self.position[int(row)]))["image"])
        return torch.stack(images), torch.tensor(self.labels[video]), torch.tensor(video)
