"""Interchangeable backbones behind one adapter: pooled features of width D, parameter groups (grouped by
`pipeline.models.parameter_groups`), data config.

timm provides ViT, MobileViT and any other timm model; CvT comes from Hugging Face transformers (timm has none),
built from a `CvtConfig` made here so nothing is fetched from the hub; `vit_ref` is the course's reference ViT
(pipeline/vit_ref.py), which no hub holds weights for, so it trains from scratch. Weights are resolved by
`pipeline.models.weights`; the source classifier head is always dropped and a fresh `nn.Linear` head is put on top
(`PainNet`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pipeline.models.parameter_groups import ParameterGroups, check_groups_cover, child_groups, timm_matcher_groups
from pipeline.models.vit_reference import ReferenceViT
from pipeline.models.weights import (
    HUB_WEIGHT_FILENAMES,
    RANDOM_INIT,
    IncompatibleWeights,
    ResolvedWeights,
    WeightsSource,
    check_state_dict_fits,
    read_state_dict,
    resolve_weights,
    without_prefixes,
)

logger = logging.getLogger(__name__)

BACKBONE_NAMES = ("vit_b16", "cvt_13", "cvt_21", "mobilevit_s", "mobilevit_xs", "mobilevit_xxs")

# Project names of timm backbones -> timm model name with the pretrained tag whose weights we start from.
TIMM_ARCHITECTURES = {
    "vit_b16": "vit_base_patch16_224.augreg_in21k",  # ImageNet-21k pretraining, no 1k fine-tuning
    "mobilevit_s": "mobilevit_s.cvnets_in1k",
    "mobilevit_xs": "mobilevit_xs.cvnets_in1k",
    "mobilevit_xxs": "mobilevit_xxs.cvnets_in1k",
}


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


@dataclass(frozen=True)
class DataConfig:
    """What the data pipeline needs, taken from the backbone's own pretrained config."""

    input_size: tuple[int, int, int]  # (channels, height, width)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str
    crop_pct: float

    def with_image_size(self, img_size: int | None) -> DataConfig:
        if img_size is None:
            return self
        return DataConfig(
            (self.input_size[0], img_size, img_size), self.mean, self.std, self.interpolation, self.crop_pct
        )


# CvT's preprocessing as published with microsoft/cvt-13 and cvt-21 (preprocessor_config.json: ConvNext image
# processor, ImageNet mean/std, resample=3 i.e. bicubic, crop_pct 0.875, 224 px).
CVT_DATA_CONFIG = DataConfig(
    input_size=(3, 224, 224),
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
    interpolation="bicubic",
    crop_pct=0.875,
)


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


# What kind of network an adapter holds, for decisions that depend on it (bf16 on a CPU, channels-last): asked of the
# adapter, which knows its model's type, never guessed from the name ("vit_ref" and timm's "deit_*" are plain ViTs).
PLAIN_VIT, CVT, OTHER_TIMM = "vit", "cvt", "timm"
FAMILIES = (PLAIN_VIT, CVT, OTHER_TIMM)


class Backbone(nn.Module):
    """The adapter every backbone implements: images (B, 3, H, W) -> pooled features (B, num_features)."""

    family: str  # one of FAMILIES

    def __init__(self, name: str, architecture: str, num_features: int, data_config: DataConfig) -> None:
        super().__init__()
        self.name = name
        self.architecture = architecture  # the timm model name or hub repo behind `name`
        self.num_features = num_features
        self.data_config = data_config

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def parameter_groups(self) -> ParameterGroups:
        """(name, parameters) ordered from the stem to the top, each backbone parameter exactly once.

        For discriminative learning rates (layer decay). Frozen parameters are included; filter on
        requires_grad where that matters.
        """
        raise NotImplementedError

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The weights in the file layout `model.weights=` reads for this adapter (what `make pretrain` writes), on
        the CPU; an adapter without one says so."""
        raise NotImplementedError(f"{self.name}: this backbone has no weights file layout that model.weights= reads")


class TimmBackbone(Backbone):
    """Any timm model built with num_classes=0, so its forward returns the pooled pre-logits features."""

    def __init__(self, name: str, model: nn.Module, img_size: int | None) -> None:
        data = timm.data.resolve_model_data_config(model)
        data_config = DataConfig(
            input_size=tuple(data["input_size"]),
            mean=tuple(data["mean"]),
            std=tuple(data["std"]),
            interpolation=data["interpolation"],
            crop_pct=float(data["crop_pct"]),
        )
        num_features = getattr(model, "head_hidden_size", None) or model.num_features
        architecture = model.pretrained_cfg.get("architecture") or name
        tag = model.pretrained_cfg.get("tag")
        super().__init__(
            name, f"{architecture}.{tag}" if tag else architecture, num_features, data_config.with_image_size(img_size)
        )
        self.model = model
        self.family = PLAIN_VIT if isinstance(model, VisionTransformer) else OTHER_TIMM

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The timm model's own state dict (it has no classifier): what timm and `model.weights=` read."""
        return _on_cpu(self.model.state_dict())

    def parameter_groups(self) -> ParameterGroups:
        matcher = self.model.group_matcher(coarse=False) if hasattr(self.model, "group_matcher") else None
        if isinstance(matcher, dict):
            groups = timm_matcher_groups(self.model.named_parameters(), matcher)
        else:
            groups = child_groups(self.model)
        check_groups_cover(self, groups)
        return groups


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
        return _on_cpu(self.state_dict())

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


