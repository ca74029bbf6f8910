"""What kind of network a model holds, and switches that make it countable and inspectable: the timm ViT inside a
wrapper, and timm's fused attention kernel turned off (it never materialises the attention matrix, and FLOP counting
sees it as zero)."""

from __future__ import annotations

from torch import nn


def disable_fused_attention(model: nn.Module) -> dict[nn.Module, bool]:
    """Turn off the fused attention kernel on every module that has one; returns the previous flags to restore.

    Used for attention capture and for FLOP counting (FlopCounterMode counts the fused CPU kernel as zero).
    """
    previous = {}
    for module in model.modules():
        if isinstance(getattr(module, "fused_attn", None), bool):
            previous[module] = module.fused_attn
            module.fused_attn = False
    return previous


def restore_fused_attention(previous: dict[nn.Module, bool]) -> None:
    for module, flag in previous.items():
        module.fused_attn = flag


def vit_of(model: nn.Module) -> nn.Module | None:
    """The timm VisionTransformer inside `model` (a PainNet, a backbone or the ViT itself), else None."""
    from timm.models.vision_transformer import VisionTransformer

    for module in model.modules():
        if isinstance(module, VisionTransformer):
            return module
    return None
