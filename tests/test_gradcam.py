"""Grad-CAM through the grad-cam package for the three backbone families, on a real photograph of a face."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skimage import data

from pipeline.analysis.gradcam import gradcam_layer, gradcam_maps
from pipeline.data.augment import build_eval_transform
from pipeline.models.backbone_families.cvt import CvtBackbone, CvtVariant
from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model


def face_batch(data_config, n: int = 2) -> torch.Tensor:
    """scikit-image's astronaut: the face, and the face shifted, as the model's normalised input."""
    photo = data.astronaut()
    crops = [photo[20:220, 140:340], photo[40:240, 120:320]][:n]
    transform = build_eval_transform(data_config)
    return torch.stack([transform(image=np.ascontiguousarray(crop))["image"] for crop in crops])


def small_cvt(size: int) -> PainNet:
    """Hugging Face CvT through the pipeline's adapter, at a tenth of CvT-13's width and depth (seconds to build)."""
    variant = CvtVariant(hub_repo="microsoft/cvt-13", depth=(1, 2, 3), embed_dim=(16, 32, 64), num_heads=(1, 2, 2))
    return PainNet(CvtBackbone("cvt_13", variant, size), n_classes=2)


@pytest.mark.parametrize(("name", "size", "layer_name"), [
    ("vit_tiny_patch16_224", 32, "blocks.11.norm1"),  # tokens without the class token, 2 x 2 grid
    ("cvt_small", 64, "stages.2.layers.2.layernorm_before"),  # HF CvT: a LayerNorm, not the stage (a tuple)
    ("mobilevit_xxs", 64, "final_conv"),  # the last feature map, 2 x 2 at 64 px
])
def test_gradcam_maps_are_non_zero_and_vary_for_each_family(name: str, size: int, layer_name: str) -> None:
    torch.manual_seed(0)
    net = small_cvt(size) if name == "cvt_small" else create_model(name, n_classes=2, pretrained=False,
                                                                     img_size=size)[0]
    net.eval()
    layer = gradcam_layer(net, size)
    assert layer.name == layer_name
    images = face_batch(net.backbone.data_config)
    with torch.no_grad():
        predicted = net(images).argmax(dim=1).tolist()
    maps = gradcam_maps(net, images, predicted, layer)
    assert maps.shape == (2, size, size) and np.isfinite(maps).all() and (maps >= 0).all()
    for saliency in maps:
        assert saliency.max() > 0, "an empty map"
        assert saliency.std() > 1e-3 * saliency.max(), "a flat map"
    assert all(p.grad is None for p in net.parameters())  # no gradients left behind


def test_a_one_cell_map_is_replaced_by_the_deepest_finer_one() -> None:
    net, _ = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    assert gradcam_layer(net.eval(), 32).name == "stages.3"  # final_conv is 1 x 1 at 32 px, stages.3 is 2 x 2