class ReferenceVitBackbone(Backbone):
    """The course's reference ViT without a head: y = LN(z_L^0), the class token's final state (eq. 4)."""

    def __init__(self, name: str, variant: ReferenceVitVariant, img_size: int | None) -> None:
        size = img_size or variant.img_size
        architecture = (
            f"ReferenceViT(patch {variant.patch_size}, D {variant.embed_dim}, {variant.depth} blocks, "
            f"{variant.num_heads} heads, MLP {variant.mlp_dim})"
        )
        super().__init__(name, architecture, variant.embed_dim, VIT_REF_DATA_CONFIG.with_image_size(size))
        self.family = PLAIN_VIT
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


def _on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().contiguous() for key, value in state.items()}


class PainNet(nn.Module):
    """A backbone with a freshly initialised linear head: images -> logits (B, n_classes); or with the output head
    given (`pipeline.models.ordinal.build_output_head`: an ordinal or regression head over the task's levels)."""

    def __init__(self, backbone: Backbone, n_classes: int, head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, n_classes) if head is None else head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


def create_backbone(
    name: str,
    *,
    pretrained: bool | str = False,
    weights: str | Path | None = None,
    img_size: int | None = None,
) -> tuple[Backbone, WeightsSource]:
    """Build backbone `name` (one of BACKBONE_NAMES or any timm model name) and load its pretrained weights.

    pretrained: True (weights file/folder, else the hub cache, else WeightsUnavailable), False (random init) or
    "auto" (random init with a loud warning when no weights are found). img_size overrides the input size; ViT
    position embeddings are interpolated to it and data_config.input_size follows.
    """
    resolved = _resolve_backbone_weights(name, pretrained, weights)
    if name in CVT_VARIANTS:
        backbone: Backbone = CvtBackbone(name, CVT_VARIANTS[name], img_size)
        if resolved is not None:
            load_cvt_weights(backbone, resolved.path)
    elif name in VIT_REF_VARIANTS:
        backbone = ReferenceVitBackbone(name, VIT_REF_VARIANTS[name], img_size)
        if resolved is not None:
            load_reference_vit_weights(backbone, resolved.path)
    else:
        model = _create_timm_model(_timm_architecture(name), resolved, img_size)
        backbone = TimmBackbone(name, model, img_size)
    source = resolved.source if resolved is not None else RANDOM_INIT
    logger.info(
        "backbone %s (%s): %d parameters, weights %s %s",
        name,
        backbone.architecture,
        sum(p.numel() for p in backbone.parameters()),
        source.kind,
        source.ref,
    )
    return backbone, source


def model_family(name: str, img_size: int | None = None) -> str:
    """The family of backbone `name`, from its adapter built on the meta device (shapes only: well under a second)."""
    with torch.device("meta"):
        backbone, _ = create_backbone(name, pretrained=False, img_size=img_size)
    return backbone.family


def weights_source(name: str, pretrained: bool | str = False, weights: str | Path | None = None) -> WeightsSource:
    """Where `create_backbone` would take the weights from, without building the model (fails the same way)."""
    resolved = _resolve_backbone_weights(name, pretrained, weights)
    return resolved.source if resolved is not None else RANDOM_INIT


def _resolve_backbone_weights(name: str, pretrained: bool | str, weights: str | Path | None):
    if name in CVT_VARIANTS:
        return resolve_weights(pretrained, weights, model_name=name, hub_repo=CVT_VARIANTS[name].hub_repo)
    if name in VIT_REF_VARIANTS:  # no hub repo: "auto" finds nothing and falls back to random init with a warning
        return resolve_weights(pretrained, weights, model_name=name, hub_repo=None)
    pretrained_cfg = timm.models.get_pretrained_cfg(_timm_architecture(name))
    hub_repo = pretrained_cfg.hf_hub_id if pretrained_cfg else None
    hub_filenames = (
        (pretrained_cfg.hf_hub_filename,) if pretrained_cfg and pretrained_cfg.hf_hub_filename else HUB_WEIGHT_FILENAMES
    )
    return resolve_weights(pretrained, weights, model_name=name, hub_repo=hub_repo, hub_filenames=hub_filenames)


