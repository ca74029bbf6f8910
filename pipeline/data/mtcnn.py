"""MTCNN face detection with five landmarks, in PyTorch, batched over frames and on the GPU when there is one.

MTCNN (Zhang et al., 2016) is three small cascaded networks: PNet proposes face windows over an image pyramid, RNet
refines them on 24 x 24 crops, ONet refines again on 48 x 48 crops and places five landmarks (eye centres, nose tip,
mouth corners). It holds on real faces rotated by +-20 degrees and more, is a few MB, and runs fast on a CPU.

The weights are the original MTCNN weights as the `mtcnn` package (MIT) ships them inside its wheel
(`mtcnn/assets/weights/{pnet,rnet,onet}.lz4`: lists of numpy arrays in Keras layout). Only those files are read:
the package's own code needs TensorFlow, which this project does not install, and nothing is downloaded at run time.
The networks below are written here and take the arrays transposed to PyTorch's layout.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torchvision.ops import batched_nms, roi_align

WEIGHTS_PACKAGE = "mtcnn"
# SHA-256 of the weight files of mtcnn 1.0.0: a changed file is refused rather than silently giving other detections.
WEIGHTS_SHA256 = {
    "pnet": "ea6b0c3e685ebee3165326ad6484acc95f2ef78f1c94fbf40a55704fa989f7b5",
    "rnet": "cb00e6460f3c98b0bfafaba3c0a0ded4bdf6e62cee7174d969e8670d7e757fee",
    "onet": "94f6ea2f4cf985275ee958cdd762d17b6009348a4fb9d8c6be39ba73ffd22ca3",
}


def weights_dir() -> Path:
    """The folder of the MTCNN weight files inside the installed `mtcnn` package (its code is not imported)."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the MTCNN face detector reads its weights from the 'mtcnn' package, which is not installed: "
            "`.venv/bin/pip install 'mtcnn>=1.0'` (it is a dependency in pyproject.toml; it does not need TensorFlow "
            "for this), or use Haar: data.face_detector=haar data.align_faces=false"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "assets" / "weights"


def load_weight_arrays(name: str) -> list[np.ndarray]:
    """The arrays of one network's weight file, after checking the file's SHA-256."""
    import joblib

    path = weights_dir() / f"{name}.lz4"
    if not path.is_file():
        raise FileNotFoundError(f"MTCNN weight file {path} is missing (reinstall the 'mtcnn' package)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    expected = WEIGHTS_SHA256[name]
    if digest != expected:
        raise ValueError(f"{path} has SHA-256 {digest}, expected {expected} (mtcnn 1.0.0's); refusing other weights")
    return list(joblib.load(path))


class _Net(nn.Module):
    """Loads Keras-layout arrays in the order the layers were declared (conv: HWIO, dense: in x out)."""

    def load_keras_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        arrays = list(arrays)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                module.weight.data = torch.from_numpy(arrays.pop(0).transpose(3, 2, 0, 1).copy()).float()
                module.bias.data = torch.from_numpy(arrays.pop(0).copy()).float()
            elif isinstance(module, nn.Linear):
                module.weight.data = torch.from_numpy(arrays.pop(0).T.copy()).float()
                module.bias.data = torch.from_numpy(arrays.pop(0).copy()).float()
            elif isinstance(module, nn.PReLU):
                module.weight.data = torch.from_numpy(arrays.pop(0).reshape(-1).copy()).float()
        if arrays:
            raise ValueError(f"{type(self).__name__}: {len(arrays)} weight array(s) left over")


def _flatten_keras(x: torch.Tensor) -> torch.Tensor:
    """Flatten as the Keras model does after its Permute((2, 1, 3)): width, height, channel order."""
    return x.permute(0, 3, 2, 1).reshape(x.shape[0], -1)


class PNet(_Net):
    """Proposal network: fully convolutional, a face probability and a box offset per 12 x 12 window (stride 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 10, 3), nn.PReLU(10), nn.MaxPool2d(2, 2, ceil_mode=True),
            nn.Conv2d(10, 16, 3), nn.PReLU(16),
            nn.Conv2d(16, 32, 3), nn.PReLU(32),
        )
        self.box = nn.Conv2d(32, 4, 1)
        self.face = nn.Conv2d(32, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.body(x)
        return self.box(x), F.softmax(self.face(x), dim=1)[:, 1]


class RNet(_Net):
    """Refinement network on 24 x 24 crops."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 28, 3), nn.PReLU(28), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(28, 48, 3), nn.PReLU(48), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(48, 64, 2), nn.PReLU(64),
        )
        self.dense = nn.Sequential(nn.Linear(576, 128), nn.PReLU(128))
        self.box = nn.Linear(128, 4)
        self.face = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.dense(_flatten_keras(self.body(x)))
        return self.box(x), F.softmax(self.face(x), dim=1)[:, 1]


