"""Where one kept fold model looks, on the fold's test crops (`make inspect`, `pipeline.analysis.inspection`): attention
rollout (ViT backbones; `pipeline.analysis.attention`) and Grad-CAM (every backbone; `pipeline.analysis.gradcam`) on
every test crop, averaged per video; the region score of each map (`pipeline.analysis.regions`) where the dataset
records the action-unit regions; and the mean attention distance of every head in every layer (ViT).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from pipeline.analysis.attention import AttentionRecorder, attention_rollout, mean_attention_distance
from pipeline.analysis.gradcam import CamLayer, gradcam_layer, gradcam_maps
from pipeline.analysis.regions import region_score
from pipeline.data.augment import denormalize
from pipeline.data.datamodule import PainDataModule
from pipeline.evaluation.metrics import aggregate_videos
from pipeline.models.backbones import PainNet
from pipeline.models.introspection import vit_of
from pipeline.models.ordinal import output_probabilities

PREFIX = "inspect"

# A region mask for one test crop: (frame-table row, the model's data config, crop fraction) -> boolean mask over the
# model's input, or None where the dataset records no regions for that frame.
RegionMasks = Callable[[pd.Series, object, float], np.ndarray | None]


@dataclass
class FoldInspection:
    """One fold's maps and numbers."""

    fold: int
    run_id: str
    methods: list[str]
    videos: pd.DataFrame  # one row per test video: names, label, probabilities, pred, region scores per method
    maps: dict[str, np.ndarray]  # method -> (videos, H, W): the video's crops' maps averaged
    display: np.ndarray  # (videos, H, W, 3) uint8: one crop per video (its middle one), as the model sees it
    display_masks: np.ndarray | None  # (videos, H, W) bool: the regions on that crop, when recorded
    attention_distance: np.ndarray | None  # (layers, heads) in pixels of the model input (ViT)
    cam_layer: str
    metrics: dict[str, float] = field(default_factory=dict)


