"""The timm family: any timm model (`timm.create_model` with num_classes=0, its pooled pre-logits features), under
its own name or a project name (`TIMM_ARCHITECTURES`: the pretrained tag whose weights a project backbone starts
from). Its families: `vit` (a timm VisionTransformer: bf16 pays on a CPU, channels-last does not on a GPU) and `timm`
(everything else). The data config, Grad-CAM's feature maps and the weights' hub entry come from the model's own
description (`pretrained_cfg`, `feature_info`), never from its name.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pipeline.models.backbone_adapter import (
    Backbone,
    BackboneAdapter,
    CamSpec,
    DataConfig,
    on_cpu,
    register_adapter,
)
from pipeline.models.introspection import vit_of
from pipeline.models.parameter_groups import ParameterGroups, check_groups_cover, child_groups, timm_matcher_groups
from pipeline.models.weights import (
    HUB_WEIGHT_FILENAMES,
    IncompatibleWeights,
    ResolvedWeights,
    check_state_dict_fits,
    read_state_dict,
    without_prefixes,
)
from pipeline.utils.devices import FamilyTraits

PLAIN_VIT, OTHER_TIMM = "vit", "timm"

# Project names of timm backbones -> timm model name with the pretrained tag whose weights we start from.
TIMM_ARCHITECTURES = {
    "vit_b16": "vit_base_patch16_224.augreg_in21k",  # ImageNet-21k pretraining, no 1k fine-tuning
    "mobilevit_s": "mobilevit_s.cvnets_in1k",
    "mobilevit_xs": "mobilevit_xs.cvnets_in1k",
    "mobilevit_xxs": "mobilevit_xxs.cvnets_in1k",
}

# Modules whose outputs a shape trace shows (names inside the adapter): timm's ViTs, MobileViT, ResNets and the
# course's reference ViT (the same names under `model`). Attention weights are the inputs of the dropout after the
# softmax.
MODEL_TRACE = (
    (r"model\.(patch_embed|pos_drop|norm|stem|final_conv)", "output"),
    (r"model\.blocks\.\d+", "output"),
    (r"model\.blocks\.\d+\.attn\.attn_drop", "attention weights"),
    (r"model\.stages\.\d+", "output"),
    (r"model\.stages\.\d+\.\d+\.transformer", "tokens inside a MobileViT block"),
    (r"model\.stages\.\d+\.\d+\.transformer\.\d+\.attn\.attn_drop", "attention weights"),
    (r"model\.layer\d+", "output"),
)


def vit_like(model: nn.Module) -> nn.Module | None:
    """A timm ViT, or a model built like one (a class token, blocks with `norm1`: the course's reference ViT)."""
    vit = vit_of(model)
    if vit is not None:
        return vit
    blocks = getattr(model, "blocks", None)
    if getattr(model, "cls_token", None) is not None and blocks is not None and hasattr(blocks[-1], "norm1"):
        return model
    return None


def vit_cam_layers(vit: nn.Module) -> list[CamSpec]:
    """Each block's `norm1`, deepest first: tokens after the model's prefix (class) tokens."""
    prefix = int(getattr(vit, "num_prefix_tokens", 1))
    return [CamSpec(f"blocks.{index}.norm1", block.norm1, prefix)
            for index, block in reversed(list(enumerate(vit.blocks)))]


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
        return on_cpu(self.model.state_dict())

    def parameter_groups(self) -> ParameterGroups:
        matcher = self.model.group_matcher(coarse=False) if hasattr(self.model, "group_matcher") else None
        if isinstance(matcher, dict):
            groups = timm_matcher_groups(self.model.named_parameters(), matcher)
        else:
            groups = child_groups(self.model)
        check_groups_cover(self, groups)
        return groups

    def cam_layers(self) -> list[CamSpec]:
        """A ViT (or a model built like one: a class token, blocks with `norm1`): each block's `norm1`, its input to
        attention, where the class token still reads the patches. Any other model: its last feature map
        (`final_conv`), then the stages timm lists in its own `feature_info`, top first."""
        vit = vit_like(self.model)
        if vit is not None:
            return vit_cam_layers(vit)
        model, layers = self.model, []
        if isinstance(getattr(model, "final_conv", None), nn.Module) and not isinstance(model.final_conv, nn.Identity):
            layers.append(CamSpec("final_conv", model.final_conv, None))
        for info in reversed(list(getattr(model, "feature_info", None) or [])):  # timm's feature maps, stem to top
            name = info.get("module") if isinstance(info, dict) else None
            if name:
                layers.append(CamSpec(name, model.get_submodule(name), None))
        unique, seen = [], set()
        for layer in layers:  # final_conv is often timm's last feature_info entry too
            if id(layer.module) not in seen:
                seen.add(id(layer.module))
                unique.append(layer)
        return unique or super().cam_layers()

    def trace_patterns(self) -> tuple[tuple[str, str], ...]:
        return MODEL_TRACE

    def trace_name(self, name: str) -> str:
        return name.removeprefix("model.")


def _timm_architecture(name: str) -> str:
    if name in TIMM_ARCHITECTURES:
        return TIMM_ARCHITECTURES[name]
    if timm.is_model(name):
        return name
    raise ValueError(f"unknown timm model {name!r} (see timm.list_models())")


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


def hub_entry(name: str) -> tuple[str | None, tuple[str, ...]]:
    """Where a timm model's pretrained weights are published: its `pretrained_cfg`'s hub repo and file name."""
    pretrained_cfg = timm.models.get_pretrained_cfg(_timm_architecture(name))
    hub_repo = pretrained_cfg.hf_hub_id if pretrained_cfg else None
    hub_filenames = (
        (pretrained_cfg.hf_hub_filename,) if pretrained_cfg and pretrained_cfg.hf_hub_filename else HUB_WEIGHT_FILENAMES
    )
    return hub_repo, hub_filenames


def _build(name: str, resolved: ResolvedWeights | None, img_size: int | None) -> Backbone:
    return TimmBackbone(name, _create_timm_model(_timm_architecture(name), resolved, img_size), img_size)


register_adapter(BackboneAdapter("timm", lambda name: name in TIMM_ARCHITECTURES or timm.is_model(name), hub_entry,
                                 _build, names=tuple(TIMM_ARCHITECTURES), catch_all=True),
                 {PLAIN_VIT: FamilyTraits(bf16_on_cpu=True, channels_last_on_gpu=False),
                  OTHER_TIMM: FamilyTraits(bf16_on_cpu=False, channels_last_on_gpu=True)})
