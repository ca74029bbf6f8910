"""The one model factory: a network of the project composed from its parts, in one place, as timm's `create_model`
composes its models.

`create_model(name, n_classes, ...)` builds the backbone adapter (`pipeline.models.backbones.create_backbone`: timm,
transformers' CvT or the reference ViT, with its weights resolved by `pipeline.models.weights`), puts a fresh
`Linear(D, n_classes)` head on it (`PainNet`, a frame model; `output` an ordinal or regression output:
`pipeline.models.ordinal.build_output_head` over the task's levels instead), wraps it with a temporal head when `head`
names one (`ClipNet`, a clip model: `pipeline.models.temporal_heads`), prepares it for its fine-tuning strategy
(`pipeline.models.finetune`: what trains, adapters) and puts it in channels-last memory when asked. Every caller builds
its network here: a fold, a trial and the final model (through `pipeline.runs.jobs.fold_job.build_network`, which also
checks the planned weights), `make pretrain`, a kept model read back (`pipeline.models.model_file`), the cost
calculator, `make inspect`'s untrained baseline and the bench scripts. `clip_model` is the one place a `ClipNet` is put
together from a backbone and a head that exist already (a two-stage fold's trained head on its frame backbone).

The order of construction is part of the contract: the backbone, then the linear head, then a temporal head, so that
a seeded build draws the same initial weights whoever builds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeline.models.backbones import PainNet, create_backbone
from pipeline.models.ordinal import OutputConfig, build_output_head
from pipeline.models.temporal_heads import ClipNet, HeadConfig, build_temporal_head
from pipeline.models.weights import WeightsSource

if TYPE_CHECKING:  # peft's import takes a second: a kept model read back for scoring needs no strategy
    from pipeline.models.finetune import FinetuneStrategy


def create_model(name: str, n_classes: int = 2, *, pretrained: bool | str = False, weights: str | Path | None = None,
                 img_size: int | None = None, head: HeadConfig | None = None,
                 strategy: FinetuneStrategy | None = None, channels_last: bool = False,
                 output: OutputConfig | None = None) -> tuple[PainNet | ClipNet, WeightsSource]:
    """The network of backbone `name` (one of `backbones.backbone_names()` or any timm model name) and where its
    weights came from.

    `pretrained` / `weights` / `img_size`: as `create_backbone` takes them. `head`: a temporal head (anything but
    `linear`) makes a clip model, the frame backbone under that head; None or `linear`: the frame model. `strategy`:
    prepared on the network (what trains; LoRA adapters injected). `channels_last`: the network's weights in
    channels-last memory (and a clip model's frames run so). `output`: the last layer (None or softmax: the
    `Linear(D, n_classes)` the network always had; ordinal or regression over `n_classes` levels, of a frame model or
    of its temporal head)."""
    output = output or OutputConfig("softmax")
    backbone, source = create_backbone(name, pretrained=pretrained, weights=weights, img_size=img_size)
    last = build_output_head(output, backbone.num_features, n_classes) if output.over_levels else None
    net: PainNet | ClipNet = PainNet(backbone, n_classes, last)
    if head is not None and head.temporal:
        net = clip_model(backbone, build_temporal_head(head, backbone.num_features, n_classes, output))
    if strategy is not None:
        strategy.prepare(net)
    if channels_last:
        net = in_channels_last(net)
    return net, source


def clip_model(backbone: nn.Module, head: nn.Module, channels_last: bool = False) -> ClipNet:
    """A clip model of a frame backbone and a temporal head that exist already."""
    return ClipNet(backbone, head, channels_last=channels_last)


def in_channels_last(net: PainNet | ClipNet) -> PainNet | ClipNet:
    """The network's weights in channels-last memory; a clip model runs its frames so too."""
    net = net.to(memory_format=torch.channels_last)
    if isinstance(net, ClipNet):
        net.channels_last = True
    return net