def rollout_maps(net: PainNet, images: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """Logits, rollout maps (B, H, W) upsampled onto the input, and the mean attention distance (layers, heads) of
    this batch, from one forward pass with attention recorded."""
    with torch.no_grad(), AttentionRecorder(net) as recorder:
        logits = net(images)
    attentions = recorder.checked()
    rows, cols = recorder.grid
    maps = attention_rollout(attentions, recorder.num_prefix_tokens).reshape(-1, 1, rows, cols)
    maps = F.interpolate(maps, size=images.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    distances = torch.stack([mean_attention_distance(weights, recorder.grid, recorder.patch_size,
                                                     recorder.num_prefix_tokens) for weights in attentions])
    return logits.cpu(), maps.clamp_min(0).cpu().numpy(), distances.cpu()


def methods_for(net: PainNet) -> list[str]:
    return (["rollout"] if vit_of(net) is not None else []) + ["gradcam"]


class VideoMaps:
    """The fold's test crops gathered per video as batches are scored: each method's maps summed, the crops counted,
    the middle crop of each video (and its regions) kept for display, each crop's region score, the empty maps, the
    probabilities and the attention distance summed over crops."""

    def __init__(self, frames: pd.DataFrame, methods: list[str], image_size: int, with_regions: bool) -> None:
        ordered = frames.sort_values(["subject_name", "sample_name", "frame_index"])
        by_video = list(ordered.groupby(["subject_name", "sample_name"], sort=True))
        self.frames, self.methods = frames, methods
        self.video_keys = [key for key, _ in by_video]  # video i of every array below
        self.video_of_row = {row: index for index, (_, rows) in enumerate(by_video) for row in rows.index}
        self.middle_rows = {rows.index[len(rows) // 2] for _, rows in by_video}
        n_videos, shape = len(self.video_keys), (image_size, image_size)
        self.sums = {method: np.zeros((n_videos, *shape), dtype=np.float32) for method in methods}
        self.counts = np.zeros(n_videos, dtype=np.int64)
        self.display = np.zeros((n_videos, *shape, 3), dtype=np.uint8)
        self.display_masks = np.zeros((n_videos, *shape), dtype=bool) if with_regions else None
        self.crop_rows: list = []
        self.crop_scores: dict[str, list[float]] = {method: [] for method in methods}
        self.empty = dict.fromkeys(methods, 0)
        self.probabilities: list[np.ndarray] = []
        self.distance_sum: torch.Tensor | None = None
        self.distance_count = 0

    def add_distances(self, distances: torch.Tensor, n_images: int) -> None:
        weighted = distances * n_images
        self.distance_sum = weighted if self.distance_sum is None else self.distance_sum + weighted
        self.distance_count += n_images

    def add(self, rows: list, images: torch.Tensor, probs: torch.Tensor, maps: dict[str, np.ndarray],
            regions: RegionMasks | None, data_config, crop_fraction: float) -> None:
        """One scored batch: `rows` (frame-table rows of `images`), their probabilities and each method's maps."""
        self.probabilities.append(probs.numpy())
        for position, row in enumerate(rows):
            video = self.video_of_row[row]
            self.counts[video] += 1
            mask = regions(self.frames.loc[row], data_config, crop_fraction) if regions is not None else None
            for method in self.methods:
                crop_map = maps[method][position]
                self.sums[method][video] += crop_map
                self.empty[method] += int(not crop_map.sum() > 0)
                self.crop_scores[method].append(region_score(crop_map, mask) if mask is not None else np.nan)
            self.crop_rows.append(row)
            if row in self.middle_rows:
                self.display[video] = denormalize(images[position].cpu(), data_config)
                if self.display_masks is not None and mask is not None:
                    self.display_masks[video] = mask

    def video_table(self, class_names: Sequence[str], aggregation: str, topk: int) -> pd.DataFrame:
        """One row per test video, in the order of the arrays: probabilities aggregated as the CV does, the call,
        whether it is right, each method's mean region score and the number of crops."""
        crops = self.frames.loc[self.crop_rows, ["subject_name", "sample_name", "frame_index", "label"]].copy()
        probs = np.concatenate(self.probabilities)
        for index, name in enumerate(class_names):
            crops[f"prob_{name}"] = probs[:, index]
        for method in self.methods:
            crops[f"region_score_{method}"] = self.crop_scores[method]
        videos = aggregate_videos(crops, aggregation, topk)
        scores = crops.groupby(["subject_name", "sample_name"], sort=True)[
            [f"region_score_{method}" for method in self.methods]].mean()
        videos = videos.merge(scores, left_on=["subject_name", "sample_name"], right_index=True, how="left")
        videos = videos.set_index(["subject_name", "sample_name"]).loc[self.video_keys].reset_index()  # row i = video i
        videos["correct"] = videos["pred"] == videos["label"]
        videos["n_crops"] = self.counts
        return videos

    def mean_maps(self) -> dict[str, np.ndarray]:
        return {m: (self.sums[m] / self.counts[:, None, None]).astype(np.float32) for m in self.methods}

    def mean_distance(self) -> np.ndarray | None:
        return None if self.distance_sum is None else (self.distance_sum / self.distance_count).numpy()


def inspect_fold(net: PainNet, datamodule: PainDataModule, class_names: Sequence[str], fold: int, run_id: str,
                 regions: RegionMasks | None, crop_fraction: float, aggregation: str, topk: int) -> FoldInspection:
    """Maps, predictions and region scores of `net` on the fold's test crops (`datamodule`, set up)."""
    net.eval()
    data_config = net.backbone.data_config
    image_size = int(data_config.input_size[1])
    methods = methods_for(net)
    layer: CamLayer = gradcam_layer(net, image_size)
    gathered = VideoMaps(datamodule.frames("test"), methods, image_size, regions is not None)
    device = next(net.parameters()).device
    for images, _, rows in datamodule.test_dataloader():
        images = images.to(device)
        maps: dict[str, np.ndarray] = {}
        if "rollout" in methods:
            logits, maps["rollout"], distances = rollout_maps(net, images)
            gathered.add_distances(distances, len(images))
        else:
            with torch.no_grad():
                logits = net(images).cpu()
        probs = output_probabilities(net.head, logits.float())  # softmax, or an ordinal head's levels
        maps["gradcam"] = gradcam_maps(net, images, probs.argmax(dim=1).tolist(), layer)
        gathered.add(rows.tolist(), images, probs, maps, regions, data_config, crop_fraction)
    inspection = FoldInspection(fold, run_id, methods, gathered.video_table(class_names, aggregation, topk),
                                gathered.mean_maps(), gathered.display, gathered.display_masks,
                                gathered.mean_distance(), layer.name)
    inspection.metrics = fold_metrics(inspection, gathered.empty, len(gathered.crop_rows))
    return inspection


def fold_metrics(inspection: FoldInspection, empty: dict[str, int], n_crops: int) -> dict[str, float]:
    """The numbers a child run gets: region scores (all test videos, pain and no-pain videos), empty maps,
    attention distance per layer."""
    metrics: dict[str, float] = {}
    videos = inspection.videos
    for method in inspection.methods:
        scores = videos[f"region_score_{method}"]
        if scores.notna().any():
            metrics[f"{PREFIX}/{method}/region_score"] = float(scores.mean())
            metrics[f"{PREFIX}/{method}/region_score_pain"] = float(scores[videos["label"] > 0].mean())
            metrics[f"{PREFIX}/{method}/region_score_no_pain"] = float(scores[videos["label"] == 0].mean())
        metrics[f"{PREFIX}/{method}/empty_map_share"] = empty[method] / max(n_crops, 1)
    if inspection.attention_distance is not None:
        for layer, heads in enumerate(inspection.attention_distance):
            metrics[f"{PREFIX}/attention_distance/layer_{layer}"] = float(np.mean(heads))
    return {key: value for key, value in metrics.items() if np.isfinite(value)}