def is_backbone(name: str) -> bool:
    """Whether `create_backbone` builds `name`: one of this project's names or a timm model (a pretrained tag too)."""
    return name in CVT_VARIANTS or name in VIT_REF_VARIANTS or name in TIMM_ARCHITECTURES or timm.is_model(name)


def backbone_names() -> list[str]:
    """Every name `create_backbone` builds, without pretrained tags: this project's and timm's."""
    return [*BACKBONE_NAMES, *VIT_REF_VARIANTS, *timm.list_models()]


def _timm_architecture(name: str) -> str:
    if name in TIMM_ARCHITECTURES:
        return TIMM_ARCHITECTURES[name]
    if timm.is_model(name):
        return name
    raise ValueError(
        f"unknown backbone {name!r}: use one of {', '.join((*BACKBONE_NAMES, *VIT_REF_VARIANTS))} or any timm model "
        "name (see timm.list_models())"
    )


def _create_timm_model(architecture: str, resolved: ResolvedWeights | None, img_size: int | None) -> nn.Module:
    """A timm model without classifier (num_classes=0), with the resolved weights loaded through timm.

    timm's own `file=` loading drops the head by turning strict loading off for *all* keys, which would hide a
    wrong checkpoint. So state dicts are read here, the head is removed, and they are handed to timm as an in-memory
    `state_dict` with num_classes=0 on both sides: timm then applies the model's checkpoint filter (ViT position
    embedding interpolation) and loads strictly. Original big_vision .npz files go through timm's custom loader.
    """
    kwargs: dict = {"num_classes": 0}
    registered_cfg = timm.models.get_pretrained_cfg(architecture)
    if img_size is not None and registered_cfg is not None and registered_cfg.fixed_input_size:
        kwargs["img_size"] = img_size  # models without a fixed input size take any size as is
    if resolved is None:
        return timm.create_model(architecture, pretrained=False, **kwargs)
    path = resolved.path
    if path.suffix == ".npz":
        return _create_timm_from_npz(architecture, path, kwargs)
    classifier = registered_cfg.classifier if registered_cfg is not None else None
    head_names = (classifier,) if isinstance(classifier, str) else tuple(classifier or ())
    state_dict = without_prefixes(read_state_dict(path), head_names)
    overlay = {"state_dict": state_dict, "num_classes": 0, "custom_load": False, "source": None}
    try:
        model = timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except (RuntimeError, KeyError, ValueError, IndexError) as error:
        reference = timm.create_model(architecture, pretrained=False, **kwargs).state_dict()
        check_state_dict_fits(reference, state_dict, path, architecture)
        raise IncompatibleWeights(f"{path} does not fit {architecture}: {error}") from error
    model.pretrained_cfg["state_dict"] = None  # do not keep a second copy of the weights alive
    return model


def _create_timm_from_npz(architecture: str, path: Path, kwargs: dict) -> nn.Module:
    overlay = {"file": str(path), "custom_load": True, "num_classes": 0, "source": None}
    try:
        model = timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except AttributeError as error:  # timm calls model.load_pretrained, which only ViT-like models have
        raise IncompatibleWeights(
            f"{path}: .npz (big_vision) weights are readable only for timm ViT models, not {architecture}"
        ) from error
    except (RuntimeError, KeyError, ValueError) as error:
        raise IncompatibleWeights(f"{path} does not fit {architecture}: {type(error).__name__}: {error}") from error
    blocks_in_file = _npz_encoder_block_count(path)
    blocks = getattr(model, "blocks", None)
    if blocks is not None and blocks_in_file not in (0, len(blocks)):  # 0: stacked layout, checked by timm
        raise IncompatibleWeights(
            f"{path} does not fit {architecture}: it has {blocks_in_file} encoder blocks, the model {len(blocks)}"
        )
    return model


def _npz_encoder_block_count(path: Path) -> int:
    with np.load(path, allow_pickle=False) as archive:
        indices = {match.group(1) for key in archive.files if (match := re.search(r"encoderblock_(\d+)/", key))}
    return len(indices)


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


def load_reference_vit_weights(backbone: ReferenceVitBackbone, path: Path) -> None:
    """Load a timm ViT state dict of the variant's sizes strictly (its head dropped, position embeddings resampled
    to the input size); .npz files are not read for vit_ref."""
    state_dict = without_prefixes(read_state_dict(path), ("head",))
    try:
        backbone.model.load_timm_state_dict(state_dict)
    except (RuntimeError, ValueError) as error:
        raise IncompatibleWeights(f"{path} does not fit {backbone.architecture}: {error}") from error
