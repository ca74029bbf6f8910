"""Interchangeable backbones behind one adapter (`pipeline.models.backbone_adapter.Backbone`): pooled features of
width D, parameter groups, data config, and what Grad-CAM, the cost counter and a device ask of a family.

The families are modules of `pipeline.models.backbone_families`, each registering an adapter: `timm_models` (any timm
model; ViT-B/16 and the MobileViTs by project name), `cvt` (CvT from Hugging Face transformers, which timm lacks),
`reference_vit` (the course's reference ViT, trained from scratch). This module imports every module of that folder
(`FAMILY_MODULES`), so a new family is one file there. Weights are resolved by `pipeline.models.weights`; the source
classifier head is always dropped and a fresh `nn.Linear` head is put on top (`PainNet`).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path

import torch
from torch import nn

from pipeline.models import backbone_families
from pipeline.models.backbone_adapter import ADAPTERS, Backbone, BackboneAdapter, adapter_for
from pipeline.models.weights import RANDOM_INIT, WeightsSource, resolve_weights

logger = logging.getLogger(__name__)

# Every family module, imported once: each registers its adapter (`backbone_adapter.register_adapter`).
FAMILY_MODULES = [importlib.import_module(f"{backbone_families.__name__}.{module.name}")
                  for module in sorted(pkgutil.iter_modules(backbone_families.__path__), key=lambda m: m.name)]


def backbone_names() -> tuple[str, ...]:
    """The backbones the families offer by a project name (`make cv MODEL=`); any timm model name works too."""
    return tuple(name for adapter in ADAPTERS.values() for name in adapter.names)


class PainNet(nn.Module):
    """A backbone with a freshly initialised linear head: images -> logits (B, n_classes); or with the output head
    given (`pipeline.models.ordinal.build_output_head`: an ordinal or regression head over the task's levels)."""

    def __init__(self, backbone: Backbone, n_classes: int, head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, n_classes) if head is None else head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


def is_backbone(name: str) -> bool:
    """Whether `create_backbone` builds `name`: a family's project name or a timm model (a pretrained tag too)."""
    return adapter_for(name) is not None


def adapter_of(name: str) -> BackboneAdapter:
    """The adapter that builds backbone `name`, or an error naming what exists."""
    adapter = adapter_for(name)
    if adapter is None:
        raise ValueError(f"unknown backbone {name!r}: use one of {', '.join(backbone_names())} or any timm model "
                         "name (see timm.list_models())")
    return adapter


def create_backbone(
    name: str,
    *,
    pretrained: bool | str = False,
    weights: str | Path | None = None,
    img_size: int | None = None,
) -> tuple[Backbone, WeightsSource]:
    """Build backbone `name` (a project name of `backbone_names()` or any timm model name) and load its pretrained
    weights.

    pretrained: True (weights file/folder, else the hub cache, else WeightsUnavailable), False (random init) or
    "auto" (random init with a loud warning when no weights are found). img_size overrides the input size; ViT
    position embeddings are interpolated to it and data_config.input_size follows.
    """
    adapter = adapter_of(name)
    resolved = _resolve_backbone_weights(adapter, name, pretrained, weights)
    backbone = adapter.build(name, resolved, img_size)
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
    resolved = _resolve_backbone_weights(adapter_of(name), name, pretrained, weights)
    return resolved.source if resolved is not None else RANDOM_INIT


def _resolve_backbone_weights(adapter: BackboneAdapter, name: str, pretrained: bool | str,
                              weights: str | Path | None):
    hub_repo, hub_filenames = adapter.hub(name)
    if hub_repo is None:  # no hub repo: "auto" finds nothing and falls back to random init with a warning
        return resolve_weights(pretrained, weights, model_name=name, hub_repo=None)
    return resolve_weights(pretrained, weights, model_name=name, hub_repo=hub_repo, hub_filenames=hub_filenames)
