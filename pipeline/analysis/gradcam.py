"""Grad-CAM for every backbone family, through the grad-cam package (`pytorch_grad_cam`), with the right layer.

The package hooks one module and expects it to return a tensor, and maps of shape (B, C, H, W). Which module that
is differs by family, so each backbone adapter lists its candidates (`Backbone.cam_layers`), and a wrong choice
fails silently (a module returning a tuple, as Hugging Face CvT stages do,
records no gradient; the last block's output of a class-token model gets no gradient from the class token):

- timm ViT: the last block's `norm1` (its input to attention, where the class token still reads the patches),
  tokens reshaped to (B, D, rows, cols) without the class token;
- HF CvT: the last layer's `layernorm_before` in the last stage, likewise without the class token;
- MobileViT and other convolutional timm models: the last feature map (`final_conv`, else the stages timm lists in
  `feature_info`).

A layer whose map is a single cell cannot show where the model looks, so for small inputs the deepest candidate
with at least 2 x 2 cells is taken (e.g. MobileViT at 32 px: stride 16 instead of 32).

Maps are kept un-normalised (ReLU of the weighted activations, upsampled bilinearly), unlike the package's
per-image min-max scaling: the share of a map's mass inside a region is then meaningful, and a flat map stays flat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_grad_cam import GradCAM
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
from torch import nn

from pipeline.models.backbones import PainNet


@dataclass(frozen=True)
class CamLayer:
    """A module for Grad-CAM to hook, how its output becomes (B, C, H, W), and what it is called."""

    name: str
    module: nn.Module
    reshape: Callable[[torch.Tensor], torch.Tensor] | None


def tokens_to_map(num_prefix_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """(B, prefix + H*W, C) tokens -> (B, C, H, W), dropping the prefix (class) tokens; the grid is square."""

    def reshape(tokens: torch.Tensor) -> torch.Tensor:
        patches = tokens[:, num_prefix_tokens:]
        side = math.isqrt(patches.shape[1])
        if side * side != patches.shape[1]:
            raise ValueError(f"{patches.shape[1]} patch tokens are not a square grid")
        return patches.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], side, side)

    return reshape


def candidate_layers(net: PainNet) -> list[CamLayer]:
    """Grad-CAM layers of the network's backbone, deepest first, as its adapter lists them (`Backbone.cam_layers`)."""
    return [CamLayer(spec.name, spec.module, None if spec.prefix_tokens is None else tokens_to_map(spec.prefix_tokens))
            for spec in net.backbone.cam_layers()]


def _map_shape(layer: CamLayer, net: PainNet, image_size: int) -> tuple[int, ...] | None:
    """The shape of the layer's map (after the reshape) for one image of `image_size`, or None if not a tensor."""
    seen: list = []
    handle = layer.module.register_forward_hook(lambda module, inputs, output: seen.append(output))
    try:
        with torch.no_grad():
            net(torch.zeros(1, 3, image_size, image_size, device=next(net.parameters()).device))
    finally:
        handle.remove()
    output = seen[-1] if seen else None
    if not isinstance(output, torch.Tensor):
        return None
    mapped = layer.reshape(output) if layer.reshape else output
    return tuple(mapped.shape) if mapped.ndim == 4 else None


def gradcam_layer(net: PainNet, image_size: int, min_cells: int = 2) -> CamLayer:
    """The deepest layer of the family that returns a tensor map with at least `min_cells` cells on each side."""
    for layer in candidate_layers(net):
        shape = _map_shape(layer, net, image_size)
        if shape is not None and min(shape[2:]) >= min_cells:
            return layer
    raise ValueError(f"no Grad-CAM layer of {net.backbone.name} has a map of at least {min_cells} x {min_cells} "
                     f"cells at {image_size} px")


class _UnscaledGradCAM(GradCAM):
    """The package's Grad-CAM weights and weighted sum; its per-image min-max rescaling replaced by a plain bilinear
    upsampling, so map mass keeps its meaning (see the module docstring)."""

    def compute_cam_per_layer(self, input_tensor, targets, eigen_smooth):
        activations = [a.cpu().data.numpy() for a in self.activations_and_grads.activations]
        gradients = [g.cpu().data.numpy() for g in self.activations_and_grads.gradients]
        if not activations or len(gradients) != len(activations):
            raise RuntimeError("Grad-CAM recorded no activation or no gradient at the hooked layer (does it return a "
                               "tensor that the prediction depends on?)")
        height, width = input_tensor.shape[-2:]
        cams = []
        for layer, layer_activations, layer_gradients in zip(self.target_layers, activations, gradients,
                                                              strict=True):
            cam = self.get_cam_image(input_tensor, layer, targets, layer_activations, layer_gradients, eigen_smooth)
            cam = torch.from_numpy(np.maximum(cam, 0)).float()[:, None]
            cams.append(F.interpolate(cam, size=(height, width), mode="bilinear", align_corners=False)[:, 0].numpy())
        return cams

    def aggregate_multi_layers(self, cam_per_target_layer):
        return np.mean(np.stack(cam_per_target_layer), axis=0)


def gradcam_maps(net: PainNet, images: torch.Tensor, target_classes: Sequence[int], layer: CamLayer) -> np.ndarray:
    """Grad-CAM of `target_classes` (one per image) at `layer`: (B, H, W) non-negative maps at the input size."""
    net.eval()
    cam = _UnscaledGradCAM(net, [layer.module], reshape_transform=layer.reshape)
    try:
        with torch.enable_grad():
            maps = cam(input_tensor=images, targets=[ClassifierOutputTarget(int(c)) for c in target_classes])
    finally:
        cam.activations_and_grads.release()
    net.zero_grad(set_to_none=True)
    return np.asarray(maps, dtype=np.float32)
