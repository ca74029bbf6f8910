"""ONNX export: ONNX Runtime gives PyTorch's logits for each of the three backbones (random weights, small inputs)."""

from __future__ import annotations

import pytest
import torch

from pipeline.deployment.export import export_onnx, onnx_difference
from pipeline.models.backbones import create_model


@pytest.mark.parametrize(("name", "img_size"), [("vit_b16", 32), ("cvt_13", 64), ("mobilevit_s", 64)])
def test_onnx_runtime_gives_the_pytorch_logits(name: str, img_size: int, tmp_path) -> None:
    torch.manual_seed(0)
    net, _ = create_model(name, n_classes=2, pretrained=False, img_size=img_size)
    path = export_onnx(net, img_size, tmp_path / f"{name}.onnx")
    assert path.stat().st_size > 0
    assert onnx_difference(net, path, img_size, batch=3) < 1e-4  # a batch size other than the traced one
