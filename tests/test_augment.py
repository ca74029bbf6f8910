"""Augmentation pipelines: shapes, the backbone's normalisation, strict argument checking, previews."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.data.augment import (
    build_eval_transform,
    build_train_transform,
    denormalize,
    save_augmentation_preview,
    seed_transform,
)

AUGMENT_DIR = Path(__file__).resolve().parents[1] / "configs" / "augment"


@dataclass(frozen=True)
class FakeDataConfig:
    """Duck-types pipeline.models.backbones.DataConfig; mean/std deliberately not ImageNet's."""

    input_size: tuple[int, int, int] = (3, 64, 64)
    mean: tuple[float, float, float] = (0.40, 0.45, 0.50)
    std: tuple[float, float, float] = (0.20, 0.25, 0.30)
    interpolation: str = "bilinear"
    crop_pct: float = 0.9


DATA_CONFIG = FakeDataConfig()


def augment_params(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(AUGMENT_DIR / f"{name}.yaml"))


def random_image(seed: int = 0, height: int = 90, width: int = 80) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", ["heavy", "light", "none"])
def test_train_transform_gives_model_input_shape(name: str) -> None:
    # The configs are read as Hydra would hand them over (OmegaConf containers), not as plain dicts.
    transform = build_train_transform(DATA_CONFIG, OmegaConf.load(AUGMENT_DIR / f"{name}.yaml"))
    seed_transform(transform, 0)
    for seed in range(5):
        image = transform(image=random_image(seed))["image"]
        assert isinstance(image, torch.Tensor)
        assert image.shape == (3, 64, 64)
        assert image.dtype == torch.float32
        assert torch.isfinite(image).all()


def test_non_square_input_size_is_height_then_width() -> None:
    config = replace(DATA_CONFIG, input_size=(3, 48, 72))
    for transform in (build_train_transform(config, augment_params("heavy")), build_eval_transform(config)):
        assert transform(image=random_image())["image"].shape == (3, 48, 72)


def test_normalize_uses_the_data_config_mean_and_std() -> None:
    pixel = np.array([200, 100, 50], dtype=np.uint8)
    image = np.broadcast_to(pixel, (30, 40, 3)).copy()
    out = build_eval_transform(DATA_CONFIG)(image=image)["image"]
    expected = (pixel / 255.0 - np.array(DATA_CONFIG.mean)) / np.array(DATA_CONFIG.std)
    for channel in range(3):
        np.testing.assert_allclose(out[channel].numpy(), expected[channel], atol=1e-5)


