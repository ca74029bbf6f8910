"""The course's reference ViT and NumPy forward pass against timm on the same weights, and its backbone registration.

Weights are random with every tensor perturbed (LayerNorm weights away from one, biases away from zero), so a
transposed or misplaced bias, scale or norm cannot agree by accident; comparisons run in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from pipeline.course.vit_numpy import vit_forward, weights_from_state_dict
from pipeline.models.backbone_families.reference_vit import VIT_REF_VARIANTS, ReferenceVitBackbone
from pipeline.models.backbones import create_backbone, weights_source
from pipeline.models.factory import create_model
from pipeline.models.lightning_module import OptimConfig, parameter_groups
from pipeline.models.vit_reference import ReferenceViT, interpolate_position_embeddings
from pipeline.models.weights import RANDOM_INIT, IncompatibleWeights, WeightsUnavailable
from pipeline.utils.config import load_config
from tests.test_backbones import (
    test_channels_last_gives_the_same_features as check_channels_last_gives_the_same_features,
)
from tests.test_backbones import (
    test_features_and_logits_have_the_right_shape_and_are_finite as check_features_and_logits,
)
from tests.test_backbones import (
    test_parameter_groups_cover_every_parameter_once_from_stem_to_top as check_parameter_groups,
)

# small tensors: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(img_size=40, patch_size=8, embed_dim=24, depth=3, num_heads=3, mlp_ratio=2.0, num_classes=5)


def reference_of(model: torch.nn.Module) -> ReferenceViT:
    """A ReferenceViT with the sizes and (copied) weights of a timm VisionTransformer (class token, no registers,
    no layer scale, token pooling). Any difference that remains shows up as a state-dict mismatch."""
    block = model.blocks[0]
    sizes = dict(img_size=model.patch_embed.img_size[0], patch_size=model.patch_embed.patch_size[0],
                 embed_dim=model.embed_dim, num_heads=block.attn.num_heads, depth=len(model.blocks),
                 mlp_dim=block.mlp.fc1.out_features, num_classes=model.num_classes,
                 in_chans=model.patch_embed.proj.in_channels, qkv_bias=block.attn.qkv.bias is not None,
                 eps=model.norm.eps)
    with torch.device("meta"):  # no time spent initialising weights that are replaced at once
        reference = ReferenceViT(**sizes)
    reference.load_timm_state_dict({name: tensor.clone() for name, tensor in model.state_dict().items()}, assign=True)
    return reference


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every tensor random: matrices N(0, 0.02^2) scaled up a little, vectors around their init (LayerNorm ~1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            if parameter.ndim == 1 and "norm" in name and name.endswith("weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif parameter.ndim == 1:
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(0.05 * noise)
    return model


def _small_timm_vit(seed: int = 0, **changes) -> VisionTransformer:
    return _perturbed(VisionTransformer(**{**SMALL, **changes}).double().eval(), seed)


def _images(batch: int, height: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_reference_vit_gives_timm_vit_b16_logits_in_float64() -> None:
    with torch.device("meta"):  # built without timm's slow initialisation, then every tensor set at random
        timm_model = timm.create_model("vit_base_patch16_224")
    timm_model = _perturbed(timm_model.to_empty(device="cpu").double().eval(), seed=0)
    reference = reference_of(timm_model).eval()
    assert (reference.num_patches, len(reference.blocks), reference.num_features) == (196, 12, 768)
    assert sum(p.numel() for p in reference.parameters()) == 86_567_656  # ViT-B/16 with a 1000-class head
    images = _images(1, 224, 224)
    with torch.no_grad():
        expected, logits = timm_model(images), reference(images)
    assert logits.shape == (1, 1000)
    assert expected.std() > 0.1, "logits this small would make the tolerance meaningless"
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)


def test_reference_vit_gives_a_small_timm_vits_logits_and_attention() -> None:
    timm_model = _small_timm_vit()
    reference = ReferenceViT(
        img_size=40, patch_size=8, embed_dim=24, num_heads=3, depth=3, mlp_dim=48, num_classes=5
    ).double()
    reference.load_timm_state_dict(timm_model.state_dict())
    timm_attention: list[torch.Tensor] = []
    for block in timm_model.blocks:
        block.attn.fused_attn = False  # the fused kernel never forms the attention matrix
        block.attn.attn_drop.register_forward_hook(lambda module, args, output: timm_attention.append(output))
    images = _images(3, 40, 40)
    with torch.no_grad():
        expected = timm_model(images)
        trace = reference.forward_trace(images)
    torch.testing.assert_close(trace["logits"], expected, atol=1e-10, rtol=0)
    assert len(timm_attention) == 3
    for index, attention in enumerate(timm_attention):
        torch.testing.assert_close(trace[f"blocks.{index}.attn.attention"], attention, atol=1e-12, rtol=0)
    assert trace["z0"].shape == (3, 26, 24) and trace["blocks.0.mlp.hidden"].shape == (3, 26, 48)


def test_reference_vit_refuses_an_image_of_another_grid() -> None:
    reference = ReferenceViT(img_size=40, patch_size=8, embed_dim=24, num_heads=3, depth=1, mlp_dim=48)
    with pytest.raises(ValueError, match="interpolate_position_embeddings"):
        reference(torch.zeros(1, 3, 48, 48))


def test_numpy_forward_crops_to_whole_patches_and_matches_timm_and_the_reference() -> None:
    timm_model = _small_timm_vit(seed=2)
    reference = reference_of(timm_model).eval()
    images = _images(2, 45, 43)  # 5 whole 8 px patches each way; the last 5 rows and 3 columns are dropped
    cropped = images[..., :40, :40]
    logits = vit_forward(images.permute(0, 2, 3, 1).numpy(), 8, 3, **weights_from_state_dict(timm_model.state_dict()))
    assert logits.dtype == np.float64 and logits.shape == (2, 5)
    with torch.no_grad():
        np.testing.assert_allclose(logits, timm_model(cropped).numpy(), atol=1e-10, rtol=0)
        np.testing.assert_allclose(logits, reference(cropped).numpy(), atol=1e-10, rtol=0)


def test_numpy_forward_takes_the_block_count_and_widths_from_the_weights() -> None:
    deep = _small_timm_vit(seed=3, embed_dim=12, num_heads=2, mlp_ratio=3.0, num_classes=4)
    shallow = VisionTransformer(**{**SMALL, "embed_dim": 12, "num_heads": 2, "mlp_ratio": 3.0, "num_classes": 4,
                                   "depth": 2}).double().eval()
    shallow.load_state_dict({k: v for k, v in deep.state_dict().items() if not k.startswith("blocks.2.")})
    weights = weights_from_state_dict(deep.state_dict())
    weights["encoder_weights"] = weights["encoder_weights"][:2]
    images = _images(1, 40, 40, seed=4)
    logits = vit_forward(images.permute(0, 2, 3, 1).numpy(), 8, 2, **weights)
    with torch.no_grad():
        np.testing.assert_allclose(logits, shallow(images).numpy(), atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="position embeddings are for 25"):
        vit_forward(np.zeros((1, 48, 48, 3)), 8, 2, **weights)


def test_position_embeddings_are_interpolated_as_timm_does() -> None:
    pos_embed = torch.randn(1, 1 + 14 * 14, 32, generator=torch.Generator().manual_seed(5))
    resized = interpolate_position_embeddings(pos_embed, (24, 24))
    assert resized.shape == (1, 1 + 24 * 24, 32)
    torch.testing.assert_close(resized[:, :1], pos_embed[:, :1], atol=0, rtol=0)  # the class token's is kept
    torch.testing.assert_close(resized, resample_abs_pos_embed(pos_embed, [24, 24], num_prefix_tokens=1))


def test_a_state_dict_for_another_grid_loads_with_interpolated_position_embeddings() -> None:
    timm_model = _small_timm_vit(seed=6)  # 40 px: 5 x 5 patches
    bigger = ReferenceViT(img_size=56, patch_size=8, embed_dim=24, num_heads=3, depth=3, mlp_dim=48, num_classes=5)
    bigger.double().load_timm_state_dict(timm_model.state_dict())
    expected = resample_abs_pos_embed(timm_model.pos_embed.detach(), [7, 7], num_prefix_tokens=1)
    torch.testing.assert_close(bigger.pos_embed.detach(), expected, atol=1e-6, rtol=0)  # timm resamples in float32
    torch.testing.assert_close(bigger.blocks[2].mlp.fc2.weight, timm_model.blocks[2].mlp.fc2.weight, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ the vit_ref backbone
@pytest.fixture(scope="module")
def vit_ref_net():
    torch.manual_seed(0)
    net, source = create_model("vit_ref", n_classes=2, img_size=32)
    assert source == RANDOM_INIT
    return net.eval()


def test_vit_ref_backbone_passes_the_backbone_smoke_checks(vit_ref_net) -> None:
    check_features_and_logits(vit_ref_net)
    check_channels_last_gives_the_same_features(vit_ref_net)
    check_parameter_groups(vit_ref_net)


def test_vit_ref_backbone_has_its_variants_sizes_and_the_original_vits_data_config(vit_ref_net) -> None:
    backbone = vit_ref_net.backbone
    variant = VIT_REF_VARIANTS["vit_ref"]
    assert isinstance(backbone, ReferenceVitBackbone)
    assert (backbone.num_features, len(backbone.model.blocks), backbone.model.patch_size) == (192, 6, 8)
    assert backbone.model.blocks[0].attn.num_heads == variant.num_heads
    assert backbone.model.blocks[0].mlp.fc1.out_features == variant.mlp_dim
    assert backbone.data_config.input_size == (3, 32, 32)
    assert (backbone.data_config.mean, backbone.data_config.std) == ((0.5,) * 3, (0.5,) * 3)  # pixels to [-1, 1]
    default, _ = create_backbone("vit_ref")
    assert default.data_config.input_size == (3, variant.img_size, variant.img_size)
    names = [name for name, _ in backbone.parameter_groups()]
    assert names == ["embed", *(f"blocks.{index}" for index in range(6)), "norm"]


def test_vit_ref_gets_discriminative_learning_rates_and_trains_a_step_in_bf16(vit_ref_net) -> None:
    optim = OptimConfig(head_lr=1e-3, backbone_lr=5e-4, layer_decay=0.5, weight_decay=0.05, warmup_epochs=1,
                        freeze_backbone_epochs=0)
    groups = parameter_groups(vit_ref_net, optim)
    learning_rates = {group["name"]: group["lr"] for group in groups}
    assert learning_rates["head"] == 1e-3 and learning_rates["norm.no_decay"] == 5e-4  # the top group: the final norm
    assert learning_rates["blocks.5"] == 5e-4 * 0.5 and learning_rates["embed"] == pytest.approx(5e-4 * 0.5**7)
    net, _ = create_model("vit_ref", n_classes=2, img_size=32)
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what trainer.precision auto picks for a ViT on an AMX CPU
        loss = torch.nn.functional.cross_entropy(net(images), labels)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_vit_ref_has_no_hub_weights_auto_falls_back_and_true_asks_for_a_file() -> None:
    with pytest.warns(UserWarning, match="No pretrained weights for 'vit_ref': it has no Hugging Face hub repo"):
        assert weights_source("vit_ref", "auto") == RANDOM_INIT
    with pytest.raises(WeightsUnavailable, match="only a local file works"):
        create_backbone("vit_ref", pretrained=True)


def test_vit_ref_starts_from_a_timm_state_dict_of_its_sizes(tmp_path) -> None:
    variant = VIT_REF_VARIANTS["vit_ref"]
    source = _perturbed(
        VisionTransformer(img_size=64, patch_size=8, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0,
                          num_classes=7), seed=7
    )
    assert (variant.embed_dim, variant.depth, variant.mlp_dim) == (192, 6, 768)
    path = tmp_path / "vit_ref.pth"
    torch.save(source.state_dict(), path)
    backbone, weights = create_backbone("vit_ref", pretrained=True, weights=path, img_size=64)
    assert (weights.kind, weights.ref) == ("file", str(path))
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(backbone(images), source.forward_head(source.forward_features(images),
                                                                         pre_logits=True), atol=1e-5, rtol=0)
    wider = VisionTransformer(img_size=64, patch_size=8, embed_dim=96, depth=6, num_heads=3, mlp_ratio=4.0)
    torch.save(wider.state_dict(), tmp_path / "wider.pth")
    with pytest.raises(IncompatibleWeights, match="wider.pth does not fit ReferenceViT"):
        create_backbone("vit_ref", pretrained=True, weights=tmp_path / "wider.pth")


def test_model_vit_ref_composes_with_its_synthetic_cpu_settings() -> None:
    cfg = load_config(["model=vit_ref"])
    assert cfg.model.name == "vit_ref" and cfg.model.pretrained == "auto"
    assert cfg.model.img_size == 64 and cfg.loader.from_s == 3.5  # configs/data_model/synthetic_vit_ref.yaml
    assert load_config(["model=vit_ref", "data=biovid"]).model.img_size is None  # BioVid: the variant's own size
