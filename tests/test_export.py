"""ONNX export: ONNX Runtime gives PyTorch's logits for each of the three backbones and for clip models with each
temporal head (random weights, small inputs)."""

from __future__ import annotations

import pytest
import torch

from pipeline.deployment.export import export_onnx, onnx_difference
from pipeline.models.factory import create_model
from pipeline.models.temporal_heads import ClipNet, build_temporal_head
from tests.conftest import head_config


@pytest.mark.parametrize(("name", "img_size"), [("vit_b16", 32), ("cvt_13", 64), ("mobilevit_s", 64)])
def test_onnx_runtime_gives_the_pytorch_logits(name: str, img_size: int, tmp_path) -> None:
    torch.manual_seed(0)
    net, _ = create_model(name, n_classes=2, pretrained=False, img_size=img_size)
    path = export_onnx(net, img_size, tmp_path / f"{name}.onnx")
    assert path.stat().st_size > 0
    assert onnx_difference(net, path, img_size, batch=3) < 1e-4  # a batch size other than the traced one


@pytest.mark.parametrize("head", ["attention", "gru", "transformer"])
def test_a_clip_model_exports_whole_and_onnx_runtime_gives_its_logits_for_any_clip_length(head: str,
                                                                                         tmp_path) -> None:
    torch.manual_seed(0)
    frame_net, _ = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    config = head_config(name=head, hidden=16, layers=1, attention_heads=2, dropout=0.0, max_frames=8)
    net = ClipNet(frame_net.backbone, build_temporal_head(config, frame_net.backbone.num_features, 2))
    path = export_onnx(net, 32, tmp_path / f"{head}.onnx")
    # traced with a batch of one 2-frame clip; scored with other batch sizes and clip lengths, a window's 1 included
    for frames in (8, 3, 1):
        assert onnx_difference(net, path, 32, batch=2, frames=frames) < 1e-4
