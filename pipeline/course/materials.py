"""What the ViT course notebooks (notebooks/vit_course_*.ipynb) share: the two faces they look at, patches, a patch
embedding made of principal components, 2-D sinusoidal positions and two drawing helpers. Nothing in the training
path uses this module.

Both faces are 224 px square crops made the way `make data` makes them with Haar (`data.face_detector=haar
data.align_faces=false`; the default now aligns MTCNN crops): OpenCV's Haar cascade finds the face
(`pipeline.data.faces`), and `square_crop` (`pipeline.data.crop_geometry`) cuts it with the same margin. Square crops
keep the course's pictures simple. One is a frame of the synthetic twin rendered by `pipeline.data.synthetic` (no video
is written), the other scikit-image's astronaut photograph.
"""

from __future__ import annotations

import math
from itertools import islice

import numpy as np
import torch
from matplotlib.patches import Rectangle

from pipeline.data.crop_geometry import square_crop
from pipeline.data.faces import build_detector
from pipeline.data.synthetic import PRESETS, make_samples, make_subjects, render_frames


def _crop_face(frame_bgr: np.ndarray, size: int, what: str) -> np.ndarray:
    box = build_detector("haar").detect(frame_bgr)
    if box is None:
        raise RuntimeError(f"the Haar cascade finds no face in {what}")
    return np.ascontiguousarray(square_crop(frame_bgr, box, margin=0.2, size=size)[..., ::-1])  # BGR -> RGB


def synthetic_face(size: int = 224, class_name: str = "PA4", time_s: float = 4.2) -> np.ndarray:
    """RGB uint8 (size, size, 3): one frame of the twin's most expressive responder in a `class_name` clip.

    The default preset and seed, as `make data` generates them; only the frames up to `time_s` are rendered.
    4.2 s lies in the window where the twin's pain response peaks (3.5-5 s).
    """
    config = PRESETS["default"]
    subjects = make_subjects(config)
    subject = max((s for s in subjects if s.responder), key=lambda s: s.expressiveness)
    sample = next(
        s for s in make_samples(config, subjects) if s.subject_id == subject.subject_id and class_name in s.sample_name
    )
    frame = next(islice(render_frames(config, subject, sample), round(time_s * config.fps), None))
    return _crop_face(frame, size, f"{sample.sample_name} at {time_s} s")


def astronaut_face(size: int = 224) -> np.ndarray:
    """RGB uint8 (size, size, 3): the face in scikit-image's astronaut photograph (Eileen Collins, NASA)."""
    from skimage import data  # a test dependency: only the notebooks need it

    return _crop_face(np.ascontiguousarray(data.astronaut()[..., ::-1]), size, "the astronaut photograph")


def to_tensor(image: np.ndarray, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """RGB uint8 (H, W, 3) -> (1, 3, H, W) scaled to [-1, 1], the original ViT's input normalisation."""
    return torch.from_numpy(image).to(dtype).permute(2, 0, 1)[None] / 127.5 - 1.0


def to_image(tensor: torch.Tensor) -> np.ndarray:
    """(1, 3, H, W) or (3, H, W) in [-1, 1] -> (H, W, 3) floats in [0, 1] for imshow."""
    image = tensor.detach().reshape(-1, *tensor.shape[-3:])[0].permute(1, 2, 0)
    return ((image.double() + 1.0) / 2.0).clamp(0.0, 1.0).numpy()


def patches_of(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(1, C, H, W) -> (N, C*P*P): whole patches in raster order, each flattened as a conv kernel is, (C, P, P)."""
    channels, height, width = image.shape[-3:]
    rows, columns = height // patch_size, width // patch_size
    cropped = image.reshape(channels, height, width)[:, : rows * patch_size, : columns * patch_size]
    grid = cropped.reshape(channels, rows, patch_size, columns, patch_size)
    return grid.permute(1, 3, 0, 2, 4).reshape(rows * columns, channels * patch_size * patch_size)


def principal_components(patches: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean patch, the top `count` principal components (orthonormal rows) and the share of variance of each."""
    mean = patches.mean(dim=0)
    _, singular_values, right = torch.linalg.svd(patches - mean, full_matrices=False)
    variance = singular_values**2
    return mean, right[:count], variance[:count] / variance.sum()


def set_pca_patch_embedding(proj: torch.nn.Conv2d, mean: torch.Tensor, components: torch.Tensor) -> None:
    """Make a patch-embedding convolution compute (patch - mean) . component for each of its D output channels."""
    with torch.no_grad():
        proj.weight.copy_(components.reshape(proj.weight.shape))
        proj.bias.copy_(-(components @ mean))


def sincos_positions_2d(grid: int, dim: int, wavelength_range: tuple[float, float] = (2.0, 10000.0)) -> torch.Tensor:
    """Fixed 2-D sinusoidal position embeddings (grid*grid, dim), raster order: half the features encode the row,
    half the column, each as sin/cos pairs at frequencies spaced geometrically between the two wavelengths
    (in patches). dim must be a multiple of 4."""
    if dim % 4:
        raise ValueError(f"dim must be a multiple of 4, got {dim}")
    pairs = dim // 4
    shortest, longest = wavelength_range
    wavelengths = shortest * (longest / shortest) ** (torch.arange(pairs, dtype=torch.float64) / max(1, pairs - 1))
    frequencies = 2 * math.pi / wavelengths
    rows, columns = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def encode(position: torch.Tensor) -> torch.Tensor:
        angles = position.reshape(-1, 1).double() * frequencies
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(rows), encode(columns)], dim=1)


def draw_patch_grid(ax, image: np.ndarray, patch_size: int, colour: str = "white") -> None:
    """The image with lines along the patch borders."""
    ax.imshow(image)
    for edge in range(0, image.shape[0] + 1, patch_size):
        ax.axhline(edge - 0.5, color=colour, linewidth=0.6)
    for edge in range(0, image.shape[1] + 1, patch_size):
        ax.axvline(edge - 0.5, color=colour, linewidth=0.6)
    ax.set_axis_off()


def draw_on_face(
    ax, image: np.ndarray, grid_map: np.ndarray | None, title: str = "", mark: int | None = None, grid: int = 0
) -> None:
    """A (g, g) map over the patch grid (an attention row, a similarity) drawn over the face; `mark` outlines one
    patch (raster index) of a `grid` x `grid` patch grid (default: the map's)."""
    side = image.shape[0]
    ax.imshow(image)
    if grid_map is not None:
        extent = (-0.5, side - 0.5, side - 0.5, -0.5)
        ax.imshow(grid_map, cmap="inferno", alpha=0.6, extent=extent, interpolation="nearest")
    if mark is not None:
        grid = grid or grid_map.shape[0]
        patch = side / grid
        row, column = divmod(mark, grid)
        corner = (column * patch - 0.5, row * patch - 0.5)
        ax.add_patch(Rectangle(corner, patch, patch, fill=False, edgecolor="cyan", linewidth=1.5))
    ax.set_title(title, fontsize=9)
    ax.set_axis_off()
