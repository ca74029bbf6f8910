"""Kept fold models: one self-describing file per fold that rebuilds a ready `PainNet` with nothing else.

A kept model is a plain dict saved with `torch.save` and read back with `torch.load(..., weights_only=True)` (no
pickled classes, so loading a file from someone else's run executes no code): the network's state dict and a
`meta` dict of plain values, namely backbone name, input size, class names, task, the data settings the model was
trained on (crop window, crop fraction, crops per clip, mean/std), the weights it started from and where it ran.

A clip model (`ClipNet`: a frame backbone and a temporal head, `pipeline.models.temporal_heads`) carries its head's
settings in `meta["head"]`, its clip length in `meta["loader"]["clip_frames"]` and the seconds between its training
clips' crops in `meta["loader"]["clip_spacing_s"]`; a frame model has none of them. A frame model with an ordinal or
regression output records it in `meta["output"]` (`OutputConfig.meta`; absent: softmax) and is rebuilt with it; a
personalised one its protocol in `meta["personalise"]` (`PersonaliseConfig.meta`; absent: none), which the scorer reads.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn

from pipeline.models.backbone_adapter import DataConfig
from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.ordinal import OutputConfig
from pipeline.models.temporal_heads import ClipNet, HeadConfig
from pipeline.utils.atomic_io import atomic_path

FORMAT = "painvit.fold_model/1"
MODEL_ARTIFACT = "model/model.pt"  # where a child run keeps its fold's model
# the data settings a kept model records; a clip model's also the seconds between its training clips' crops
LOADER_KEYS = ("crop_fraction", "from_s", "frames_per_video", "clip_frames", "clip_spacing_s")


def model_meta(net: PainNet | ClipNet, *, model_name: str, img_size: int | None, class_names: list[str], task: str,
               loader: dict[str, Any], weights: dict[str, str], **extra: Any) -> dict[str, Any]:
    """The plain-value description that travels inside a kept model."""
    data_config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(net.backbone.data_config).items()}
    return {"model_name": model_name, "architecture": net.backbone.architecture, "img_size": img_size,
            "class_names": list(class_names), "task": task, "data_config": data_config,
            "loader": {k: loader.get(k) for k in LOADER_KEYS if k in loader or k != "clip_spacing_s"},
            "weights": dict(weights), **extra}


def save_model_file(net: nn.Module, meta: dict[str, Any], path: Path) -> Path:
    """Write the kept model atomically (a killed job leaves the old file or none, never half of one)."""
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in net.state_dict().items()}
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT, "state_dict": state, "meta": meta}, tmp)
    return path


def load_model_file(source: str | Path, tracking_uri: str | None = None) -> tuple[PainNet | ClipNet, dict[str, Any]]:
    """A kept model as a ready `PainNet`, or `ClipNet` for a clip model (eval mode, on the CPU), plus its `meta`.

    `source` is a file path, or an MLflow child run id (or `runs:/<id>`) whose `model/model.pt` is downloaded.
    """
    path = Path(source)
    if not path.is_file():
        import mlflow

        run_id = str(source).removeprefix("runs:/").split("/")[0]
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        path = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=MODEL_ARTIFACT))
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kept fold model (format {FORMAT})")
    meta = saved["meta"]
    net = _net_without_init(meta, saved["state_dict"])
    if net is None:
        net = _build_net(meta)
        net.load_state_dict(saved["state_dict"], strict=True)
    return net.eval(), meta


def _build_net(meta: dict[str, Any]) -> PainNet | ClipNet:
    """The network `meta` describes, freshly initialised (on the current default device)."""
    head = HeadConfig.from_model_file(meta["head"]) if meta.get("head") else None
    net, _ = create_model(meta["model_name"], len(meta["class_names"]), pretrained=False, img_size=meta["img_size"],
                          head=head, output=OutputConfig.from_config(meta.get("output")))
    return net


def _net_without_init(meta: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> PainNet | ClipNet | None:
    """The network with its parameters made on the meta device (`accelerate.init_empty_weights`; buffers and other
    tensors are made as usual, so non-persistent ones are real) and then given the file's tensors: no random
    initialisation paid for and overwritten (0.6 s of `make predict`'s start for ViT-B/16 on 2 cores). Loading is
    strict, so no parameter stays on the meta device. None for a model whose construction cannot run that way (one
    that reads a parameter's value); the caller then builds it the ordinary way."""
    try:
        with init_empty_weights(include_buffers=False):
            net = _build_net(meta)
    except Exception:  # noqa: BLE001 - a real error of the model's own surfaces again from the ordinary build
        return None
    net.load_state_dict(state_dict, strict=True, assign=True)
    return net


def clip_frames_of(meta: dict[str, Any]) -> int | None:
    """A clip model's clip length (crops per window); None for a frame model."""
    return int(meta["loader"]["clip_frames"]) if meta.get("head") else None


def clip_spacing_of(meta: dict[str, Any]) -> float | None:
    """The seconds between a clip model's training clips' crops (`loader.clip_spacing_s`, `clips.clip_spacing_s`);
    None for a frame model or one kept before the spacing was recorded."""
    value = (meta.get("loader") or {}).get("clip_spacing_s") if meta.get("head") else None
    return float(value) if value else None


def data_config_of(meta: dict[str, Any]) -> DataConfig:
    """The kept model's data config (input size, mean, std, interpolation) as the backbone adapter's type."""
    values = meta["data_config"]
    return DataConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
