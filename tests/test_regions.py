"""The region score and the way action-unit regions are carried from video pixels into the model's view."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.analysis.regions import box_polygon, polygons_mask, region_mask, region_score, video_to_crop
from pipeline.models.backbone_adapter import DataConfig


def hand_made_regions(size: int = 32) -> np.ndarray:
    """Two 'brows' and a 'mouth' as boxes on a 32 x 32 view: 6 x 4 + 6 x 4 + 12 x 4 = 96 of 1024 pixels."""
    return polygons_mask([box_polygon(box) for box in [(6, 8, 12, 12), (20, 8, 26, 12), (10, 24, 22, 28)]],
                         size, size)


def test_a_uniform_map_scores_one() -> None:
    inside = hand_made_regions()
    assert inside.sum() == 96
    assert region_score(np.ones((32, 32)), inside) == pytest.approx(1.0)
    assert region_score(np.full((32, 32), 7.5), inside) == pytest.approx(1.0)  # the scale of a map does not matter


def test_a_map_on_the_regions_scores_above_one_and_one_beside_them_below() -> None:
    inside = hand_made_regions()
    on_regions = np.where(inside, 1.0, 0.05)
    beside = np.where(inside, 0.05, 1.0)
    assert region_score(on_regions, inside) > 5
    assert region_score(inside.astype(float), inside) == pytest.approx(1024 / 96)  # all mass inside: 1 / area share
    assert region_score(beside, inside) < 0.2


def test_undefined_scores_are_nan_and_bad_maps_are_refused() -> None:
    inside = hand_made_regions()
    assert math.isnan(region_score(np.zeros((32, 32)), inside))  # an empty map has no mass to share
    assert math.isnan(region_score(np.ones((32, 32)), np.zeros((32, 32), dtype=bool)))
    with pytest.raises(ValueError, match="non-negative"):
        region_score(-np.ones((32, 32)), inside)
    with pytest.raises(ValueError, match="shape"):
        region_score(np.ones((16, 16)), inside)


def test_a_pixel_belongs_to_a_box_when_its_centre_does() -> None:
    mask = polygons_mask([box_polygon((2, 3, 7, 5))], 10, 10)
    expected = np.zeros((10, 10), dtype=bool)
    expected[3:5, 2:7] = True
    np.testing.assert_array_equal(mask, expected)
    assert polygons_mask([box_polygon((-5, -5, 3, 3))], 10, 10).sum() == 9  # clipped to the image


def test_regions_reach_the_models_view_through_the_crop_and_the_centre_crop() -> None:
    # A face crop of 64 px cut from the 128 px square at (20, 40) of the video: crop = 0.5 * (video - (20, 40)).
    matrix = np.array([[0.5, 0.0, -10.0], [0.0, 0.5, -20.0]])
    np.testing.assert_allclose(video_to_crop(np.array([[20.0, 40.0], [148.0, 168.0]]), matrix), [[0, 0], [64, 64]])
    # A region covering crop pixels [16, 32) x [16, 32): video box (52, 72) - (84, 104).
    config = DataConfig(input_size=(3, 16, 16), mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear",
                        crop_pct=1.0)
    whole = region_mask([box_polygon((52, 72, 84, 104))], matrix, 64, config, crop_fraction=1.0)
    expected = np.zeros((16, 16), dtype=bool)
    expected[4:8, 4:8] = True  # 64 -> 16 px: a quarter
    np.testing.assert_array_equal(whole, expected)
    # crop_fraction 0.5 keeps crop pixels [16, 48), resized 32 -> 16: the region is then [0, 8) of the view
    centre = region_mask([box_polygon((52, 72, 84, 104))], matrix, 64, config, crop_fraction=0.5)
    expected = np.zeros((16, 16), dtype=bool)
    expected[0:8, 0:8] = True
    np.testing.assert_array_equal(centre, expected)


def test_the_twins_recorded_regions_land_on_the_drawn_face(tiny_base) -> None:
    """Through the frame table's crop matrices, the generator's boxes fall inside each face crop, brows above eyes
    above the nose and lip, and cover a face-sized part of the view (not nothing, not everything)."""
    import pandas as pd

    from pipeline.analysis.regions import TRANSFORM_COLUMNS, action_unit_masks

    masks, why = action_unit_masks(tiny_base / "raw", tiny_base / "processed")
    assert masks is not None, why
    frames = pd.read_csv(tiny_base / "processed" / "frames.csv")
    config = DataConfig(input_size=(3, 32, 32), mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear",
                        crop_pct=1.0)
    for _, frame in frames.iloc[:: max(1, len(frames) // 12)].iterrows():
        mask = masks(frame, config, 1.0)
        assert 0.03 < mask.mean() < 0.5
        rows, cols = np.nonzero(mask)
        assert 8 <= rows.mean() <= 24 and 8 <= cols.mean() <= 24  # around the middle of a face crop
        matrix = frame[list(TRANSFORM_COLUMNS)].to_numpy(dtype=float).reshape(2, 3)
        boxes = dict(zip(masks.region_names, masks.boxes(frame.subject_name, frame.sample_name,
                                                         int(frame.frame_index)), strict=True))
        centre = {name: video_to_crop(box_polygon(box), matrix).mean(axis=0) for name, box in boxes.items()}
        assert centre["brows"][1] < centre["eyes"][1] < centre["nose_lip"][1]