class ONet(_Net):
    """Output network on 48 x 48 crops: box offsets, five landmarks (x1..x5, y1..y5 in box units), face probability."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3), nn.PReLU(32), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 3), nn.PReLU(64), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(64, 64, 3), nn.PReLU(64), nn.MaxPool2d(2, 2, ceil_mode=True),
            nn.Conv2d(64, 128, 2), nn.PReLU(128),
        )
        self.dense = nn.Sequential(nn.Linear(1152, 256), nn.PReLU(256))
        self.box = nn.Linear(256, 4)
        self.landmarks = nn.Linear(256, 10)
        self.face = nn.Linear(256, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.dense(_flatten_keras(self.body(x)))
        return self.box(x), self.landmarks(x), F.softmax(self.face(x), dim=1)[:, 1]


def load_networks(device: torch.device) -> tuple[PNet, RNet, ONet]:
    networks = []
    for name, network in (("pnet", PNet()), ("rnet", RNet()), ("onet", ONet())):
        network.load_keras_arrays(load_weight_arrays(name))
        networks.append(network.eval().to(device))
    return tuple(networks)  # type: ignore[return-value]


def halve_to(image: np.ndarray, max_side: int) -> np.ndarray:
    """The image halved (2 x 2 pixel means: fast, and without aliasing) until its longer side is at most `max_side`."""
    while max(image.shape[:2]) > max_side:
        image = cv2.resize(image, (image.shape[1] // 2, image.shape[0] // 2), interpolation=cv2.INTER_AREA)
    return image


def pyramid_scales(height: int, width: int, min_face: float, factor: float = 0.709) -> list[float]:
    """Scales at which PNet's 12 px window sees faces from `min_face` px up to the whole image."""
    scale = 12.0 / min_face
    scales = []
    while min(height, width) * scale >= 12:
        scales.append(scale)
        scale *= factor
    return scales


def _square(boxes: torch.Tensor) -> torch.Tensor:
    """Boxes (x1, y1, x2, y2) grown to squares about their centres."""
    side = torch.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    centre_x, centre_y = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    return torch.stack([centre_x - side / 2, centre_y - side / 2, centre_x + side / 2, centre_y + side / 2], 1)


