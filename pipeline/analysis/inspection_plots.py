"""What `make inspect` draws and writes of one fold (`pipeline.analysis.inspection`): a grid of test videos (pain and
no pain, called right and wrong: a crop, then each method's map over it), the maps per video, the video scores, and
for ViT backbones the ViT paper's pictures: patch-embedding filters, position-embedding similarity, mean attention
distance per head. Pictures and maps are of faces; whether they may leave the disk is the caller's rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pipeline.analysis.attention import patch_embedding_components, position_embedding_similarity
from pipeline.analysis.fold_maps import FoldInspection
from pipeline.models.backbones import PainNet
from pipeline.models.introspection import vit_of
from pipeline.utils.atomic_io import atomic_write_csv, save_png

GRID_PER_CASE = 2  # videos per (pain / no pain) x (right / wrong) case in the grid image


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
