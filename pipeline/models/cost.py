"""`make calc`: the size and cost of any backbone the pipeline builds (course chapter 8's calculator).

For one model at one input size it gives a shape trace, the parameter count by part, the multiply-accumulates (MACs)
of one image counted by `torch.utils.flop_counter.FlopCounterMode`, and the activation memory of a training step.
For a plain ViT it also gives the closed-form counts (P^2*C*D + D for the patch embedding, 4D^2 + 4D per attention,
...), which must equal the counted ones.

Counting is done on PyTorch's meta device (shapes only, no memory, no arithmetic), so ViT-H costs as little as
ViT-Ti. Attention is counted with timm's fused kernel switched off: FlopCounterMode counts the fused CPU kernel
(`scaled_dot_product_attention`) as zero, which would drop the attention matrix products (4 % of ViT-B/16's MACs).

`backbone_cost(model_name, img_size, n_classes)` is what a cross-validation records on its parent run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.introspection import disable_fused_attention, vit_of

log = logging.getLogger(__name__)
GIB = 1024**3


# --- closed form for ViT (course chapter 8) --------------------------------------------------------------------------


@dataclass(frozen=True)
class ViTShape:
    """The hyperparameters every ViT size follows from: layers, width D, MLP width, heads, patch size P."""

    depth: int
    dim: int
    mlp_dim: int
    heads: int
    patch: int
    img_size: int = 224
    channels: int = 3
    n_classes: int = 1000

    @property
    def grid(self) -> int:
        return self.img_size // self.patch

    @property
    def patches(self) -> int:
        return self.grid**2

    @property
    def tokens(self) -> int:
        return self.patches + 1  # with the class token


# The paper's Table 1 (the course's calculator presets), and the parameter counts it states for them.
VIT_PRESETS = {
    "ViT-Base": ViTShape(depth=12, dim=768, mlp_dim=3072, heads=12, patch=16),
    "ViT-Large": ViTShape(depth=24, dim=1024, mlp_dim=4096, heads=16, patch=16),
    "ViT-Huge": ViTShape(depth=32, dim=1280, mlp_dim=5120, heads=16, patch=14),
}
VIT_PAPER_PARAMS = {"ViT-Base": 86e6, "ViT-Large": 307e6, "ViT-Huge": 632e6}


def vit_parameter_parts(shape: ViTShape) -> list[tuple[str, str, int]]:
    """(part, formula, parameters) of a ViT with a class token, learned position embeddings and a linear head."""
    d, m, depth = shape.dim, shape.mlp_dim, shape.depth
    attention, mlp = 4 * d * d + 4 * d, 2 * d * m + m + d
    return [
        ("patch embedding", "P^2*C*D + D", shape.patch**2 * shape.channels * d + d),
        ("class token", "D", d),
        ("position embeddings", "(N+1)*D", shape.tokens * d),
        ("attention", f"{depth} x (4D^2 + 4D = {attention:,})", depth * attention),
        ("MLP", f"{depth} x (2DM + M + D = {mlp:,})", depth * mlp),
        ("layer norms", f"({depth} x 2 + 1) x 2D", (2 * depth + 1) * 2 * d),
        ("head", "D*K + K", d * shape.n_classes + shape.n_classes),
    ]


def vit_mac_parts(shape: ViTShape) -> list[tuple[str, str, int]]:
    """(part, formula, multiply-accumulates) for one image: every matrix product, nothing else (as FlopCounterMode
    counts). T = N + 1 tokens; the attention matrix has T^2 entries per head of width D/heads."""
    d, m, t, depth = shape.dim, shape.mlp_dim, shape.tokens, shape.depth
    return [
        ("patch embedding", "N*P^2*C*D", shape.patches * shape.patch**2 * shape.channels * d),
        ("q, k, v and output projections", f"{depth} x 4TD^2", depth * 4 * t * d * d),
        ("attention matrix and weighted sum", f"{depth} x 2T^2*D", depth * 2 * t * t * d),
        ("MLP", f"{depth} x 2TDM", depth * 2 * t * d * m),
        ("head", "D*K", d * shape.n_classes),
    ]


def vit_shape_of(net: PainNet) -> ViTShape | None:
    """The closed-form shape of a plain timm ViT inside `net` (class token, learned position embeddings for every
    token, biased projections, token pooling, square input), else None."""
    vit = vit_of(net)
    if vit is None:
        return None
    block = vit.blocks[0]
    plain = (
        getattr(vit, "cls_token", None) is not None and getattr(vit, "num_reg_tokens", 0) == 0
        and not getattr(vit, "no_embed_class", False) and getattr(vit, "pos_embed", None) is not None
        and getattr(vit, "global_pool", "token") == "token" and isinstance(vit.fc_norm, nn.Identity)
        and vit.patch_embed.proj.bias is not None and block.attn.qkv.bias is not None
        and hasattr(block.mlp, "fc1") and isinstance(block.ls1, nn.Identity)
        and vit.patch_embed.img_size[0] == vit.patch_embed.img_size[1]
    )
    if not plain:
        return None
    return ViTShape(depth=len(vit.blocks), dim=vit.embed_dim, mlp_dim=block.mlp.fc1.out_features,
                    heads=block.attn.num_heads, patch=vit.patch_embed.patch_size[0],
                    img_size=vit.patch_embed.img_size[0], n_classes=net.head.out_features)


# --- counted ---------------------------------------------------------------------------------------------------------


def build_on_meta(model_name: str, img_size: int | None, n_classes: int) -> PainNet:
    """The pipeline's network, shapes only (no weights in memory), with fused attention off."""
    with torch.device("meta"):
        net, _ = create_model(model_name, n_classes=n_classes, pretrained=False, img_size=img_size)
    disable_fused_attention(net)
    return net


