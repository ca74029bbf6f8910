"""`make inspect`: where the kept fold models of a cross-validation look, on each fold's test videos only.

For every fold with a kept model (`model/model.pt` on its FINISHED child run):

- maps on every test crop: attention rollout (ViT backbones; `pipeline.analysis.attention`) and Grad-CAM (every
backbone;
  `pipeline.analysis.gradcam`), averaged per video;
- a grid image of test videos (pain and no-pain, predicted right and wrong): a crop, then each method's overlay;
- the region score of each method (`pipeline.analysis.regions`): the share of map mass inside the action-unit regions
  over the regions' share of the area, where the dataset records those regions (the synthetic twin);
- for ViT backbones, the ViT paper's inspections: patch-embedding filters (principal components as RGB patches),
  cosine similarity of the position embeddings, and the mean attention distance of every head in every layer.

Numbers go to the fold's child run (`inspect/...` metrics, CSV tables) and their mean and spread over folds to the
parent run. Pictures are written under `reports/inspect/`; they are logged to MLflow only for the synthetic twin. On
BioVid (participants' faces, biometric data under a data-use agreement) no image and no map leaves the user's disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric
from omegaconf import DictConfig

from pipeline.analysis.attention import (
    AttentionRecorder,
    attention_rollout,
    mean_attention_distance,
    patch_embedding_components,
    position_embedding_similarity,
)
from pipeline.analysis.gradcam import CamLayer, gradcam_layer, gradcam_maps
from pipeline.analysis.regions import region_score
from pipeline.data.augment import denormalize
from pipeline.data.datamodule import LoaderConfig, PainDataModule
from pipeline.data.fold_files import fold_file_sha256
from pipeline.data.prepare import is_twin
from pipeline.data.tasks import get_task
from pipeline.evaluation.metrics import aggregate_videos, summarize_folds
from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.introspection import vit_of
from pipeline.models.model_file import load_model_file
from pipeline.models.ordinal import output_probabilities
from pipeline.runs.store import cv_runs, tracking
from pipeline.runs.store.cv_runs import CvNotFound
from pipeline.utils.atomic_io import atomic_write_csv, save_png
from pipeline.utils.paths import resolve_path

log = logging.getLogger(__name__)

PREFIX = "inspect"
GRID_PER_CASE = 2  # videos per (pain / no pain) x (right / wrong) case in the grid image

# A region mask for one test crop: (frame-table row, the model's data config, crop fraction) -> boolean mask over the
# model's input, or None where the dataset records no regions for that frame.
RegionMasks = Callable[[pd.Series, object, float], np.ndarray | None]


class InspectionError(RuntimeError):
    """The cross-validation cannot be inspected (no such run, no kept models, other folds)."""


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


# --- the maps ------------------------------------------------------------------------------------------------------


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


def inspect_fold(net: PainNet, datamodule: PainDataModule, class_names: Sequence[str], fold: int, run_id: str,
                 regions: RegionMasks | None = None, crop_fraction: float = 1.0, aggregation: str = "mean",
                 topk: int = 3) -> FoldInspection:
    """Maps, predictions and region scores of `net` on the fold's test crops (`datamodule`, set up)."""
    net.eval()
    data_config = net.backbone.data_config
    image_size = int(data_config.input_size[1])
    methods = methods_for(net)
    layer: CamLayer = gradcam_layer(net, image_size)
    frames = datamodule.frames("test")
    ordered = frames.sort_values(["subject_name", "sample_name", "frame_index"])
    by_video = list(ordered.groupby(["subject_name", "sample_name"], sort=True))
    video_keys = [key for key, _ in by_video]  # video i of every array below
    video_of_row = {row: index for index, (_, rows) in enumerate(by_video) for row in rows.index}
    n_videos = len(video_keys)
    middle_rows = {rows.index[len(rows) // 2] for _, rows in by_video}

    sums = {method: np.zeros((n_videos, image_size, image_size), dtype=np.float32) for method in methods}
    counts = np.zeros(n_videos, dtype=np.int64)
    display = np.zeros((n_videos, image_size, image_size, 3), dtype=np.uint8)
    display_masks = np.zeros((n_videos, image_size, image_size), dtype=bool) if regions is not None else None
    crop_rows, crop_scores = [], {method: [] for method in methods}
    empty = dict.fromkeys(methods, 0)
    probabilities = []
    distance_sum, distance_count = None, 0
    device = next(net.parameters()).device
    for images, _, rows in datamodule.test_dataloader():
        images = images.to(device)
        maps: dict[str, np.ndarray] = {}
        if "rollout" in methods:
            logits, maps["rollout"], distances = rollout_maps(net, images)
            distance_sum = distances * len(images) if distance_sum is None else distance_sum + distances * len(images)
            distance_count += len(images)
        else:
            with torch.no_grad():
                logits = net(images).cpu()
        probs = output_probabilities(net.head, logits.float())  # softmax, or an ordinal head's levels
        maps["gradcam"] = gradcam_maps(net, images, probs.argmax(dim=1).tolist(), layer)
        probabilities.append(probs.numpy())
        for position, row in enumerate(rows.tolist()):
            video = video_of_row[row]
            counts[video] += 1
            mask = regions(frames.loc[row], data_config, crop_fraction) if regions is not None else None
            for method in methods:
                crop_map = maps[method][position]
                sums[method][video] += crop_map
                empty[method] += int(not crop_map.sum() > 0)
                crop_scores[method].append(region_score(crop_map, mask) if mask is not None else np.nan)
            crop_rows.append(row)
            if row in middle_rows:
                display[video] = denormalize(images[position].cpu(), data_config)
                if display_masks is not None and mask is not None:
                    display_masks[video] = mask

    crops = frames.loc[crop_rows, ["subject_name", "sample_name", "frame_index", "label"]].copy()
    probs = np.concatenate(probabilities)
    for index, name in enumerate(class_names):
        crops[f"prob_{name}"] = probs[:, index]
    for method in methods:
        crops[f"region_score_{method}"] = crop_scores[method]
    videos = aggregate_videos(crops, aggregation, topk)
    scores = crops.groupby(["subject_name", "sample_name"], sort=True)[
        [f"region_score_{method}" for method in methods]].mean()
    videos = videos.merge(scores, left_on=["subject_name", "sample_name"], right_index=True, how="left")
    videos = videos.set_index(["subject_name", "sample_name"]).loc[video_keys].reset_index()  # row i = video i
    videos["correct"] = videos["pred"] == videos["label"]
    videos["n_crops"] = counts

    inspection = FoldInspection(
        fold, run_id, methods, videos, {m: (sums[m] / counts[:, None, None]).astype(np.float32) for m in methods},
        display, display_masks,
        None if distance_sum is None else (distance_sum / distance_count).numpy(), layer.name)
    inspection.metrics = fold_metrics(inspection, empty, len(crop_rows))
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


# --- pictures ------------------------------------------------------------------------------------------------------


def grid_videos(videos: pd.DataFrame, per_case: int = GRID_PER_CASE) -> pd.DataFrame:
    """Up to `per_case` videos of each case: pain / no pain, predicted right / wrong (most confident first)."""
    cases = []
    for pain in (True, False):
        for correct in (True, False):
            case = videos[((videos["label"] > 0) == pain) & (videos["correct"] == correct)]
            confidence = case[[c for c in case.columns if c.startswith("prob_")]].max(axis=1)
            cases.append(case.assign(case=f"{'pain' if pain else 'no pain'}, {'right' if correct else 'wrong'}")
                         .loc[confidence.sort_values(ascending=False).index[:per_case]])
    return pd.concat(cases)


def overlay(image: np.ndarray, saliency: np.ndarray) -> np.ndarray:
    """The crop in grey with the map in colour on top, stretched from its minimum (blue) to its maximum (red) for the
    eye; how much it really varies is the peak / mean ratio in the panel's title."""
    from matplotlib import colormaps

    grey = image.astype(np.float32).mean(axis=2, keepdims=True).repeat(3, axis=2) / 255.0
    low, high = float(saliency.min()), float(saliency.max())
    stretched = (saliency - low) / (high - low) if high > low else np.zeros_like(saliency)
    heat = colormaps["jet"](stretched)[..., :3]
    return np.clip(0.5 * grey + 0.5 * heat, 0, 1)


def plot_grid(inspection: FoldInspection, path: Path, title: str) -> None:
    chosen = grid_videos(inspection.videos)
    columns = ["crop", *inspection.methods]
    height = 2.4 * max(len(chosen), 1)
    figure = Figure(figsize=(2.1 * len(columns) + 1.5, height))
    axes: Any = figure.subplots(max(len(chosen), 1), len(columns), squeeze=False)  # an array of Axes
    figure.subplots_adjust(top=1 - 1.0 / height, bottom=0.02, hspace=0.35)
    for axis in axes.ravel():
        axis.axis("off")
    for row, (video, item) in enumerate(chosen.iterrows()):
        image = inspection.display[video]
        prob = max(float(item[c]) for c in item.index if str(c).startswith("prob_"))
        for column, name in enumerate(columns):
            axis = axes[row, column]
            if name == "crop":
                axis.imshow(image)
                axis.set_title(f"{item['sample_name']}\n{item['case']} (p={prob:.2f})", fontsize=7)
            else:
                saliency = inspection.maps[name][video]
                axis.imshow(overlay(image, saliency))
                score = item.get(f"region_score_{name}", np.nan)
                described = (f"peak/mean {saliency.max() / saliency.mean():.2f}" if saliency.mean() > 0
                             else "empty map")
                axis.set_title(f"{name}: {described}" + (f"\nregion score {score:.2f}" if np.isfinite(score) else ""),
                               fontsize=7)
            if inspection.display_masks is not None and inspection.display_masks[video].any():
                axis.contour(inspection.display_masks[video], levels=[0.5], colors="white", linewidths=0.6)
    figure.suptitle(title, fontsize=9)
    save_png(figure, path)


def mosaic(tiles: np.ndarray, columns: int, gap: int = 1, fill: float = 1.0) -> np.ndarray:
    """Tiles (n, h, w[, c]) laid out row by row, `columns` to a row, `gap` pixels of `fill` between them."""
    n, height, width = tiles.shape[:3]
    rows = int(np.ceil(n / columns))
    shape = (rows * (height + gap) - gap, columns * (width + gap) - gap, *tiles.shape[3:])
    canvas = np.full(shape, fill, dtype=np.float32)
    for index, tile in enumerate(tiles):
        top, left = (index // columns) * (height + gap), (index % columns) * (width + gap)
        canvas[top:top + height, left:left + width] = tile
    return canvas


def plot_embedding_filters(net: PainNet, path: Path, n_components: int = 28) -> None:
    """The paper's figure 7 (left): the leading principal components of the patch-embedding filters, as RGB
    patches (grey = 0), read row by row."""
    vit = vit_of(net)
    components, explained = patch_embedding_components(vit.patch_embed.proj.weight, n_components)
    scale = np.abs(components).reshape(len(components), -1).max(axis=1).clip(min=1e-12)
    tiles = np.clip(0.5 + 0.5 * components / scale[:, None, None, None], 0, 1)
    figure = Figure(figsize=(7, 4.4))
    axis = figure.subplots()
    axis.imshow(mosaic(tiles, columns=7), interpolation="nearest")
    axis.axis("off")
    axis.set_title(f"Patch-embedding filters: the first {len(tiles)} principal components as RGB patches\n"
                   f"(they explain {100 * explained.sum():.0f} % of the filters' variance; grey = 0)", fontsize=9)
    save_png(figure, path)


def plot_position_similarity(net: PainNet, path: Path) -> None:
    """The paper's figure 7 (centre): for every patch position, the cosine similarity of its position embedding
    with all others, drawn as a small map placed at that position on the patch grid."""
    vit = vit_of(net)
    grid = tuple(int(v) for v in vit.patch_embed.grid_size)
    prefix = 0 if getattr(vit, "no_embed_class", False) else int(getattr(vit, "num_prefix_tokens", 1))
    similarity = position_embedding_similarity(vit.pos_embed, grid, prefix)
    rows, cols = grid
    tiles = similarity.reshape(rows * cols, rows, cols)
    figure = Figure(figsize=(6, 5.2))
    axis = figure.subplots()
    image = axis.imshow(mosaic(tiles, columns=cols, fill=np.nan), vmin=-1, vmax=1, cmap="viridis",
                        interpolation="nearest")
    axis.axis("off")
    figure.colorbar(image, ax=axis, shrink=0.7, label="cosine similarity")
    axis.set_title(f"Position embeddings ({rows} x {cols} patches): each small map is one position's similarity "
                   f"to all positions", fontsize=9)
    save_png(figure, path)


def plot_attention_distance(distance: np.ndarray, image_size: int, path: Path) -> None:
    figure = Figure(figsize=(5, 3.6))
    axis = figure.subplots()
    layers, heads = distance.shape
    for head in range(heads):
        axis.scatter(np.arange(layers), distance[:, head], s=14, label=f"head {head}" if heads <= 12 else None)
    axis.set_xlabel("layer (network depth)")
    axis.set_ylabel("mean attention distance (pixels)")
    axis.set_ylim(0, image_size * 0.75)
    axis.set_title(f"Mean attention distance per head, on the fold's test crops ({image_size} px)", fontsize=9)
    axis.grid(alpha=0.3)
    if heads <= 12:
        axis.legend(fontsize=6, ncol=2)
    save_png(figure, path)


def write_fold_outputs(inspection: FoldInspection, net: PainNet, out: Path, title: str) -> dict[str, list[Path]]:
    """Pictures and maps (stay on disk unless the dataset allows images in MLflow) and number tables."""
    out.mkdir(parents=True, exist_ok=True)
    images, numbers = [], []
    plot_grid(inspection, out / "grid.png", title)
    images.append(out / "grid.png")
    maps_path = out / "video_maps.npz"
    np.savez_compressed(maps_path, sample_name=inspection.videos["sample_name"].to_numpy(dtype=str),
                        label=inspection.videos["label"].to_numpy(),
                        **{f"map_{method}": inspection.maps[method] for method in inspection.methods})
    images.append(maps_path)  # maps over face crops: treated like the pictures
    atomic_write_csv(out / "video_scores.csv", inspection.videos)
    numbers.append(out / "video_scores.csv")
    if inspection.attention_distance is not None:
        image_size = int(net.backbone.data_config.input_size[1])
        plot_attention_distance(inspection.attention_distance, image_size, out / "attention_distance.png")
        plot_embedding_filters(net, out / "embedding_filters.png")
        plot_position_similarity(net, out / "position_similarity.png")
        images += [out / "attention_distance.png", out / "embedding_filters.png", out / "position_similarity.png"]
        table = pd.DataFrame(inspection.attention_distance,
                             columns=[f"head_{h}" for h in range(inspection.attention_distance.shape[1])])
        atomic_write_csv(out / "attention_distance.csv", table.rename_axis("layer").reset_index())
        numbers.append(out / "attention_distance.csv")
    return {"images": images, "numbers": numbers}


# --- the cross-validation ------------------------------------------------------------------------------------------


def untrained_like(meta: dict, seed: int) -> PainNet:
    """A randomly initialised network of the kept model's backbone, size and classes: the baseline."""
    torch.manual_seed(seed)
    net, _ = create_model(meta["model_name"], n_classes=len(meta["class_names"]), pretrained=False,
                          img_size=meta["img_size"])
    return net.eval()


def log_fold(client: MlflowClient, inspection: FoldInspection, outputs: dict[str, list[Path]], images_allowed: bool,
             prefix: str) -> None:
    now = int(time.time() * 1000)
    metrics = [Metric(key.replace(f"{PREFIX}/", prefix, 1), value, now, 0)
               for key, value in inspection.metrics.items()]
    client.log_batch(inspection.run_id, metrics=metrics)
    artifact_dir = prefix.rstrip("/")
    for path in outputs["numbers"] + (outputs["images"] if images_allowed else []):
        client.log_artifact(inspection.run_id, str(path), artifact_dir)


def log_parent(client: MlflowClient, parent_id: str, inspections: list[FoldInspection], prefix: str,
               images_allowed: bool, out_root: Path) -> dict[str, float]:
    """Mean and spread over folds of every fold number, onto the parent run; returns them."""
    summary = summarize_folds([{key.replace(f"{PREFIX}/", prefix, 1): value
                                for key, value in inspection.metrics.items()} for inspection in inspections])
    summary = {key: value for key, value in summary.items() if np.isfinite(value)}
    now = int(time.time() * 1000)
    client.log_batch(parent_id, metrics=[Metric(key, value, now, 0) for key, value in summary.items()])
    client.set_tag(parent_id, tracking.INSPECT_IMAGES_TAG,
                   "mlflow and disk" if images_allowed else f"disk only ({out_root})")
    return summary


def inspect_cv(cfg: DictConfig, run_id: str | None = None, untrained: bool = False,
               regions: RegionMasks | None = None, no_regions_reason: str = "no region masks were given") -> dict:
    """Inspect every fold of a cross-validation (see the module docstring); returns the parent's summary and paths."""
    uri = tracking.store_uri(cfg.mlflow.tracking_uri)
    client = MlflowClient(uri)
    try:
        parent = cv_runs.source_cv(client, cfg, run_id)
    except CvNotFound as error:
        raise InspectionError(str(error)) from None
    parent_id = parent.info.run_id
    tags, params = parent.data.tags, parent.data.params
    dataset = tags.get("dataset", cfg.data.name)
    # face images go to MLflow only for a twin's drawn faces; recordings of people (BioVid) stay on disk
    images_allowed = dataset == cfg.data.name and is_twin(cfg)
    fold_file = resolve_path(cfg.fold_file)
    if not fold_file.is_file() or fold_file_sha256(fold_file) != tags.get("fold_file_sha256"):
        raise InspectionError(f"the fold file {fold_file} is not the one cross-validation {parent_id} ran on "
                              f"(SHA-256 {tags.get('fold_file_sha256')}); its test subjects cannot be recovered")
    children = tracking.finished_fold_runs(client, parent_id)
    if not children:
        raise InspectionError(f"cross-validation {parent_id} has no finished fold runs")
    if tags.get("head", "linear") not in ("", "linear"):  # maps and region scores are of single crops
        raise InspectionError(f"cross-validation {parent_id} trained clip models ({tags['head']}): make inspect draws "
                              f"attention and Grad-CAM maps of frame models only; inspect the frame model's CV of "
                              f"the same backbone (model.head.name=linear)")

    kind = "untrained" if untrained else "trained"
    prefix = f"{PREFIX}/untrained/" if untrained else f"{PREFIX}/"
    out_root = (resolve_path(cfg.reports_dir) / "inspect" /
                f"{tags.get('model')}_{dataset}_{tags.get('protocol')}_{tags.get('task')}_{parent_id[:8]}"
                f"{'_untrained' if untrained else ''}")
    print(f"inspecting {parent.info.run_name!r} (parent run {parent_id}), {len(children)} fold(s), {kind} models")
    if images_allowed:
        print(f"pictures: {out_root} and the fold runs in MLflow (synthetic faces)")
    else:
        print(f"{dataset} faces are participants' biometric data: pictures and maps are written to {out_root} on "
              f"this disk only; MLflow gets numbers only")
    if regions is None:
        print(f"region score: not computed ({no_regions_reason})")

    inspections = []
    for fold, child in sorted(children.items()):
        try:
            net, meta = load_model_file(child.info.run_id, tracking_uri=uri)
        except Exception as error:  # a CV run with cv.log_models=false keeps no model
            raise InspectionError(f"fold {fold}: no kept model in child run {child.info.run_id} ({error}); "
                                  f"cross-validations run with cv.log_models=false cannot be inspected") from error
        if untrained:
            net = untrained_like(meta, seed=int(cfg.seed) + fold)
        net = net.to("cuda" if torch.cuda.is_available() else "cpu")
        task = get_task(meta["task"])
        loader = meta.get("loader", {})
        # the kept model's own crop window and crops per clip, in this process, one batch size throughout
        settings = LoaderConfig.from_config(
            cfg.loader, eval_batch_size=int(cfg.loader.batch_size), num_workers=0,
            frames_per_video=loader.get("frames_per_video"), crop_fraction=loader.get("crop_fraction") or 1.0,
            from_s=loader.get("from_s"))
        datamodule = PainDataModule(resolve_path(cfg.data.processed_dir), fold_file, fold, task,
                                    net.backbone.data_config, {}, settings)
        datamodule.setup()
        started = time.perf_counter()
        inspection = inspect_fold(net, datamodule, meta["class_names"], fold, child.info.run_id, regions,
                                  crop_fraction=loader.get("crop_fraction") or 1.0,
                                  aggregation=params.get("trainer.aggregation", "mean"),
                                  topk=int(params.get("trainer.topk", 3)))
        title = (f"{tags.get('model')} fold {fold} ({kind}), {len(inspection.videos)} test videos; "
                 f"Grad-CAM at {inspection.cam_layer}")
        outputs = write_fold_outputs(inspection, net, out_root / f"fold_{fold}", title)
        log_fold(client, inspection, outputs, images_allowed, prefix)
        inspections.append(inspection)
        print(f"fold {fold}: {len(inspection.videos)} test videos, {int(inspection.videos['n_crops'].sum())} crops, "
              f"{time.perf_counter() - started:.0f} s | " + fold_line(inspection, regions is not None))

    summary = log_parent(client, parent_id, inspections, prefix, images_allowed, out_root)
    table = pd.DataFrame([{"fold": i.fold, "run_id": i.run_id, **i.metrics} for i in inspections])
    atomic_write_csv(out_root / "summary.csv", table)
    for line in summary_lines(inspections):
        print(line)
    print(f"written: {out_root}")
    return {"parent_run_id": parent_id, "summary": summary, "out_dir": out_root, "folds": inspections,
            "images_in_mlflow": images_allowed}


def fold_line(inspection: FoldInspection, with_regions: bool) -> str:
    parts = []
    for method in inspection.methods:
        score = inspection.metrics.get(f"{PREFIX}/{method}/region_score")
        if score is not None:
            parts.append(f"{method}: region score {score:.2f}")
        else:
            parts.append(f"{method}: no region score (every map empty)" if with_regions else f"{method}: maps written")
    if inspection.attention_distance is not None:
        parts.append("attention distance by layer " + " ".join(f"{np.mean(h):.0f}" for h in
                                                                inspection.attention_distance) + " px")
    return "; ".join(parts)


def summary_lines(inspections: list[FoldInspection]) -> list[str]:
    """Each method's region score over folds, with how many folds have one."""
    lines = []
    for method in inspections[0].methods:
        scores = [i.metrics.get(f"{PREFIX}/{method}/region_score", np.nan) for i in inspections]
        known = np.array([score for score in scores if np.isfinite(score)])
        if len(known):
            spread = known.std(ddof=1) if len(known) > 1 else 0.0
            lines.append(f"{method}: region score {known.mean():.2f} +- {spread:.2f} over {len(known)} of "
                         f"{len(scores)} folds (1.0 = a map that ignores the face's pain regions)")
    return lines


def run_inspect(cfg: DictConfig, run: str | None = None, untrained: str | None = None) -> dict:
    """`make inspect MODEL=... [RUN=<parent run id>] [UNTRAINED=1]`."""
    from pipeline.analysis.regions import action_unit_masks

    regions, why = action_unit_masks(resolve_path(cfg.data.root) if cfg.data.root else None,
                                     resolve_path(cfg.data.processed_dir))
    try:
        return inspect_cv(cfg, run_id=run or None, untrained=str(untrained or "0") not in ("0", "", "false"),
                          regions=regions, no_regions_reason=why)
    except InspectionError as error:
        raise SystemExit(f"inspect: {error}") from None
