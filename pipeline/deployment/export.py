"""`make export [MODEL_URI=... | RUN=...] FORMAT=onnx`: the network of a trained model as ONNX, for bedside or edge
runtimes.

What is exported is the network alone: a face crop batch (N, 3, H, W), normalised with the model's mean and std, in;
logits (N, n_classes) out, the batch size free. Face detection, alignment and the crop stay outside (they are
OpenCV and MTCNN, not the network). A JSON file beside the ONNX file, the input contract, states every step between a
video frame and the network's input, with the numbers and the OpenCV call of each: the detector and its settings, the
alignment's target points, fit and warp (interpolation, border), the JPEG round trip the project scores on, then the
evaluation transform for a crop of the contract's crop size (central crop box, the resize and its OpenCV
interpolation, normalisation, layout); and how to decide (class names, threshold, video aggregation). An
implementation with only NumPy, OpenCV and ONNX Runtime that reads the contract gets the project's probabilities
(`tests/test_onnx_contract.py`). The export uses torch's TorchScript-based exporter: for these backbones it gave ONNX
Runtime outputs within 2e-6 of PyTorch's and exported several times faster than the dynamo exporter on a 2-core CPU.

A clip model (`ClipNet`: the frame backbone and its temporal head) is exported whole: a clip (N, T, 3, H, W) of a
face's crops in time order in, logits (N, n_classes) out, with N and T free (the scorer's window holds fewer than T
crops at the start of a video; a transformer head takes T up to its `max_frames`). Its input contract says T and how
the timeline's windows are made.

A frame model with an ordinal or regression output (`model/output=ordinal|regression`) is exported with its head
decoding (`ordinal.LevelProbabilities`): its output is `level_probabilities` (N, K), the probabilities of the task's
levels in class order (non-negative, summing to 1), not logits; the contract's `output` names it and its
`pain_probability` says how to read it (the sum over the levels >= the model's pain level; at level 1, 1 - P(BL1)).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from pipeline.data.augment import eval_transform_steps
from pipeline.data.personalise import not_served
from pipeline.models.backbones import PainNet
from pipeline.models.model_file import clip_spacing_of, data_config_of
from pipeline.models.ordinal import LevelHead, LevelProbabilities
from pipeline.models.scoring import FrameScorer, crop_contract
from pipeline.models.temporal_heads import ClipNet
from pipeline.utils.atomic_io import atomic_path, atomic_write_text
from pipeline.utils.paths import resolve_path

OPSET = 17
CONTRACT_VERSION = 3  # 3: a clip model's window spacing; 2: the face crop and the evaluation transform step by step
FORMATS = ("onnx",)


def input_name(net: PainNet | ClipNet) -> str:
    """The ONNX input's name: `clip` (N, T, 3, H, W) for a clip model, `image` (N, 3, H, W) for a frame model."""
    return "clip" if isinstance(net, ClipNet) else "image"


LEVEL_OUTPUT = "level_probabilities"  # an ordinal or regression model's ONNX output; a softmax model's is "logits"


def exported_network(net: PainNet | ClipNet) -> PainNet | ClipNet:
    """What is exported of `net`: itself (its logits), or for an ordinal or regression head (of a frame model or a
    clip model's temporal head) the same backbone under `LevelProbabilities(head)` (its level probabilities), sharing
    the weights."""
    if isinstance(net, PainNet) and isinstance(net.head, LevelHead):
        return PainNet(net.backbone, net.head.n_levels, LevelProbabilities(net.head))
    if isinstance(net, ClipNet) and isinstance(net.head, LevelHead):  # a temporal head over levels (`ClipLevels`)
        return ClipNet(net.backbone, LevelProbabilities(net.head), channels_last=net.channels_last)
    return net


def output_name(net: PainNet | ClipNet) -> str:
    """The ONNX output's name: `level_probabilities` for an ordinal or regression model, else `logits`."""
    return LEVEL_OUTPUT if isinstance(exported_network(net).head, LevelProbabilities) else "logits"


def example_input(net: PainNet | ClipNet, img_size: int, batch: int = 1, frames: int = 2,
                  rng: np.random.Generator | None = None) -> torch.Tensor:
    """A batch of the network's input shape: zeros, or standard-normal draws of `rng`."""
    shape = (batch, frames, 3, img_size, img_size) if isinstance(net, ClipNet) else (batch, 3, img_size, img_size)
    if rng is None:
        return torch.zeros(shape)
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def export_onnx(net: PainNet | ClipNet, img_size: int, path: Path, opset: int = OPSET) -> Path:
    """Write `net` (eval mode, CPU) as ONNX with input `image` (a clip model: `clip`) and output `logits` (an ordinal
    or regression model: `level_probabilities`, `exported_network`); the batch size (and a clip's length) dynamic."""
    output = output_name(net)
    net = exported_network(net.eval().cpu())
    name = input_name(net)
    axes = {0: "batch", 1: "frames"} if isinstance(net, ClipNet) else {0: "batch"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".onnx") as tmp, torch.no_grad():
        torch.onnx.export(net, (example_input(net, img_size),), str(tmp), input_names=[name],
                          output_names=[output], dynamic_axes={name: axes, output: {0: "batch"}},
                          opset_version=opset, dynamo=False)
    return path


def onnx_difference(net: PainNet | ClipNet, path: Path, img_size: int, batch: int = 3, seed: int = 0,
                    frames: int = 3) -> float:
    """Largest absolute difference between ONNX Runtime's and PyTorch's output (logits, or an ordinal model's level
    probabilities) on a random batch (of clips of `frames` crops for a clip model)."""
    import onnxruntime

    inputs = example_input(net, img_size, batch, frames, np.random.default_rng(seed))
    with torch.no_grad():
        expected = exported_network(net.eval().cpu())(inputs).numpy()
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run([output_name(net)], {input_name(net): inputs.numpy()})[0]
    return float(np.abs(got - expected).max())


