"""The course's reference ViT (`pipeline.models.vit_reference`) as a backbone: `vit_ref`, which no hub holds
weights for, so it trains from scratch (or from a timm ViT state dict of its sizes, WEIGHTS=). A plain ViT: it reports
the timm family's `vit` traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.models.backbone_adapter import Backbone, BackboneAdapter, CamSpec, DataConfig, register_adapter
from pipeline.models.backbone_families.timm_models import MODEL_TRACE, vit_cam_layers
from pipeline.models.parameter_groups import ParameterGroups, check_groups_cover
from pipeline.models.vit_reference import ReferenceViT
from pipeline.models.weights import IncompatibleWeights, ResolvedWeights, read_state_dict, without_prefixes


@dataclass(frozen=True)
class ReferenceVitVariant:
    """Sizes of the course's reference ViT (pipeline/vit_ref.py); img_size is its default input size."""

    img_size: int
    patch_size: int
    embed_dim: int
    num_heads: int
    depth: int
    mlp_dim: int


# The course's from-scratch exercise on this project's data: a ViT-Tiny width at half its depth, 8 px patches for the
# small inputs a CPU trains on. No hub repo: pretrained "auto" starts from random init, True needs WEIGHTS= (a timm
# ViT state dict of these sizes; its position embeddings are interpolated to the input size).
VIT_REF_VARIANTS = {
    "vit_ref": ReferenceVitVariant(img_size=64, patch_size=8, embed_dim=192, num_heads=3, depth=6, mlp_dim=768),
}

# The original ViT's preprocessing (pixels scaled to [-1, 1]) with timm's ViT interpolation and crop_pct.
VIT_REF_DATA_CONFIG = DataConfig(
    input_size=(3, 224, 224), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bicubic", crop_pct=0.9
)


class ReferenceVitBackbone(Backbone):
    """The course's reference ViT without a head: y = LN(z_L^0), the class token's final state (eq. 4)."""

    def __init__(self, name: str, variant: ReferenceVitVariant, img_size: int | None) -> None:
        size = img_size or variant.img_size
        architecture = (
            f"ReferenceViT(patch {variant.patch_size}, D {variant.embed_dim}, {variant.depth} blocks, "
            f"{variant.num_heads} heads, MLP {variant.mlp_dim})"
        )
        super().__init__(name, architecture, variant.embed_dim, VIT_REF_DATA_CONFIG.with_image_size(size))
        self.family = "vit"  # a plain ViT (registered by the timm family)
        self.model = ReferenceViT(
            img_size=size,
            patch_size=variant.patch_size,
            embed_dim=variant.embed_dim,
            num_heads=variant.num_heads,
            depth=variant.depth,
            mlp_dim=variant.mlp_dim,
            num_classes=0,
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def parameter_groups(self) -> ParameterGroups:
        model = self.model
        groups: ParameterGroups = [("embed", [model.cls_token, model.pos_embed, *model.patch_embed.parameters()])]
        groups += [(f"blocks.{index}", list(block.parameters())) for index, block in enumerate(model.blocks)]
        groups.append(("norm", list(model.norm.parameters())))
        check_groups_cover(self, groups)
        return groups

    def cam_layers(self) -> list[CamSpec]:
        return vit_cam_layers(self.model)

    def trace_patterns(self) -> tuple[tuple[str, str], ...]:
        return MODEL_TRACE

    def trace_name(self, name: str) -> str:
        return name.removeprefix("model.")


def load_reference_vit_weights(backbone: ReferenceVitBackbone, path: Path) -> None:
    """Load a timm ViT state dict of the variant's sizes strictly (its head dropped, position embeddings resampled
    to the input size); .npz files are not read for vit_ref."""
    state_dict = without_prefixes(read_state_dict(path), ("head",))
    try:
        backbone.model.load_timm_state_dict(state_dict)
    except (RuntimeError, ValueError) as error:
        raise IncompatibleWeights(f"{path} does not fit {backbone.architecture}: {error}") from error


def _build(name: str, resolved: ResolvedWeights | None, img_size: int | None) -> Backbone:
    backbone = ReferenceVitBackbone(name, VIT_REF_VARIANTS[name], img_size)
    if resolved is not None:
        load_reference_vit_weights(backbone, resolved.path)
    return backbone


# No hub repo: "auto" finds nothing and falls back to random init with a warning
register_adapter(BackboneAdapter("reference_vit", lambda name: name in VIT_REF_VARIANTS, lambda name: (None, ()),
                                 _build, names=tuple(VIT_REF_VARIANTS)), {})
