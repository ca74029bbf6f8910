"""Albumentations pipelines: heavy training augmentation of face crops, deterministic evaluation resize.

Every parameter comes from the `augment` config (one plain mapping per transform, passed to albumentations as
keyword arguments) or from the backbone's data config (input size, mean, std, interpolation): nothing about the
pretrained model is hard-coded here. Every Compose is built with `strict=True`, so a misspelled argument is an error
instead of albumentations 2.x's silent warning.

The central crop and the resize to the input size follow rules of this module (`central_box`, `resize_interpolation`),
and `eval_transform_steps` states the evaluation transform by the same rules, step by step with its OpenCV calls, for
a runtime without albumentations (the ONNX export's contract).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.augmentations.crops.transforms import BaseCrop
from albumentations.core.transforms_interface import BaseTransformInitSchema
from albumentations.pytorch import ToTensorV2

from pipeline.utils.atomic_io import atomic_write_bytes


class DataConfigLike(Protocol):
    """What this module reads from `pipeline.models.backbone_adapter.DataConfig` (a backbone's own preprocessing)."""

    input_size: tuple[int, int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str


# timm's interpolation names -> OpenCV flags.
INTERPOLATIONS: dict[str, int] = {
    "nearest": cv2.INTER_NEAREST,
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "lanczos": cv2.INTER_LANCZOS4,
    "area": cv2.INTER_AREA,
}

# Config key -> albumentations transform, in the order they are applied. "blur" is a OneOf over BLUR_MEMBERS.
TRAIN_TRANSFORMS: dict[str, Callable[..., A.BasicTransform] | None] = {
    "random_resized_crop": A.RandomResizedCrop,
    "horizontal_flip": A.HorizontalFlip,
    "affine": A.Affine,
    "color_jitter": A.ColorJitter,
    "blur": None,
    "gaussian_noise": A.GaussNoise,
    "jpeg_compression": A.ImageCompression,
    "coarse_dropout": A.CoarseDropout,
}
BLUR_MEMBERS: dict[str, Callable[..., A.BasicTransform]] = {
    "gaussian_blur": A.GaussianBlur,
    "motion_blur": A.MotionBlur,
}


def input_hw(data_config: DataConfigLike) -> tuple[int, int]:
    """(height, width) from the data config's (channels, height, width)."""
    size = tuple(int(v) for v in data_config.input_size)
    if len(size) != 3 or size[0] != 3 or min(size) <= 0:
        raise ValueError(f"data_config.input_size must be (3, height, width), got {data_config.input_size!r}")
    return size[1], size[2]


def interpolation_flag(data_config: DataConfigLike) -> int:
    name = str(data_config.interpolation).lower()
    if name not in INTERPOLATIONS:
        raise ValueError(f"unknown interpolation {data_config.interpolation!r}; known: {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


def _plain(value: Any) -> Any:
    """OmegaConf containers and YAML lists -> dicts and tuples, the types albumentations' validators expect."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(_plain(item) for item in value)
    return value


def _enabled_entry(name: str, entry: Any) -> dict[str, Any] | None:
    """The keyword arguments of one transform entry, or None when the entry switches the transform off."""
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise ValueError(f"augment.{name} must be a mapping of arguments or null, got {entry!r}")
    if "p" not in entry:
        # albumentations' default probabilities differ per transform (0.5 for most): make the config say it.
        raise ValueError(f"augment.{name} needs an explicit probability p (0 switches it off)")
    kwargs = _plain(entry)
    return kwargs if float(kwargs["p"]) > 0 else None


def _configured(name: str, transform: Callable[..., A.BasicTransform], kwargs: dict[str, Any]) -> A.BasicTransform:
    """Build one step; strict here too, so a bad argument fails at once with the config entry named."""
    try:
        return transform(**kwargs, strict=True)
    except (TypeError, ValueError) as error:
        raise ValueError(f"augment.{name}: {error}") from error


def _blur(entry: Mapping[str, Any]) -> A.OneOf:
    """One of Gaussian or motion blur; the members' p are their relative weights."""
    unknown = set(entry) - set(BLUR_MEMBERS) - {"p"}
    if unknown:
        raise ValueError(f"unknown key(s) in augment.blur: {sorted(unknown)}; known: p, {', '.join(BLUR_MEMBERS)}")
    members = []
    for name, transform in BLUR_MEMBERS.items():
        kwargs = _enabled_entry(f"blur.{name}", entry.get(name))
        if kwargs is not None:
            members.append(_configured(f"blur.{name}", transform, kwargs))
    if not members:
        raise ValueError("augment.blur is on (p > 0) but has no enabled member (gaussian_blur / motion_blur)")
    return A.OneOf(members, p=float(entry["p"]))


def resize_interpolation(source_hw: tuple[int, int], target_hw: tuple[int, int], interpolation: int) -> int:
    """The OpenCV flag the resize to the input size uses for an image of `source_hw`: INTER_AREA (OpenCV's pixel-area
    average, the only antialiasing step) when it shrinks either side, else `interpolation` (the backbone's). A plain
    cubic resize of a large crop would alias where timm's PIL pipeline antialiases."""
    shrinks = target_hw[0] < source_hw[0] or target_hw[1] < source_hw[1]
    return cv2.INTER_AREA if shrinks else interpolation


class InputResize(A.Resize):
    """`A.Resize` to the input size whose image interpolation is `resize_interpolation`'s (masks: nearest): what
    `A.Resize(..., area_for_downscale="image")` did, with the rule here."""

    def apply(self, img: np.ndarray, **params: Any) -> np.ndarray:
        target_hw = (self.height, self.width)
        if img.shape[:2] == target_hw:
            return img
        flag = resize_interpolation(img.shape[:2], target_hw, self.interpolation)
        return cv2.resize(img, (self.width, self.height), interpolation=flag)


def _resize(data_config: DataConfigLike) -> A.Resize:
    height, width = input_hw(data_config)
    return InputResize(height=height, width=width, interpolation=interpolation_flag(data_config))


def _normalize_to_tensor(data_config: DataConfigLike) -> list[A.BasicTransform]:
    mean, std = tuple(float(v) for v in data_config.mean), tuple(float(v) for v in data_config.std)
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise ValueError(f"data_config mean/std must be 3 values each (std > 0), got {mean} / {std}")
    return [A.Normalize(mean=mean, std=std, max_pixel_value=255.0), ToTensorV2()]


def central_box(height: int, width: int, crop_fraction: float) -> tuple[int, int, int, int]:
    """The integer pixel box (x0, y0, x1, y1; x1 and y1 exclusive) of the central `crop_fraction` of each side: each
    side loses `int((1 - crop_fraction) / 2 * side)` pixels at each end, in float64 in that order (the rule
    albumentations' `CropAndPad(percent=-(1 - crop_fraction) / 2)` applied before, kept so that trained models see
    what they saw)."""
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
    cut_y, cut_x = int((1 - crop_fraction) / 2 * height), int((1 - crop_fraction) / 2 * width)
    return cut_x, cut_y, width - cut_x, height - cut_y


class CentralCrop(BaseCrop):
    """Keep `central_box` of each image (and mask)."""

    class InitSchema(BaseTransformInitSchema):
        crop_fraction: float

    def __init__(self, crop_fraction: float, p: float = 1.0) -> None:
        super().__init__(p=p)
        self.crop_fraction = crop_fraction

    def get_params_dependent_on_data(self, params: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        height, width = params["shape"][:2]
        return {"crop_coords": central_box(height, width, self.crop_fraction)}

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("crop_fraction",)


def _centre(crop_fraction: float) -> list[A.BasicTransform]:
    """Keep the central `crop_fraction` of each side of the face crop: a tighter view of the face, chosen at training
    time without re-running the face-crop preprocessing."""
    central_box(1, 1, crop_fraction)  # the range check
    return [] if crop_fraction == 1 else [CentralCrop(crop_fraction, p=1.0)]


def build_train_transform(data_config: DataConfigLike, params: Mapping[str, Any] | None,
                          crop_fraction: float = 1.0) -> A.Compose:
    """Training augmentation in a fixed order, each step configured (or switched off) by its entry in `params`.

    Without a random resized crop the image is resized to the input size, so every output has the model's shape.
    """
    params = params or {}
    unknown = set(params) - set(TRAIN_TRANSFORMS)
    if unknown:
        raise ValueError(f"unknown augment key(s) {sorted(unknown)}; known: {', '.join(TRAIN_TRANSFORMS)}")
    steps: list[A.BasicTransform | A.BaseCompose] = []
    for name, transform in TRAIN_TRANSFORMS.items():
        kwargs = _enabled_entry(name, params.get(name))
        if name == "random_resized_crop":
            steps.append(_resize(data_config) if kwargs is None else _random_resized_crop(data_config, kwargs))
        elif kwargs is None:
            continue
        elif name == "blur":
            steps.append(_blur(params[name]))
        else:
            steps.append(_configured(name, transform, kwargs))
    return A.Compose([*_centre(crop_fraction), *steps, *_normalize_to_tensor(data_config)], strict=True)


def _random_resized_crop(data_config: DataConfigLike, kwargs: dict[str, Any]) -> A.RandomResizedCrop:
    if "size" in kwargs:
        raise ValueError("augment.random_resized_crop must not set size: it is the backbone's input size")
    if float(kwargs["p"]) != 1.0:
        # A crop that is sometimes skipped would leave the image at its stored size and break batching.
        raise ValueError(
            "augment.random_resized_crop.p must be 1 (or the entry null); narrow scale/ratio for milder crops"
        )
    kwargs = {"interpolation": interpolation_flag(data_config), **kwargs}
    return _configured("random_resized_crop", A.RandomResizedCrop, {"size": input_hw(data_config), **kwargs})


def build_eval_transform(data_config: DataConfigLike, crop_fraction: float = 1.0) -> A.Compose:
    """Deterministic: resize the face crop (its central `crop_fraction`, all of it by default) to the input size."""
    return A.Compose([*_centre(crop_fraction), _resize(data_config), *_normalize_to_tensor(data_config)], strict=True)


OPENCV_FLAGS = ("INTER_NEAREST", "INTER_LINEAR", "INTER_CUBIC", "INTER_AREA", "INTER_LANCZOS4", "BORDER_CONSTANT",
                "BORDER_REPLICATE", "BORDER_REFLECT", "BORDER_REFLECT_101")


def opencv_name(flag: int, family: str) -> str:
    """The name `cv2` gives an interpolation (`family` "INTER") or border ("BORDER") flag, e.g. "INTER_AREA"."""
    for name in OPENCV_FLAGS:
        if name.startswith(f"{family}_") and getattr(cv2, name) == flag:
            return name
    raise ValueError(f"no OpenCV {family}_* name known for flag {flag}")


def eval_transform_steps(data_config: DataConfigLike, crop_fraction: float,
                         source_hw: tuple[int, int]) -> list[dict[str, Any]]:
    """`build_eval_transform`'s steps for an HWC uint8 RGB image of `source_hw` pixels, in order and as plain values
    (each with the call that does it in OpenCV and NumPy): what an implementation without albumentations needs to give
    the network the same input. Computed by the rules the transform itself applies (`central_box`,
    `resize_interpolation`), so the description cannot drift from the transform."""
    steps: list[dict[str, Any]] = []
    height, width = source_hw
    if crop_fraction != 1:
        x0, y0, x1, y1 = central_box(height, width, crop_fraction)
        steps.append({"step": "central_crop", "fraction": crop_fraction, "from_hw": [height, width],
                      "box_xyxy": [x0, y0, x1, y1], "call": f"image[{y0}:{y1}, {x0}:{x1}]",
                      "rule": "each side loses int((1 - fraction) / 2 * side) pixels at each end (float64, in that "
                              "order); box_xyxy ends are exclusive"})
        height, width = y1 - y0, x1 - x0
    target_hw = input_hw(data_config)
    if (height, width) != target_hw:
        backbone = interpolation_flag(data_config)
        flag = resize_interpolation((height, width), target_hw, backbone)
        steps.append({"step": "resize", "from_hw": [height, width], "to_hw": list(target_hw),
                      "interpolation": opencv_name(flag, "INTER"), "library": f"OpenCV {cv2.__version__} cv2.resize",
                      "call": f"cv2.resize(image, ({target_hw[1]}, {target_hw[0]}), "
                              f"interpolation=cv2.{opencv_name(flag, 'INTER')})",
                      "rule": f"INTER_AREA (OpenCV's pixel-area average, the only antialiasing) when the resize "
                              f"shrinks either side, else the backbone's {opencv_name(backbone, 'INTER')} "
                              f"(timm's {data_config.interpolation!r}); no PIL, no other filter"})
    mean = [float(v) for v in data_config.mean]
    std = [float(v) for v in data_config.std]
    steps.append({"step": "normalize", "mean": mean, "std": std, "dtype": "float32",
                  "call": "(image.astype(np.float32) - 255 * mean) / (255 * std), per channel in RGB order: the "
                          "[0, 1] scale (pixel / 255) minus mean, over std"})
    steps.append({"step": "layout", "call": "image.transpose(2, 0, 1): HWC -> CHW; a batch stacks crops on a new "
                                            "first axis (N, 3, H, W), float32, C-contiguous"})
    return steps


def seed_transform(transform: A.BaseCompose, seed: int) -> None:
    """Give every step one shared seeded random stream.

    `Compose(seed=...)` seeds every step with the same number, so e.g. two steps with equal p fire together;
    sharing one generator keeps them independent and the whole pipeline reproducible.
    """
    transform.set_random_state(np.random.default_rng(seed), random.Random(seed))


def denormalize(tensor: torch.Tensor | np.ndarray, data_config: DataConfigLike) -> np.ndarray:
    """Undo Normalize + ToTensorV2: a CHW float image -> HWC uint8 RGB, for previews."""
    image = tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a (3, height, width) image, got shape {image.shape}")
    mean = np.asarray(data_config.mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(data_config.std, dtype=np.float32).reshape(3, 1, 1)
    pixels = (image.astype(np.float32) * std + mean) * 255.0
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8).transpose(1, 2, 0)


def read_rgb(path: str | Path) -> np.ndarray:
    """Read an image file as HWC uint8 RGB, with an error naming the file."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        reason = "missing" if not Path(path).exists() else "unreadable"
        raise FileNotFoundError(f"cannot read image {path} ({reason})")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def save_augmentation_preview(
    image_paths: Sequence[Path],
    transform: A.BaseCompose,
    data_config: DataConfigLike,
    path: Path,
    n: int = 16,
    seed: int = 0,
) -> Path:
    """PNG grid of what the model sees: one row per image (up to n), the original crop then its augmented views.

    `n` augmented views in all, spread evenly over the rows. The transform is copied before seeding, so the
    caller's random stream is left alone.
    """
    if not image_paths or n < 1:
        raise ValueError("a preview needs at least one image and n >= 1")
    rows = list(image_paths)[:n]
    views_per_row = max(1, n // len(rows))
    height, width = input_hw(data_config)
    preview_transform = copy.deepcopy(transform)
    seed_transform(preview_transform, seed)
    gap = 4
    grid = np.full((len(rows) * (height + gap) - gap, (views_per_row + 1) * (width + gap) - gap, 3), 255, np.uint8)
    for row, image_path in enumerate(rows):
        image = read_rgb(image_path)
        original = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
        tiles = [original] + [
            denormalize(preview_transform(image=image)["image"], data_config) for _ in range(views_per_row)
        ]
        top = row * (height + gap)
        for column, tile in enumerate(tiles):
            if tile.shape[:2] != (height, width):
                raise ValueError(f"transform output {tile.shape[:2]} differs from the input size {(height, width)}")
            left = column * (width + gap)
            grid[top : top + height, left : left + width] = tile
    ok, encoded = cv2.imencode(".png", cv2.cvtColor(grid, cv2.COLOR_RGB2BGR))
    if not ok:
        raise RuntimeError(f"PNG encoding failed for preview {path}")
    atomic_write_bytes(path, encoded.tobytes())
    return Path(path)