def input_size(net: PainNet) -> int:
    _, height, width = net.backbone.data_config.input_size
    if height != width:
        raise ValueError(f"{net.backbone.name}: square inputs only, got {height} x {width}")
    return int(height)


@dataclass(frozen=True)
class MacCount:
    total: int
    by_operator: dict[str, int]


def count_macs(net: nn.Module, img_size: int) -> MacCount:
    """Multiply-accumulates of one image through `net` (FlopCounterMode's FLOPs / 2), fused attention off."""
    device = next(net.parameters()).device
    flags = disable_fused_attention(net)
    training = net.training
    net.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            net(torch.zeros(1, 3, img_size, img_size, device=device))
    finally:
        net.train(training)
        for module, flag in flags.items():
            module.fused_attn = flag
    by_operator = {str(op).removeprefix("aten."): int(flops) // 2
                   for op, flops in counter.get_flop_counts().get("Global", {}).items()}
    return MacCount(int(counter.get_total_flops()) // 2, by_operator)


def parameter_count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def parameters_by_part(net: PainNet) -> list[tuple[str, int]]:
    """The backbone's parameter groups (stem to top, as for layer-wise learning rates) and the head."""
    return [(name, sum(p.numel() for p in params)) for name, params in net.backbone.parameter_groups()] + [
        ("head", parameter_count(net.head))]


def collapse_numbered(rows: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Runs of rows named <prefix>.<i> with the same value become one row '<prefix>.<i>-<j> (k x value)'."""
    out: list[tuple[str, object]] = []
    index = 0
    while index < len(rows):
        name, value = rows[index]
        match = re.fullmatch(r"(.*\.)(\d+)", name)
        end = index + 1
        if match:
            while end < len(rows):
                following = re.fullmatch(r"(.*\.)(\d+)", rows[end][0])
                if not following or following.group(1) != match.group(1) or rows[end][1] != value:
                    break
                end += 1
        if end - index > 1:
            last = re.fullmatch(r".*\.(\d+)", rows[end - 1][0]).group(1)
            out.append((f"{name}-{last} ({end - index} x)", value))
        else:
            out.append((name, value))
        index = end
    return out


# --- shape trace -----------------------------------------------------------------------------------------------------

def _shape_of(output) -> tuple[int, ...] | None:
    if isinstance(output, torch.Tensor):
        return tuple(output.shape)
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return tuple(output[0].shape)
    return None


def shape_trace(net: PainNet, img_size: int, batch: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(module, what, shape) in execution order for a batch through `net` on its device (use the meta device)."""
    rows: list[tuple[str, str, tuple[int, ...]]] = []
    handles = []

    def keep(name: str, what: str):
        def hook(module, inputs, output):
            shape = _shape_of(output)
            if shape is not None:
                rows.append((name, what, shape))
        return hook

    patterns = net.backbone.trace_patterns()  # the modules its adapter shows, by their names inside the backbone
    for name, module in net.backbone.named_modules():
        for pattern, what in patterns:
            if re.fullmatch(pattern, name):
                handles.append(module.register_forward_hook(keep(f"backbone.{name}", what)))
    handles.append(net.backbone.register_forward_hook(keep("backbone", "pooled features")))
    handles.append(net.head.register_forward_hook(keep("head", "logits")))
    flags = disable_fused_attention(net)
    try:
        with torch.no_grad():
            net.eval()(torch.zeros(batch, 3, img_size, img_size, device=next(net.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in flags.items():
            module.fused_attn = flag
    input_row = ("input", "images", (batch, 3, img_size, img_size))
    described = _vit_descriptions(net)
    shown = [(net.backbone.trace_name(name.removeprefix("backbone.")) if name.startswith("backbone.") else name,
              what, shape) for name, what, shape in rows]
    return [input_row] + [(short, described.get(short, what), shape) for short, what, shape in shown]


def _vit_descriptions(net: PainNet) -> dict[str, str]:
    """What the rows of a ViT's trace are, in the course's words."""
    vit = vit_of(net)
    if vit is None:
        return {}
    rows, cols = vit.patch_embed.grid_size
    patch = vit.patch_embed.patch_size[0]
    return {"patch_embed": f"{rows} x {cols} = {rows * cols} patches of {patch} x {patch} x 3 = {3 * patch * patch} "
                           f"values, each projected to D = {vit.embed_dim}",
            "pos_drop": "tokens: class token prepended, position embeddings added",
            "norm": "final LayerNorm",
            "backbone": "pooled features (the class token)"}


def grouped_trace(trace: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, str]]:
    """Rows that differ only in their innermost block number and have the same shape become one row
    ('blocks.# x 12'), placed where the first of them ran; everything else keeps its execution order."""
    groups: dict[tuple[str, str, tuple[int, ...]], list[str]] = {}
    for name, what, shape in trace:
        pattern = re.sub(r"\.\d+(?=(\.[^\d.][^.]*)*$)", ".#", name, count=1)  # the last number in the name
        groups.setdefault((pattern, what, shape), []).append(name)
    rows = []
    for (pattern, what, shape), names in groups.items():
        label = names[0] if len(names) == 1 else f"{pattern} x {len(names)}"
        rows.append((label, what, _dims(shape)))
    return rows


def _dims(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(v) for v in shape) + ")"


# --- activation memory -----------------------------------------------------------------------------------------------


def saved_activation_bytes(net: nn.Module, images: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from a training-mode forward pass for the backward pass (each storage
    once, parameters excluded): the activation memory of a training step, before the backward frees it."""
    parameters = {id(p) for p in net.parameters()}
    kept: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = tensor
        while root._base is not None:
            root = root._base
        if id(root) not in parameters:
            kept[id(root)] = root  # holding it keeps the id unique for the pass
        return tensor

    training = net.training
    net.train()
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            net(images)
    finally:
        net.train(training)
    return sum(root.untyped_storage().nbytes() for root in kept.values())


@contextlib.contextmanager
def _peak_rss() -> Iterator[dict]:
    """Peak resident memory growth of this process inside the block (Linux: VmHWM reset through clear_refs)."""
    result: dict = {}
    status = Path("/proc/self/status")

    def field(name: str) -> int:
        line = next(line for line in status.read_text().splitlines() if line.startswith(name + ":"))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current resident size
    before = field("VmRSS")
    yield result
    result["bytes"] = field("VmHWM") - before


def measured_step_memory(model_name: str, img_size: int, n_classes: int, batch: int,
                         device: torch.device) -> dict[str, float]:
    """One real training step (forward, backward) at `batch`: the peak memory above the weights on a GPU
    (torch.cuda.max_memory_allocated), else the process's peak resident growth on the CPU. Also its seconds."""
    net, _ = create_model(model_name, n_classes=n_classes, pretrained=False, img_size=img_size)
    net = net.to(device).train()
    images = torch.randn(batch, 3, img_size, img_size, device=device)
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        net(images).float().logsumexp(dim=1).mean().backward()
        torch.cuda.synchronize(device)
        return {"bytes": float(torch.cuda.max_memory_allocated(device) - base),
                "seconds": time.perf_counter() - started, "how": f"peak CUDA memory above the weights on {device}"}
    try:
        with _peak_rss() as peak:
            net(images).float().logsumexp(dim=1).mean().backward()
    except (OSError, StopIteration) as error:
        return {"bytes": float("nan"), "seconds": float("nan"), "how": f"not measurable here ({error})"}
    return {"bytes": float(peak["bytes"]), "seconds": time.perf_counter() - started,
            "how": "peak resident memory growth of this process on the CPU"}


# --- what a cross-validation records ---------------------------------------------------------------------------------


@functools.cache
def _backbone_cost(model_name: str, img_size: int | None, n_classes: int) -> dict[str, float]:
    net = build_on_meta(model_name, img_size, n_classes)
    size = input_size(net)
    return {"cost/params": float(parameter_count(net)), "cost/macs": float(count_macs(net, size).total),
            "cost/img_size": float(size)}


def backbone_cost(model_name: str, img_size: int | None = None, n_classes: int = 2) -> dict[str, float]:
    """Parameters and MACs of one image for the pipeline's network (backbone + Linear head), counted on the meta
    device in well under a second: {'cost/params': ..., 'cost/macs': ..., 'cost/img_size': ...}. Counted once per
    process for each (backbone, size, classes): `make table`'s five CVs of one backbone count it once."""
    return dict(_backbone_cost(model_name, img_size, n_classes))  # a copy: the cached one stays as counted