def _regress(boxes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Apply MTCNN's box offsets (fractions of the box's width / height)."""
    size = torch.stack([boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]] * 2, 1)
    return boxes + offsets * size


class MTCNN:
    """The three networks and the cascade between them, for a batch of same-sized frames.

    Frames are first halved until their longer side is at most `max_side` (the networks need far fewer pixels than
    a 1388 x 1038 frame has, which becomes 694 x 519; boxes and landmarks are scaled back). The pyramid starts at
    faces of `min_face_fraction` of the frame's shorter side.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
        min_face_fraction: float = 0.1,
        max_side: int = 720,
        scale_factor: float = 0.709,
    ) -> None:
        if not 0.0 < min_face_fraction < 1.0:
            raise ValueError(f"min_face_fraction must be in (0, 1), got {min_face_fraction}")
        if max_side < 48:
            raise ValueError(f"max_side must be at least ONet's 48 px input, got {max_side}")
        if not 0.0 < scale_factor < 1.0:
            raise ValueError(f"scale_factor must be in (0, 1), got {scale_factor}")
        self.device = torch.device(device)
        self.thresholds = thresholds
        self.min_face_fraction = min_face_fraction
        self.max_side = max_side
        self.scale_factor = scale_factor
        self.pnet, self.rnet, self.onet = load_networks(self.device)

    @torch.inference_mode()
    def detect(self, frames_bgr: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per frame, an array (n_faces, 15): x1, y1, x2, y2, score, then the landmarks x1..x5, y1..y5 (frame pixels).

        Landmark order: eye on the image's left, eye on the image's right, nose tip, mouth corner left, mouth right.
        """
        if not len(frames_bgr):
            return []
        shapes = {frame.shape for frame in frames_bgr}
        if len(shapes) != 1:
            raise ValueError(f"a batch needs frames of one size, got {sorted(shapes)}")
        height, width = frames_bgr[0].shape[:2]
        frames_bgr = [halve_to(frame, self.max_side) for frame in frames_bgr]  # before anything moves to a device
        batch = torch.from_numpy(np.stack(frames_bgr)[..., ::-1].copy()).to(self.device)  # N H W C, uint8, RGB
        images = (batch.permute(0, 3, 1, 2).float() - 127.5) * (1.0 / 128.0)
        work_height, work_width = images.shape[2:]
        scale = work_width / width

        boxes, image_index = self._propose(images, self.min_face_fraction * min(work_height, work_width))
        boxes, image_index = self._refine(images, boxes, image_index)
        faces, image_index = self._output(images, boxes, image_index)
        faces[:, :4] /= scale
        faces[:, 5:] /= scale
        faces = faces.cpu().numpy().astype(np.float64)
        image_index = image_index.cpu().numpy()
        return [faces[image_index == index] for index in range(len(frames_bgr))]

    def _propose(self, images: torch.Tensor, min_face: float) -> tuple[torch.Tensor, torch.Tensor]:
        height, width = images.shape[2:]
        all_boxes, all_scores, all_index = [], [], []
        source, source_scale = images, 1.0
        for scale in pyramid_scales(height, width, max(12.0, min_face), self.scale_factor):
            while scale <= source_scale / 4:  # resample each level from a source at most twice its size: cheaper
                source, source_scale = F.avg_pool2d(source, 2, ceil_mode=True), source_scale / 2
            size = (math.ceil(height * scale), math.ceil(width * scale))
            scaled = F.interpolate(source, size=size, mode="bilinear", align_corners=False, antialias=True)
            offsets, probability = self.pnet(scaled)
            image, row, column = torch.nonzero(probability > self.thresholds[0], as_tuple=True)
            if not len(image):
                continue
            corner = torch.stack([column, row], 1).float() * 2.0
            boxes = torch.cat([corner / scale, (corner + 12.0) / scale], 1)
            boxes = _regress(boxes, offsets[image, :, row, column])
            scores = probability[image, row, column]
            keep = batched_nms(boxes, scores, image, 0.5)
            all_boxes.append(boxes[keep])
            all_scores.append(scores[keep])
            all_index.append(image[keep])
        if not all_boxes:
            return images.new_zeros((0, 4)), torch.zeros(0, dtype=torch.long, device=images.device)
        boxes, scores, index = torch.cat(all_boxes), torch.cat(all_scores), torch.cat(all_index)
        keep = batched_nms(boxes, scores, index, 0.7)
        return _square(boxes[keep]), index[keep]

    def _crops(self, images: torch.Tensor, boxes: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        rois = torch.cat([index[:, None].to(boxes.dtype), boxes], 1)
        return roi_align(images, rois, output_size=(size, size), spatial_scale=1.0, sampling_ratio=2, aligned=True)

    def _refine(self, images: torch.Tensor, boxes: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not len(boxes):
            return boxes, index
        offsets, scores = self.rnet(self._crops(images, boxes, index, 24))
        keep = scores > self.thresholds[1]
        boxes, scores, index = _regress(boxes[keep], offsets[keep]), scores[keep], index[keep]
        keep = batched_nms(boxes, scores, index, 0.7)
        return _square(boxes[keep]), index[keep]

    def _output(self, images: torch.Tensor, boxes: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not len(boxes):
            return images.new_zeros((0, 15)), index
        offsets, landmarks, scores = self.onet(self._crops(images, boxes, index, 48))
        keep = scores > self.thresholds[2]
        boxes, offsets, landmarks, scores, index = (t[keep] for t in (boxes, offsets, landmarks, scores, index))
        size_x, size_y = (boxes[:, 2] - boxes[:, 0])[:, None], (boxes[:, 3] - boxes[:, 1])[:, None]
        landmarks = torch.cat([boxes[:, :1] + size_x * landmarks[:, :5], boxes[:, 1:2] + size_y * landmarks[:, 5:]], 1)
        boxes = _regress(boxes, offsets)
        keep = batched_nms(boxes, scores, index, 0.7)
        return torch.cat([boxes[keep], scores[keep, None], landmarks[keep]], 1), index[keep]
