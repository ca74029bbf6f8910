"""Does a saliency map look at the face's pain regions? Region masks in the model's view, and the region score.

The region score of a map is the share of its mass inside the regions divided by the regions' share of the image's
area: 1.0 is what a map that ignores the face gets (a uniform map), above 1 the map concentrates on the regions,
below 1 it avoids them. Regions are boxes in video pixels (where the synthetic twin draws the PSPI action units);
each face crop is a square box of the video frame, and the model sees the crop's centre (`crop_fraction`) resized to
its input size, so a region maps into every crop through the same geometry as the evaluation transform.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.augment import DataConfigLike, build_eval_transform

if TYPE_CHECKING:
    import pandas as pd


def region_score(saliency: np.ndarray, inside: np.ndarray) -> float:
    """(mass of `saliency` inside `inside`) / (total mass), divided by the share of pixels inside.

    NaN where it has no meaning: a map without mass (all zero), or regions that cover nothing or everything.
    """
    saliency = np.asarray(saliency, dtype=np.float64)
    inside = np.asarray(inside, dtype=bool)
    if saliency.shape != inside.shape:
        raise ValueError(f"map {saliency.shape} and region mask {inside.shape} differ in shape")
    if (saliency < 0).any():
        raise ValueError("a saliency map must be non-negative")
    mass = saliency.sum()
    area_share = inside.mean()
    if not np.isfinite(mass) or mass <= 0 or area_share in (0.0, 1.0):
        return float("nan")
    return float(saliency[inside].sum() / mass / area_share)


def box_polygon(box: Sequence[float]) -> np.ndarray:
    """The four corners (x, y) of a box (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = (float(v) for v in box)
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]])


def video_to_crop(points: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Points (n, 2) in video pixels -> crop pixels, through the frame's 2 x 3 affine crop matrix (what
    preprocessing records per crop in the frame table's `crop_m00 .. crop_m12`)."""
    points = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    matrix = np.asarray(matrix, dtype=np.float64).reshape(2, 3)
    return points @ matrix[:, :2].T + matrix[:, 2]


def polygons_mask(polygons: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """Boolean (height, width) mask of the union of polygons, (k, 2) corners (x, y) in pixel coordinates: a pixel
    belongs to a polygon when its centre (x + 0.5, y + 0.5) lies inside."""
    from matplotlib.path import Path as Polygon

    ys, xs = np.mgrid[0:height, 0:width]
    centres = np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5], axis=1)
    mask = np.zeros(height * width, dtype=bool)
    for polygon in polygons:
        mask |= Polygon(np.asarray(polygon, dtype=np.float64).reshape(-1, 2)).contains_points(centres)
    return mask.reshape(height, width)


def model_view_mask(crop_mask: np.ndarray, data_config: DataConfigLike, crop_fraction: float = 1.0) -> np.ndarray:
    """A mask in face-crop pixels -> the mask over the model's input, through the evaluation transform's own geometry
    (central crop_fraction, resize to the input size; nearest neighbour for masks)."""
    transform = build_eval_transform(data_config, crop_fraction)
    height, width = crop_mask.shape
    placeholder = np.zeros((height, width, 3), dtype=np.uint8)
    mask = transform(image=placeholder, mask=crop_mask.astype(np.uint8))["mask"]
    return np.asarray(mask).astype(bool)


def region_mask(polygons_video: Sequence[np.ndarray], matrix: np.ndarray, crop_size: int,
                data_config: DataConfigLike, crop_fraction: float = 1.0) -> np.ndarray:
    """Regions of one frame (polygons in video pixels) -> boolean mask over the model's input for that frame's crop
    (`matrix`: the crop's video-to-crop affine map; `crop_size`: the stored crop's side in pixels)."""
    in_crop = [video_to_crop(polygon, matrix) for polygon in polygons_video]
    return model_view_mask(polygons_mask(in_crop, crop_size, crop_size), data_config, crop_fraction)


TRANSFORM_COLUMNS = ("crop_m00", "crop_m01", "crop_m02", "crop_m10", "crop_m11", "crop_m12")  # frame table


class ActionUnitMasks:
    """Region masks for the crops of a dataset that records its action-unit regions (the synthetic twin): per video,
    `<raw root>/synthetic_regions/<subject>/<sample>.csv` holds each frame's boxes (`<region>_x0 .. _y1`, video
    pixels) and the frame table holds each crop's video-to-crop matrix (`crop_m00 .. crop_m12`).

    Called with a frame-table row, the model's data config and crop fraction, it gives the union of the regions
    over the model's input for that crop (None for a frame the record lacks).
    """

    def __init__(self, regions_dir: Path, region_names: Sequence[str], crop_size: int) -> None:
        self.regions_dir = Path(regions_dir)
        self.region_names = tuple(region_names)
        self.crop_size = int(crop_size)
        self._tables: dict[tuple[str, str], pd.DataFrame | None] = {}

    def boxes(self, subject_name: str, sample_name: str, frame_index: int) -> list[tuple[float, ...]] | None:
        import pandas as pd

        key = (subject_name, sample_name)
        if key not in self._tables:
            path = self.regions_dir / subject_name / f"{sample_name}.csv"
            self._tables[key] = pd.read_csv(path).set_index("frame_index") if path.is_file() else None
        table = self._tables[key]
        if table is None or frame_index not in table.index:
            return None
        row = table.loc[frame_index]
        return [tuple(float(row[f"{name}_{edge}"]) for edge in ("x0", "y0", "x1", "y1")) for name in self.region_names]

    def __call__(self, frame, data_config: DataConfigLike, crop_fraction: float = 1.0) -> np.ndarray | None:
        boxes = self.boxes(str(frame["subject_name"]), str(frame["sample_name"]), int(frame["frame_index"]))
        matrix = np.array([float(frame[column]) for column in TRANSFORM_COLUMNS]).reshape(2, 3)
        if boxes is None or not np.isfinite(matrix).all():
            return None
        return region_mask([box_polygon(box) for box in boxes], matrix, self.crop_size, data_config, crop_fraction)


def action_unit_masks(raw_root: Path | None, processed_dir: Path) -> tuple[ActionUnitMasks | None, str]:
    """The dataset's action-unit region masks, or None and why not (BioVid records no regions; crops made before
    preprocessing recorded their transforms cannot be placed)."""
    import json

    import pandas as pd

    from pipeline.data.synthetic import REGIONS, REGIONS_DIR

    if raw_root is None or not (Path(raw_root) / REGIONS_DIR).is_dir():
        return None, "this dataset records no action-unit regions"
    frames_csv = Path(processed_dir) / "frames.csv"
    if not frames_csv.is_file():
        return None, f"{frames_csv} does not exist"
    columns = set(pd.read_csv(frames_csv, nrows=0).columns)
    if not set(TRANSFORM_COLUMNS) <= columns:
        return None, (f"the crops in {processed_dir} were made before preprocessing recorded each crop's transform; "
                      f"crop again into another data.processed_dir to place the regions")
    crop_size = json.loads((Path(processed_dir) / "preprocess.json").read_text())["crop_size"]
    return ActionUnitMasks(Path(raw_root) / REGIONS_DIR, REGIONS, crop_size), "the twin's recorded regions"
