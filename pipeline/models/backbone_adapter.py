"""The adapter every backbone implements (`Backbone`), and the registry of backbone families that builds them.

An adapter is a module of features of width D (`num_features`): images (B, 3, H, W) -> pooled features, with its
parameters grouped stem to top (`parameter_groups`, for discriminative learning rates), the data config taken from
the model (input size, mean, std), its weights file layout (`weights_state`), and what the rest of the pipeline asks
of a family, so that nothing else knows one: where Grad-CAM hooks (`cam_layers`), which modules a shape trace shows
(`trace_patterns`), and how a device should train it (`FamilyTraits`: bf16 on a CPU, channels-last on a GPU).

A family is one module of `pipeline.models.backbone_families` that registers a `BackboneAdapter` (which backbone
names it builds, how, and where their weights come from) and the traits of the families its adapters report;
`pipeline.models.backbones` imports every module of that folder, so a new family is that one file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.parameter_groups import ParameterGroups
from pipeline.models.weights import ResolvedWeights
from pipeline.utils.devices import FamilyTraits


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


@dataclass(frozen=True)
class CamSpec:
    """A module Grad-CAM may hook, deepest first in a list: its name, the module, and how its output is laid out
    (`prefix_tokens`: tokens (B, prefix + H*W, C) after that many class tokens; None: a map (B, C, H, W))."""

    name: str
    module: nn.Module
    prefix_tokens: int | None


class Backbone(nn.Module):
    """The adapter every backbone implements: images (B, 3, H, W) -> pooled features (B, num_features)."""

    family: str  # a name of FAMILIES: what a plan records and a node checks it builds too

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

    def cam_layers(self) -> list[CamSpec]:
        """The modules Grad-CAM may hook, deepest first (`pipeline.analysis.gradcam` takes the deepest whose map
        has at least 2 x 2 cells)."""
        raise TypeError(f"no Grad-CAM layer known for backbone {self.name!r} ({type(self).__name__})")

    def trace_patterns(self) -> tuple[tuple[str, str], ...]:
        """(regex over module names inside the adapter, what its output is) of the modules a shape trace shows
        (`pipeline.models.cost.shape_trace`; attention weights are the inputs of the dropout after the softmax)."""
        return ()

    def trace_name(self, name: str) -> str:
        """How a shape trace names a module of the adapter (`name` inside it): without the wrapper's own prefix."""
        return name


def on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().contiguous() for key, value in state.items()}


@dataclass(frozen=True)
class BackboneAdapter:
    """How one family's backbones are built: `builds(name)`, whether it builds backbone `name`; `names`, the project
    names it offers by name (`make cv MODEL=`); `hub(name)`, where their pretrained weights are published (a hub repo
    and the file names to look for, or None); `build(name, resolved weights or None, img_size)`, the adapter with the
    weights loaded."""

    name: str
    builds: Callable[[str], bool]
    hub: Callable[[str], tuple[str | None, tuple[str, ...]]]
    build: Callable[[str, ResolvedWeights | None, int | None], Backbone]
    names: tuple[str, ...] = ()
    catch_all: bool = False  # asked after every other adapter (timm: any timm model name)


ADAPTERS: dict[str, BackboneAdapter] = {}
FAMILIES: dict[str, FamilyTraits] = {}


def register_adapter(adapter: BackboneAdapter, families: dict[str, FamilyTraits]) -> BackboneAdapter:
    """Add a family's adapter and the traits of the families its backbones report (a name taken is an error)."""
    if adapter.name in ADAPTERS:
        raise ValueError(f"a backbone adapter named {adapter.name!r} exists already")
    taken = sorted(set(families) & set(FAMILIES))
    if taken:
        raise ValueError(f"backbone families {taken} are registered already")
    ADAPTERS[adapter.name] = adapter
    FAMILIES.update(families)
    return adapter


def adapter_for(name: str) -> BackboneAdapter | None:
    """The adapter that builds backbone `name`: one that names it, else a catch-all that takes it (any timm model)."""
    ordered = sorted(ADAPTERS.values(), key=lambda adapter: adapter.catch_all)
    return next((adapter for adapter in ordered if adapter.builds(name)), None)


def family_traits(family: str) -> FamilyTraits:
    """The traits of a registered family; an unknown family is an error naming the known ones."""
    if family not in FAMILIES:
        raise ValueError(f"unknown backbone family {family!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family]
