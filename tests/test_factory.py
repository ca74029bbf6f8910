"""The one model factory (`pipeline.models.factory`): what it composes, in which order, and the weights layout each
backbone adapter owns."""

from __future__ import annotations

import pytest
import timm
import torch

from pipeline.models.backbone_families.reference_vit import ReferenceVitBackbone
from pipeline.models.backbones import PainNet, create_backbone
from pipeline.models.factory import create_model
from pipeline.models.finetune import FinetuneConfig, LoraSettings, strategy_for
from pipeline.models.temporal_heads import ClipNet, build_temporal_head
from tests.conftest import head_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZES = {"hidden": 8, "layers": 1, "attention_heads": 2, "dropout": 0.0, "max_frames": 8}
GRU = head_config(name="gru", **SIZES)


def test_a_seeded_clip_model_draws_the_weights_of_its_parts_built_in_order() -> None:
    """Backbone, then the linear head, then the temporal head: a seeded build draws what the callers drew before
    the factory existed (a fold, a kept model read back, the bench scripts)."""
    torch.manual_seed(3)
    net, _ = create_model("mobilevit_xxs", 2, img_size=32, head=GRU)
    torch.manual_seed(3)
    backbone, _ = create_backbone("mobilevit_xxs", img_size=32)
    PainNet(backbone, 2)
    by_hand = ClipNet(backbone, build_temporal_head(GRU, backbone.num_features, 2))
    assert isinstance(net, ClipNet)
    assert net.state_dict().keys() == by_hand.state_dict().keys()
    assert all(torch.equal(value, by_hand.state_dict()[key]) for key, value in net.state_dict().items())


def test_a_linear_head_is_a_frame_model_and_the_strategy_is_prepared() -> None:
    frozen = FinetuneConfig("frozen", None, LoraSettings(8, 16.0, 0.0, ".*"), cache_embeddings=False)
    net, _ = create_model("mobilevit_xxs", 2, img_size=32, head=head_config(name="linear", **SIZES),
                          strategy=strategy_for(frozen), channels_last=True)
    assert isinstance(net, PainNet)
    assert not any(p.requires_grad for p in net.backbone.parameters())  # frozen: the strategy ran on it
    assert all(p.requires_grad for p in net.head.parameters())
    convolutions = [p for p in net.backbone.parameters() if p.dim() == 4]
    assert convolutions and all(p.is_contiguous(memory_format=torch.channels_last) for p in convolutions)


def test_each_adapter_writes_the_layout_its_weights_are_read_in() -> None:
    backbone, _ = create_backbone("mobilevit_xxs", img_size=32)
    state = backbone.weights_state()
    fresh = timm.create_model("mobilevit_xxs", num_classes=0)
    assert state.keys() == fresh.state_dict().keys()  # timm's own layout, no classifier
    assert all(value.device.type == "cpu" for value in state.values())
    reference = create_backbone("vit_ref", img_size=32)[0]
    assert isinstance(reference, ReferenceVitBackbone)
    with pytest.raises(NotImplementedError, match="vit_ref"):
        reference.weights_state()
