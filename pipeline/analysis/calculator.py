"""`make calc`: the calculator report of one backbone at one input size (course chapter 8), set beside the figures
its paper publishes. The counting itself lives in `pipeline.models.cost`, which a cross-validation also records."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pipeline.data.tasks import get_task
from pipeline.models.cost import (
    GIB,
    VIT_PAPER_PARAMS,
    VIT_PRESETS,
    build_on_meta,
    collapse_numbered,
    count_macs,
    grouped_trace,
    input_size,
    measured_step_memory,
    parameter_count,
    parameters_by_part,
    saved_activation_bytes,
    shape_trace,
    vit_mac_parts,
    vit_parameter_parts,
    vit_shape_of,
)

# --- published figures ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """A paper's figures for the ImageNet model (1000-class head) at its resolution."""

    img_size: int
    params: float
    macs: float | None
    source: str


PUBLISHED = {
    "vit_b16": Published(224, 86.6e6, 17.6e9, "ViT-B/16 as quoted in issue 10 (the ViT paper's table: 86 M)"),
    "cvt_13": Published(224, 20e6, 4.5e9, "CvT paper (Wu et al. 2021), Table 2"),
    "cvt_21": Published(224, 32e6, 7.1e9, "CvT paper (Wu et al. 2021), Table 2"),
    "mobilevit_s": Published(256, 5.6e6, None, "MobileViT paper (Mehta & Rastegari 2022); parameters only"),
    "mobilevit_xs": Published(256, 2.3e6, None, "MobileViT paper (Mehta & Rastegari 2022); parameters only"),
    "mobilevit_xxs": Published(256, 1.3e6, None, "MobileViT paper (Mehta & Rastegari 2022); parameters only"),
}


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {suffix}"
    return f"{value:.0f}"


def _diff(counted: float, published: float) -> str:
    return f"{100 * (counted - published) / published:+.1f} %"


# --- make calc -----------------------------------------------------------------------------------------------------


def report(model_name: str, img_size: int | None, batch: int, n_classes: int, measure: bool = True,
           max_cpu_step_macs: float = 2e11) -> str:
    """The text `make calc` prints."""
    net = build_on_meta(model_name, img_size, n_classes)
    size = input_size(net)
    lines = [f"{model_name} ({net.backbone.architecture}) at {size} x {size} px, {n_classes} classes, batch {batch}",
             "", f"Shape trace (batch {batch}):"]
    for label, what, dims in grouped_trace(shape_trace(net, size, batch)):
        lines.append(f"  {label:<48} {dims:<22} {what}")

    total_params = parameter_count(net)
    lines += ["", "Parameters by part (counted):"]
    for name, count in collapse_numbered(parameters_by_part(net)):
        lines.append(f"  {name:<44} {count:>14,}")
    lines.append(f"  {'total':<44} {total_params:>14,}  ({_si(total_params)})")

    macs = count_macs(net, size)
    shape = vit_shape_of(net)
    if shape is not None:
        closed_params = vit_parameter_parts(shape)
        closed_macs = vit_mac_parts(shape)
        params_sum, macs_sum = sum(v for *_, v in closed_params), sum(v for *_, v in closed_macs)
        lines += ["", f"Closed form (ViT: L={shape.depth}, D={shape.dim}, M={shape.mlp_dim}, heads={shape.heads}, "
                      f"P={shape.patch}, N={shape.patches}, K={shape.n_classes}):"]
        lines += [f"  {part:<34} {formula:<30} {value:>16,}" for part, formula, value in closed_params]
        lines.append(f"  {'parameters':<65} {params_sum:>16,}  "
                     f"{'= counted' if params_sum == total_params else f'!= counted {total_params:,}'}")
        lines += [f"  {part:<34} {formula:<30} {value:>16,}" for part, formula, value in closed_macs]
        lines.append(f"  {'MACs':<65} {macs_sum:>16,}  "
                     f"{'= counted' if macs_sum == macs.total else f'!= counted {macs.total:,}'}")

    operators = ", ".join(f"{op} {_si(v)}" for op, v in sorted(macs.by_operator.items(), key=lambda kv: -kv[1]))
    lines += ["", f"Multiply-accumulates for one image (FlopCounterMode, fused attention off): {macs.total:,} "
                  f"({_si(macs.total)})", f"  by operator: {operators}"]

    images = torch.zeros(batch, 3, size, size, device="meta")
    activations = saved_activation_bytes(net, images)
    weights = total_params * 4
    lines += ["", f"Memory of one training step at batch {batch} (float32):",
              f"  activations kept for the backward pass (estimated, counted on the meta device): "
              f"{activations / GIB:.3f} GiB",
              f"  weights {weights / GIB:.3f} GiB + gradients {weights / GIB:.3f} GiB + AdamW state "
              f"{2 * weights / GIB:.3f} GiB"]
    if measure:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        step_macs = 3 * macs.total * batch  # forward + backward
        if device.type == "cpu" and step_macs > max_cpu_step_macs:
            lines.append(f"  measured: skipped on the CPU (one step is about {_si(step_macs)} MACs); run on a GPU, "
                         f"or a smaller BATCH/IMG")
        else:
            measured = measured_step_memory(model_name, size, n_classes, batch, device)
            lines.append(f"  measured: {measured['bytes'] / GIB:.3f} GiB ({measured['how']}; includes gradients and "
                         f"temporaries; {measured['seconds']:.1f} s)")

    published = PUBLISHED.get(model_name)
    if published is not None:
        reference = build_on_meta(model_name, published.img_size, 1000)
        ref_params = parameter_count(reference)
        ref_macs = count_macs(reference, published.img_size).total
        text = (f"  counted {_si(ref_params)} parameters ({_diff(ref_params, published.params)} vs "
                f"{_si(published.params)})")
        if published.macs is not None:
            text += f", {_si(ref_macs)} MACs ({_diff(ref_macs, published.macs)} vs {_si(published.macs)})"
        else:
            text += f", {_si(ref_macs)} MACs"
        lines += ["", f"Against the published figures ({published.source}; 1000 classes, {published.img_size} px):",
                  text]
    if shape is not None:
        lines += ["", "The ViT paper's presets (1000 classes, 224 px), closed form:"]
        for preset, preset_shape in VIT_PRESETS.items():
            count = sum(v for *_, v in vit_parameter_parts(preset_shape))
            lines.append(f"  {preset:<10} {_si(count)} parameters ({_diff(count, VIT_PAPER_PARAMS[preset])} vs the "
                         f"paper's {_si(VIT_PAPER_PARAMS[preset])}), "
                         f"{_si(sum(v for *_, v in vit_mac_parts(preset_shape)))} MACs")
    return "\n".join(lines)


def run_calc(cfg: DictConfig) -> str:
    """`make calc MODEL=... IMG=... BATCH=...`: the model as `make cv` builds it (input size and task from the
    config, IMG and BATCH override model.img_size and loader.batch_size)."""

    text = report(cfg.model.name, cfg.model.img_size, int(cfg.loader.batch_size), get_task(cfg.task.name).n_classes)
    print(text)
    return text
