"""The CvT family (Wu et al. 2021), from Hugging Face transformers (timm has none): `CvtModel` built from a
`CvtConfig` made here, so nothing is fetched from the hub but the weights (`microsoft/cvt-13`, `cvt-21`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipeline.models.backbone_adapter import (
    Backbone,
    BackboneAdapter,
    CamSpec,
    DataConfig,
    on_cpu,
    register_adapter,
)
from pipeline.models.parameter_groups import ParameterGroups, check_groups_cover
from pipeline.models.weights import (
    HUB_WEIGHT_FILENAMES,
    ResolvedWeights,
    check_state_dict_fits,
    read_state_dict,
    without_prefixes,
)
from pipeline.utils.devices import FamilyTraits

logger = logging.getLogger(__name__)
CVT = "cvt"


@dataclass(frozen=True)
class CvtVariant:
    """A published CvT: its hub repo (for weights) and the per-stage depth; width and heads are shared."""

    hub_repo: str
    depth: tuple[int, int, int]
    embed_dim: tuple[int, int, int] = (64, 192, 384)
    num_heads: tuple[int, int, int] = (1, 3, 6)


CVT_VARIANTS = {
    "cvt_13": CvtVariant(hub_repo="microsoft/cvt-13", depth=(1, 2, 10)),
    "cvt_21": CvtVariant(hub_repo="microsoft/cvt-21", depth=(1, 4, 16)),
}


# CvT's preprocessing as published with microsoft/cvt-13 and cvt-21 (preprocessor_config.json: ConvNext image
# processor, ImageNet mean/std, resample=3 i.e. bicubic, crop_pct 0.875, 224 px).
CVT_DATA_CONFIG = DataConfig(
    input_size=(3, 224, 224),
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
    interpolation="bicubic",
    crop_pct=0.875,
)


class CvtBackbone(Backbone):
    """Hugging Face CvT: the last stage's class token after a LayerNorm (as in `CvtForImageClassification`).

    The submodule names (`cvt`, `layernorm`) match `CvtForImageClassification`, so the hub checkpoints load
    without renaming once the classifier is dropped.
    """

    def __init__(self, name: str, variant: CvtVariant, img_size: int | None) -> None:
        from transformers import CvtConfig, CvtModel  # here: a second of import that only a CvT needs

        config = CvtConfig(
            depth=list(variant.depth), embed_dim=list(variant.embed_dim), num_heads=list(variant.num_heads)
        )
        if not config.cls_token[-1]:
            raise ValueError("CvT backbone pools the last stage's class token; the config must have one")
        super().__init__(name, variant.hub_repo, variant.embed_dim[-1], CVT_DATA_CONFIG.with_image_size(img_size))
        self.family = CVT
        self.cvt = CvtModel(config, add_pooling_layer=False)
        self.layernorm = nn.LayerNorm(variant.embed_dim[-1])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        class_token = self.cvt(pixel_values=images, return_dict=True).cls_token_value  # (B, 1, D)
        return self.layernorm(class_token[:, 0])

    def weights_state(self) -> dict[str, torch.Tensor]:
        """`cvt.` and `layernorm.` keys: CvtForImageClassification's layout, less its classifier."""
        return on_cpu(self.state_dict())

    def parameter_groups(self) -> ParameterGroups:
        groups: ParameterGroups = []
        for stage_index, stage in enumerate(self.cvt.encoder.stages):
            embed = list(stage.embedding.parameters())
            if getattr(stage, "cls_token", None) is not None:
                embed.append(stage.cls_token)
            groups.append((f"stage{stage_index}.embed", embed))
            groups += [
                (f"stage{stage_index}.block{block_index}", list(block.parameters()))
                for block_index, block in enumerate(stage.layers)
            ]
        groups.append(("norm", list(self.layernorm.parameters())))
        check_groups_cover(self, groups)
        return groups

    def cam_layers(self) -> list[CamSpec]:
        """The last stage's layers' `layernorm_before` (tokens after its class token: a stage's own output is a
        tuple, which records no gradient), then each stage's embedding convolution (plain maps), top first."""
        stage = self.cvt.encoder.stages[-1]
        prefix = 1 if getattr(stage, "cls_token", None) is not None else 0
        last = len(self.cvt.encoder.stages) - 1
        layers = [CamSpec(f"stages.{last}.layers.{i}.layernorm_before", layer.layernorm_before, prefix)
                  for i, layer in reversed(list(enumerate(stage.layers)))]
        # earlier stages have no class token and return plain (B, C, H, W) maps from their embedding convolution
        return layers + [CamSpec(f"stages.{i}.embedding", s.embedding, None)
                         for i, s in reversed(list(enumerate(self.cvt.encoder.stages)))]

    def trace_patterns(self) -> tuple[tuple[str, str], ...]:
        return (
            (r"cvt\.encoder\.stages\.\d+\.embedding", "convolutional token embedding"),
            (r"cvt\.encoder\.stages\.\d+\.layers\.\d+", "tokens"),
            (r"cvt\.encoder\.stages\.\d+\.layers\.\d+\.attention\.attention\.dropout", "attention weights"),
            (r"layernorm", "output"),
        )

    def trace_name(self, name: str) -> str:
        return name.removeprefix("cvt.encoder.")


def load_cvt_weights(backbone: CvtBackbone, path: Path) -> None:
    """Load a CvT state dict strictly: a CvtForImageClassification checkpoint (hub format, `cvt.`/`layernorm.`/
    `classifier.` keys; the classifier is dropped) or a `CvtModel.save_pretrained` one (no prefix, no final norm).

    A CvtModel checkpoint has no final LayerNorm: it is then left at identity (weight 1, bias 0), with a warning.
    """
    state_dict = read_state_dict(path)
    norm_missing = False
    if any(key.startswith("cvt.") for key in state_dict):
        state_dict = without_prefixes(state_dict, ("classifier",))
    else:
        state_dict = {f"cvt.{key}": value for key, value in state_dict.items()}
        norm_missing = not any(key.startswith("layernorm.") for key in state_dict)
        if norm_missing:
            identity = nn.LayerNorm(backbone.num_features).state_dict()
            state_dict.update({f"layernorm.{key}": value for key, value in identity.items()})
    check_state_dict_fits(backbone.state_dict(), state_dict, path, backbone.architecture)
    backbone.load_state_dict(state_dict, strict=True)
    if norm_missing:
        logger.warning("%s holds a CvtModel without the final LayerNorm; that norm starts at identity", path)


def _build(name: str, resolved: ResolvedWeights | None, img_size: int | None) -> Backbone:
    backbone = CvtBackbone(name, CVT_VARIANTS[name], img_size)
    if resolved is not None:
        load_cvt_weights(backbone, resolved.path)
    return backbone


register_adapter(BackboneAdapter("cvt", lambda name: name in CVT_VARIANTS,
                                 lambda name: (CVT_VARIANTS[name].hub_repo, HUB_WEIGHT_FILENAMES), _build,
                                 names=tuple(CVT_VARIANTS)),
                 {CVT: FamilyTraits(bf16_on_cpu=False, channels_last_on_gpu=True)})
