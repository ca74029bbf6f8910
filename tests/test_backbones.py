"""Backbone adapter smoke tests, parametrised over every backbone name plus one pass-through timm model.

Random init, tiny inputs: each model is built once per module (ViT-B/16 at 32 px is the heaviest).
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from pipeline.models.backbone_families.cvt import CVT_DATA_CONFIG, CVT_VARIANTS, CvtBackbone
from pipeline.models.backbone_families.timm_models import TIMM_ARCHITECTURES, TimmBackbone
from pipeline.models.backbones import PainNet, backbone_names, create_backbone, model_family
from pipeline.models.factory import create_model

# small tensors: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PASS_THROUGH_TIMM = "resnet18"
SMOKE_NAMES = (*(name for name in backbone_names() if name != "vit_ref"), PASS_THROUGH_TIMM)
SMOKE_IMAGE_SIZE = {"vit_b16": 32}  # ViT-B/16 on CPU is heavy: a 2x2 patch grid is enough for a smoke test
DEFAULT_SMOKE_IMAGE_SIZE = 64  # MobileViT downsamples by 32; CvT by 16
BATCH = 2
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
KNOWN_NORMALISATION = {  # (mean, std) each family was pretrained with: not ImageNet's everywhere
    "vit_b16": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # augreg: Inception-style
    "mobilevit": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # cvnets: none
    "cvt": IMAGENET,
    "resnet18": IMAGENET,
}


@pytest.fixture(scope="module", params=SMOKE_NAMES)
def built(request) -> PainNet:
    torch.manual_seed(0)
    img_size = SMOKE_IMAGE_SIZE.get(request.param, DEFAULT_SMOKE_IMAGE_SIZE)
    model, source = create_model(request.param, n_classes=2, img_size=img_size)
    assert source.kind == "random" and source.sha256 is None
    return model.eval()


def _images(model: PainNet) -> torch.Tensor:
    channels, height, width = model.backbone.data_config.input_size
    return torch.randn(BATCH, channels, height, width, generator=torch.Generator().manual_seed(1))


def test_features_and_logits_have_the_right_shape_and_are_finite(built: PainNet) -> None:
    images = _images(built)
    with torch.no_grad():
        features = built.backbone(images)
        logits = built(images)
    assert features.shape == (BATCH, built.backbone.num_features)
    assert logits.shape == (BATCH, 2)
    assert torch.isfinite(features).all() and torch.isfinite(logits).all()
    assert isinstance(built.head, nn.Linear)
    assert (built.head.in_features, built.head.out_features) == (built.backbone.num_features, 2)


def test_channels_last_gives_the_same_features(built: PainNet) -> None:
    images = _images(built)
    with torch.no_grad():
        contiguous = built.backbone(images)
        channels_last_model = built.backbone.to(memory_format=torch.channels_last)
        channels_last = channels_last_model(images.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(channels_last, contiguous, atol=1e-4, rtol=1e-4)


def test_parameter_groups_cover_every_parameter_once_from_stem_to_top(built: PainNet) -> None:
    backbone = built.backbone
    groups = backbone.parameter_groups()
    assert len(groups) >= 3
    assert len({name for name, _ in groups}) == len(groups), "group names must be unique"
    grouped_ids = [id(parameter) for _, parameters in groups for parameter in parameters]
    assert len(grouped_ids) == len(set(grouped_ids)), "a parameter is in two groups"
    assert set(grouped_ids) == {id(parameter) for parameter in backbone.parameters()}
    assert all(parameters for _, parameters in groups)

    # Order: record which parameters each module owns directly, in the order the forward pass reaches the modules;
    # the group index of parameters in that order must never go down (stem first, the top group last).
    group_of = {id(parameter): index for index, (_, parameters) in enumerate(groups) for parameter in parameters}
    use_order: list[int] = []
    hooks = [
        module.register_forward_pre_hook(lambda m, _: use_order.extend(id(p) for p in m.parameters(recurse=False)))
        for module in backbone.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    try:
        with torch.no_grad():
            backbone(_images(built))
    finally:
        for hook in hooks:
            hook.remove()
    first_use = list(dict.fromkeys(use_order))
    assert set(first_use) == set(grouped_ids), "every parameter takes part in the forward pass"
    indices = [group_of[parameter_id] for parameter_id in first_use]
    assert indices == sorted(indices), "parameter groups are not ordered from stem to top"
    assert indices[0] == 0 and indices[-1] == len(groups) - 1


def test_data_config_comes_from_the_backbones_own_pretrained_config(built: PainNet) -> None:
    backbone = built.backbone
    config = backbone.data_config
    img_size = SMOKE_IMAGE_SIZE.get(backbone.name, DEFAULT_SMOKE_IMAGE_SIZE)
    assert config.input_size == (3, img_size, img_size), "input_size follows the img_size override"
    if isinstance(backbone, TimmBackbone):
        registered = timm.models.get_pretrained_cfg(TIMM_ARCHITECTURES.get(backbone.name, backbone.name))
        assert (config.mean, config.std) == (tuple(registered.mean), tuple(registered.std))
        assert (config.interpolation, config.crop_pct) == (registered.interpolation, registered.crop_pct)
    else:
        assert isinstance(backbone, CvtBackbone)
        assert (config.mean, config.std, config.crop_pct) == (CVT_DATA_CONFIG.mean, CVT_DATA_CONFIG.std, 0.875)
    family = next(prefix for prefix in KNOWN_NORMALISATION if backbone.name.startswith(prefix))
    assert (config.mean, config.std) == KNOWN_NORMALISATION[family]


def test_named_backbones_have_their_published_architecture(built: PainNet) -> None:
    backbone = built.backbone
    if isinstance(backbone, CvtBackbone):
        variant = CVT_VARIANTS[backbone.name]
        stages = backbone.cvt.encoder.stages
        assert tuple(len(stage.layers) for stage in stages) == variant.depth
        assert tuple(stage.embedding.convolution_embeddings.projection.out_channels for stage in stages) == (
            64,
            192,
            384,
        )
        assert tuple(stage.layers[0].attention.attention.num_heads for stage in stages) == (1, 3, 6)
    elif backbone.name == "vit_b16":
        assert (len(backbone.model.blocks), backbone.num_features, backbone.model.patch_embed.patch_size) == (
            12,
            768,
            (16, 16),
        )
    elif backbone.name == PASS_THROUGH_TIMM:
        assert backbone.architecture.startswith("resnet18")
    else:
        assert backbone.architecture == TIMM_ARCHITECTURES[backbone.name]


def test_vit_img_size_override_resizes_position_embeddings() -> None:
    backbone, _ = create_backbone("vit_tiny_patch16_224", img_size=48)
    assert backbone.model.pos_embed.shape == (1, 1 + 3 * 3, backbone.num_features)
    assert backbone.data_config.input_size == (3, 48, 48)
    with torch.no_grad():
        assert backbone(torch.randn(1, 3, 48, 48)).shape == (1, backbone.num_features)


def test_heads_are_fresh_and_sized_by_n_classes() -> None:
    first, _ = create_model("mobilevit_xxs", n_classes=5)
    second, _ = create_model("mobilevit_xxs", n_classes=5)
    assert first.head.out_features == 5
    assert not torch.equal(first.head.weight, second.head.weight), "each model gets its own fresh head"


def test_unknown_backbone_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'not_a_model'.*vit_b16"):
        create_backbone("not_a_model")


@pytest.mark.parametrize(("name", "family"), [("vit_b16", "vit"), ("vit_ref", "vit"), ("deit_tiny_patch16_224", "vit"),
                                              ("cvt_13", "cvt"), ("mobilevit_s", "timm"), (PASS_THROUGH_TIMM, "timm")])
def test_the_family_comes_from_the_adapter_not_the_name(name: str, family: str) -> None:
    # deit_* is a plain ViT although its name does not say so; the meta-device build answers without any weights
    assert model_family(name, img_size=32) == family
