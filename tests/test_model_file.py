"""A kept model file is rebuilt into the network it holds: its parameters made on the meta device and given the file's
tensors (no random initialisation paid for, then overwritten), with buffers the file does not carry made as usual."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.models import model_file
from pipeline.models.factory import create_model
from pipeline.models.model_file import load_model_file, model_meta, save_model_file
from pipeline.models.temporal_heads import ClipNet, HeadConfig, build_temporal_head
from pipeline.runs.store import tracking

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEAD = {"name": "gru", "mode": "two_stage", "hidden": 8, "layers": 1, "attention_heads": 2, "dropout": 0.0,
        "max_frames": 4, "epochs": 1, "patience": 1}


def saved(tmp_path: Path, name: str, img_size: int, head: dict | None = None) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    net, source = create_model(name, n_classes=2, pretrained=False, img_size=img_size)
    extra = {}
    if head:
        net = ClipNet(net.backbone, build_temporal_head(HeadConfig.from_model_file(head), net.backbone.num_features, 2))
        extra["head"] = head
    meta = model_meta(net, model_name=name, img_size=img_size, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={"crop_fraction": 1.0, "clip_frames": 3 if head else None},
                      weights=tracking.weights_tags(source),
                      **extra)
    return net.eval(), save_model_file(net, meta, tmp_path / f"{name}.pt")


@pytest.mark.parametrize(("name", "img_size", "head"), [
    ("mobilevit_xxs", 32, None), ("cvt_13", 32, None), ("vit_ref", 32, None), ("vit_tiny_patch16_224", 32, None),
    ("mobilevit_xxs", 32, HEAD),
])
def test_a_kept_model_is_rebuilt_without_a_random_initialisation(tmp_path: Path, name: str, img_size: int,
                                                                  head: dict | None) -> None:
    net, path = saved(tmp_path, name, img_size, head)
    stored = torch.load(path, weights_only=True)
    assert model_file._net_without_init(stored["meta"], stored["state_dict"]) is not None  # the meta-device path
    loaded, _ = load_model_file(path)
    assert not loaded.training
    assert not any(t.is_meta for t in (*loaded.parameters(), *loaded.buffers()))
    inputs = torch.randn(2, 3, 3, img_size, img_size) if head else torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        assert torch.equal(loaded(inputs), net(inputs))


def test_a_model_that_keeps_a_tensor_its_file_lacks_is_rebuilt_exactly(tmp_path: Path) -> None:
    # EVA-02's rotary position tables are non-persistent buffers computed at construction: only the parameters are
    # made on the meta device, so the tables are real and the model equals the saved one
    net, path = saved(tmp_path, "eva02_tiny_patch14_224", 28)
    stored = torch.load(path, weights_only=True)
    fast = model_file._net_without_init(stored["meta"], stored["state_dict"])
    assert fast is not None and not any(t.is_meta for t in (*fast.parameters(), *fast.buffers()))
    loaded, _ = load_model_file(path)
    images = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded(images), net(images))