def test_denormalize_inverts_the_eval_transform() -> None:
    image = random_image(height=64, width=64)  # already the input size: the resize leaves it alone
    restored = denormalize(build_eval_transform(DATA_CONFIG)(image=image)["image"], DATA_CONFIG)
    assert restored.dtype == np.uint8 and restored.shape == (64, 64, 3)
    assert np.abs(restored.astype(int) - image.astype(int)).max() <= 1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"affine": {"rotat": [-10, 10], "p": 0.5}}, "augment.affine: .*rotat"),
        ({"blur": {"p": 0.5, "motion_blur": {"blur_limt": [3, 5], "p": 1.0}}}, "blur_limt"),
        ({"colour_jitter": {"brightness": 0.2, "p": 0.5}}, "colour_jitter"),
        ({"blur": {"p": 0.5, "median_blur": {"p": 1.0}}}, "median_blur"),
        ({"affine": {"rotate": [-10, 10]}}, "explicit probability"),
        ({"random_resized_crop": {"scale": [0.8, 1.0], "p": 0.5}}, "must be 1"),
        ({"random_resized_crop": {"size": [32, 32], "p": 1.0}}, "input size"),
        ({"blur": {"p": 0.5, "gaussian_blur": None}}, "no enabled member"),
    ],
)
def test_misspelled_or_ambiguous_parameters_are_errors(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_train_transform(DATA_CONFIG, params)


def test_every_config_file_builds_under_strict_checking() -> None:
    # A renamed argument in a YAML file would make this fail instead of silently being ignored.
    # Files that only pick another one (defaults: [heavy]) are composed by Hydra, as every command does.
    from pipeline.utils.config import load_config

    for path in sorted(AUGMENT_DIR.glob("*.yaml")):
        build_train_transform(DATA_CONFIG, load_config([f"augment={path.stem}"]).augment)


def test_null_or_zero_probability_switches_a_transform_off() -> None:
    params = augment_params("heavy")
    params["coarse_dropout"] = None
    params["gaussian_noise"]["p"] = 0
    names = [type(step).__name__ for step in build_train_transform(DATA_CONFIG, params).transforms]
    assert "CoarseDropout" not in names and "GaussNoise" not in names
    assert names[0] == "RandomResizedCrop" and "Affine" in names and "OneOf" in names
    assert names[-2:] == ["Normalize", "ToTensorV2"]


def test_none_config_is_deterministic_and_equals_eval() -> None:
    train, evaluation = build_train_transform(DATA_CONFIG, augment_params("none")), build_eval_transform(DATA_CONFIG)
    image = random_image(3)
    first, second = train(image=image)["image"], train(image=image)["image"]
    assert torch.equal(first, second)
    assert torch.equal(first, evaluation(image=image)["image"])


def test_heavy_config_changes_the_image_and_seeding_reproduces_it() -> None:
    transform = build_train_transform(DATA_CONFIG, augment_params("heavy"))
    image = random_image(4)
    twin = copy.deepcopy(transform)
    seed_transform(transform, 7)
    seed_transform(twin, 7)
    views = [transform(image=image)["image"] for _ in range(4)]
    assert all(torch.equal(view, twin(image=image)["image"]) for view in views)
    assert not torch.equal(views[0], views[1])


def test_seeded_steps_fire_independently() -> None:
    # Compose(seed=...) gives every step the same stream: two p=0.5 flips would then always fire together.
    transform = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)], save_applied_params=True)
    seed_transform(transform, 0)
    image = random_image(5)
    fired = Counter(tuple(name for name, _ in transform(image=image)["applied_transforms"]) for _ in range(200))
    exactly_one = fired[("HorizontalFlip",)] + fired[("VerticalFlip",)]
    assert 60 < exactly_one < 140  # independent steps: about half the draws flip exactly once


def write_crops(folder: Path, count: int) -> list[Path]:
    paths = []
    for index in range(count):
        path = folder / f"crop{index}.jpg"
        assert cv2.imwrite(str(path), cv2.cvtColor(random_image(index, 70, 60), cv2.COLOR_RGB2BGR))
        paths.append(path)
    return paths


def test_preview_png_shows_original_then_augmented_views(tmp_path: Path) -> None:
    paths = write_crops(tmp_path, 3)
    transform = build_train_transform(DATA_CONFIG, augment_params("heavy"))
    out = save_augmentation_preview(paths, transform, DATA_CONFIG, tmp_path / "preview" / "augment.png", n=6)
    grid = cv2.imread(str(out), cv2.IMREAD_COLOR)
    assert grid is not None
    gap, size = 4, 64
    assert grid.shape == (3 * (size + gap) - gap, 3 * (size + gap) - gap, 3)  # 3 rows of original + 2 views
    original = cv2.resize(cv2.imread(str(paths[1])), (size, size), interpolation=cv2.INTER_AREA)
    top = size + gap
    assert np.array_equal(grid[top : top + size, :size], original)  # PNG is lossless
    assert not np.array_equal(grid[top : top + size, size + gap : 2 * size + gap], original)
    assert [p.name for p in out.parent.iterdir()] == ["augment.png"]  # no temporary file left behind


def test_preview_names_a_missing_image(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jpg"
    with pytest.raises(FileNotFoundError, match="nope.jpg"):
        save_augmentation_preview([missing], build_eval_transform(DATA_CONFIG), DATA_CONFIG, tmp_path / "p.png")