def input_contract(scorer: FrameScorer, source: str) -> dict:
    """What a runtime needs besides the network, enough to give it the project's input from a video frame or from a
    face crop of the crop stage: the face crop (`scoring.crop_contract`), the evaluation transform step by step
    (`augment.eval_transform_steps`, for a crop of `face_crop.crop_size`), and how to read the output."""
    data_config = data_config_of(scorer.meta)
    crop_fraction = float((scorer.meta.get("loader") or {}).get("crop_fraction") or 1.0)
    crop_size = scorer.settings.crop_size
    head = scorer.meta.get("head") or {}
    clip = {} if scorer.clip_frames is None else {
        "clip_frames": scorer.clip_frames,
        "max_frames": head.get("max_frames") if head.get("name") == "transformer" else None,  # longest T it takes
        "clip_spacing_s": clip_spacing_of(scorer.meta),
        "windows": f"each crop with a face is scored with a clip of {scorer.clip_frames} crops of the face ending with "
                   f"it, in time order, as one clip of a batch of 1: the crops nearest the times t, t - s, ... "
                   f"(s = clip_spacing_s, the spacing of the training clips), among those no older than s before "
                   f"the earliest, each crop once (fewer at the start of a video); the last crops when it is null"}
    layout = "NTCHW" if clip else "NCHW"
    aggregation = scorer.aggregation + (f" of the top {scorer.topk}" if scorer.aggregation == "topk" else "")
    output = output_name(scorer.net)
    level = scorer.output.pain_level
    if output == LEVEL_OUTPUT:  # an ordinal or regression model: its level probabilities, read as they are
        pain = (f"sum of level_probabilities over the classes {', '.join(scorer.class_names[level:])} (levels >= "
                f"{level}; at level 1 this is 1 - P(class 'BL1')); level_probabilities are the task's levels' "
                f"probabilities in class order, non-negative and summing to 1: no softmax")
        video = f"aggregated by {aggregation}, then the sum over the levels >= {level}"
    else:
        pain = "1 - softmax(logits)[class 'BL1'] (float32 logits)"
        video = f"aggregated by {aggregation}, then 1 - P(BL1)"
    return {"contract_version": CONTRACT_VERSION, "source": source, "model": scorer.meta.get("model_name"),
            "input": input_name(scorer.net), "output": output, "layout": layout, "dtype": "float32",
            "channels": "RGB", **clip, "input_size": list(data_config.input_size), "mean": list(data_config.mean),
            "std": list(data_config.std), "crop_fraction": crop_fraction,
            "face_crop": crop_contract(scorer.settings),
            "transform": eval_transform_steps(data_config, crop_fraction, (crop_size, crop_size)),
            "class_names": scorer.class_names, "pain_probability": pain,
            **({"output_settings": scorer.output.meta()["output"]} if output == LEVEL_OUTPUT else {}),
            "threshold": scorer.threshold, "decision": "pain when pain_probability >= threshold",
            "video_aggregation": scorer.aggregation, "topk": scorer.topk,
            "video_score": f"the class probabilities of the video's scored crops (windows of a clip model) {video}"}


def export_scorer(scorer: FrameScorer, name: str, out_dir: Path) -> Path:
    """Write the scorer's network as `<out_dir>/<name>.onnx` (the name made file-safe) and its input contract beside it
    as `.json`, with the largest difference between ONNX Runtime's and PyTorch's logits on random inputs."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name.removeprefix("models:/")).strip("_")
    img_size = int(data_config_of(scorer.meta).input_size[1])
    path = export_onnx(scorer.net, img_size, out_dir / f"{stem}.onnx")
    difference = max(onnx_difference(scorer.net, path, img_size, frames=frames)
                     for frames in ([scorer.clip_frames, 1] if scorer.clip_frames else [1]))
    contract = input_contract(scorer, name) | {"max_abs_difference_to_pytorch": difference}
    atomic_write_text(path.with_suffix(".json"), json.dumps(contract, indent=2) + "\n")
    print(f"{name} -> {path} ({path.stat().st_size / 1e6:.1f} MB) and its input contract {path.with_suffix('.json')}; "
          f"ONNX Runtime vs PyTorch: max |difference| {difference:.2e}")
    return path


def run_export(cfg: DictConfig, model_uri: str | None = None, run: str | None = None, format: str = "onnx",
               out: str | None = None) -> Path:
    """`make export [MODEL_URI=... | RUN=<fold or final run>] [FORMAT=onnx] [OUT=folder]`: default the champion of
    MODEL / TASK."""
    from pipeline.deployment.predict import ScorerSource, find_scorer
    from pipeline.deployment.video_frames import PredictError

    if format not in FORMATS:
        raise SystemExit(f"export: FORMAT={format!r} is not supported; choose one of {', '.join(FORMATS)}")
    try:
        source = ScorerSource.of(cfg.mlflow.tracking_uri, cfg.model.name, cfg.task.name, cfg.predict)
        scorer, name = find_scorer(source, model_uri or None, run or None)
    except PredictError as error:
        raise SystemExit(f"export: {error}") from None
    if scorer.personalise.personal:
        raise SystemExit(f"export: {name}: {not_served(scorer.personalise)}")
    out_dir = Path(out).expanduser().resolve() if out else resolve_path(cfg.reports_dir) / "export"
    return export_scorer(scorer, name, out_dir)
