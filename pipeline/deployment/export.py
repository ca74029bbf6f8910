"""`make export MODEL_URI=... FORMAT=onnx`: the network of a trained model as ONNX, for bedside or edge runtimes.

What is exported is the network alone: a face crop batch (N, 3, H, W), normalised with the model's mean and std, in;
logits (N, n_classes) out, the batch size free. Face detection, alignment and the crop stay outside (they are
OpenCV and MTCNN, not the network); a JSON file beside the ONNX file says how to make the input (input size, mean,
std, interpolation, crop settings) and how to decide (class names, threshold, video aggregation). The export uses
torch's TorchScript-based exporter: for these backbones it gave ONNX Runtime outputs within 2e-6 of PyTorch's and
exported several times faster than the dynamo exporter on a 2-core CPU.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from pipeline.models.backbones import PainNet
from pipeline.models.model_file import data_config_of
from pipeline.utils.atomic_io import atomic_path, atomic_write_text
from pipeline.utils.paths import resolve_path

OPSET = 17
FORMATS = ("onnx",)


def export_onnx(net: PainNet, img_size: int, path: Path, opset: int = OPSET) -> Path:
    """Write `net` (eval mode, CPU) as ONNX with input `image` and output `logits`, batch size dynamic."""
    net = net.eval().cpu()
    example = torch.zeros(1, 3, img_size, img_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".onnx") as tmp, torch.no_grad():
        torch.onnx.export(net, (example,), str(tmp), input_names=["image"], output_names=["logits"],
                          dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                          dynamo=False)
    return path


def onnx_difference(net: PainNet, path: Path, img_size: int, batch: int = 3, seed: int = 0) -> float:
    """Largest absolute difference between ONNX Runtime's and PyTorch's logits on a random batch."""
    import onnxruntime

    images = torch.from_numpy(np.random.default_rng(seed).standard_normal((batch, 3, img_size, img_size),
                                                                           dtype=np.float32))
    with torch.no_grad():
        expected = net.eval().cpu()(images).numpy()
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"image": images.numpy()})[0]
    return float(np.abs(got - expected).max())


def input_contract(scorer, source: str) -> dict:
    """What a runtime needs besides the network: how to make its input, how to read its output."""
    data_config = data_config_of(scorer.meta)
    return {"source": source, "input": "image", "output": "logits", "layout": "NCHW float32 RGB",
            "input_size": list(data_config.input_size), "mean": list(data_config.mean), "std": list(data_config.std),
            "interpolation": data_config.interpolation,
            "crop_fraction": (scorer.meta.get("loader") or {}).get("crop_fraction") or 1.0,
            "face_crop": asdict(scorer.settings), "class_names": scorer.class_names,
            "pain_probability": "1 - softmax(logits)[class 'BL1']", "threshold": scorer.threshold,
            "video_aggregation": scorer.aggregation, "model": scorer.meta.get("model_name")}


def run_export(cfg: DictConfig, model_uri: str | None = None, run: str | None = None, format: str = "onnx",
               out: str | None = None) -> Path:
    """`make export [MODEL_URI=...] [FORMAT=onnx] [OUT=folder]`: default the champion of MODEL / TASK."""
    from pipeline.deployment.predict import PredictError, load_scorer

    if format not in FORMATS:
        raise SystemExit(f"export: FORMAT={format!r} is not supported; choose one of {', '.join(FORMATS)}")
    try:
        scorer, name = load_scorer(cfg, model_uri or None, run or None)
    except PredictError as error:
        raise SystemExit(f"export: {error}") from None
    out_dir = Path(out).expanduser().resolve() if out else resolve_path(cfg.reports_dir) / "export"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name.removeprefix("models:/")).strip("_")
    img_size = int(data_config_of(scorer.meta).input_size[1])
    path = export_onnx(scorer.net, img_size, out_dir / f"{stem}.onnx")
    difference = onnx_difference(scorer.net, path, img_size)
    contract = input_contract(scorer, name) | {"max_abs_difference_to_pytorch": difference}
    atomic_write_text(path.with_suffix(".json"), json.dumps(contract, indent=2) + "\n")
    print(f"{name} -> {path} ({path.stat().st_size / 1e6:.1f} MB) and its input contract {path.with_suffix('.json')}; "
          f"ONNX Runtime vs PyTorch: max |difference| {difference:.2e}")
    return path
