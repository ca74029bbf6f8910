"""The window a clip model scores at each new crop of a followed face (`pipeline.models.scoring.FrameScorer`): the
crops nearest the times its training clips spanned, so a served clip spans what a training clip did."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class ClipWindow:
    """The clip a clip model scores at each crop: T embeddings of the followed face in time order, ending with the
    newest. With the spacing its training clips had (`spacing_s`: `loader.clip_frames` crops spread over the video,
    `model_file.clip_spacing_of`) and the crops' times, the window holds the crop nearest each of the times t,
    t - s, ..., t - (T - 1) s (among the crops no older than a spacing before the earliest of those times), each
    crop once, so a clip spans what a training clip spanned; at the start of a video it holds fewer. Without a
    spacing (a model kept before it was recorded) or without times (a sequence of images), the last T crops."""

    def __init__(self, frames: int, spacing_s: float | None = None) -> None:
        self.frames = int(frames)
        self.spacing_s = float(spacing_s) if spacing_s else None
        self.kept: deque[tuple[float, torch.Tensor]] = deque()

    def __len__(self) -> int:
        return len(self.kept)

    def add(self, embedding: torch.Tensor, time_s: float | None) -> list[torch.Tensor]:
        """Add the newest crop's embedding (at `time_s` seconds) and return the window ending with it."""
        if self.spacing_s is None or time_s is None:
            self.kept.append((float(len(self.kept)), embedding))
            while len(self.kept) > self.frames:
                self.kept.popleft()
            return [kept for _, kept in self.kept]
        self.kept.append((float(time_s), embedding))
        span = (self.frames - 1) * self.spacing_s
        while self.kept and self.kept[0][0] < time_s - span - self.spacing_s:  # older than the earliest target
            self.kept.popleft()
        times = np.array([t for t, _ in self.kept])
        picks: list[int] = []
        for step in range(self.frames - 1, -1, -1):
            nearest = int(np.argmin(np.abs(times - (time_s - step * self.spacing_s))))
            if not picks or nearest > picks[-1]:  # in time order, each crop once
                picks.append(nearest)
        return [self.kept[i][1] for i in picks]
