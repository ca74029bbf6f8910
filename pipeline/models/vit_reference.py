"""A reference Vision Transformer written from the equations of Dosovitskiy et al. (ICLR 2021), for reading.

    z_0  = [x_class; x_p^1 E; ...; x_p^N E] + E_pos      (1)  patch embedding, class token, position embeddings
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                    (2)  pre-norm multi-head self-attention, residual
    z_l  = MLP(LN(z'_l)) + z'_l                          (3)  pre-norm GELU MLP, residual
    y    = LN(z_L^0)                                     (4)  the class token's final state; a linear head reads it

The submodules carry timm's names (`patch_embed.proj`, `blocks.<i>.attn.qkv`, `blocks.<i>.mlp.fc1`, ...), so the
state dict of a timm `VisionTransformer` loads as it is and gives the same logits (tests/test_vit_ref.py checks this
in float64). Attention is an explicit softmax rather than a fused kernel, so every intermediate tensor can be read:
`forward_trace` returns them all by name. The pipeline trains this model from scratch as the backbone `vit_ref`
(pipeline/backbones.py); the course notebooks in notebooks/ use it to show a ViT at work on a face.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

Trace = dict[str, torch.Tensor]


def _record(trace: Trace | None, prefix: str, **tensors: torch.Tensor) -> None:
    if trace is not None:
        trace.update({prefix + name: tensor.detach() for name, tensor in tensors.items()})


class MultiHeadSelfAttention(nn.Module):
    """Eqs. 5-8: [q, k, v] = z U_qkv; A = softmax(q k^T / sqrt(Dh)) per head; heads concatenated, times U_msa."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the width D={dim} must split evenly into {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)  # every head's U_qkv in one matrix
        self.proj = nn.Linear(dim, dim)  # U_msa

    def forward(self, z: torch.Tensor, trace: Trace | None = None, prefix: str = "") -> torch.Tensor:
        batch, tokens, dim = z.shape
        # (B, T, 3D) -> (B, T, 3, heads, Dh) -> three tensors of (B, heads, T, Dh): head h reads columns h*Dh.. of each
        q, k, v = self.qkv(z).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, heads, T, T)
        attention = scores.softmax(dim=-1)  # row i: how much token i takes from every token; sums to 1
        heads = (attention @ v).transpose(1, 2).reshape(batch, tokens, dim)  # [SA_1; ...; SA_k]
        out = self.proj(heads)
        _record(trace, prefix, q=q, k=k, v=v, scores=scores, attention=attention, heads=heads, out=out)
        return out


class MLP(nn.Module):
    """Two linear layers with GELU between them, applied to every token on its own: D -> mlp_dim -> D."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()  # the exact x * Phi(x), as the paper and timm use
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, z: torch.Tensor, trace: Trace | None = None, prefix: str = "") -> torch.Tensor:
        hidden = self.fc1(z)
        activated = self.act(hidden)
        out = self.fc2(activated)
        _record(trace, prefix, hidden=hidden, gelu=activated, out=out)
        return out


class EncoderBlock(nn.Module):
    """Eqs. 2-3: LayerNorm before each sub-layer, a residual around each, so the identity path stays untouched."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, qkv_bias: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = MultiHeadSelfAttention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_dim)

    def forward(self, z: torch.Tensor, trace: Trace | None = None, prefix: str = "") -> torch.Tensor:
        normed = self.norm1(z)
        _record(trace, prefix, norm1=normed)
        z_prime = self.attn(normed, trace, prefix + "attn.") + z  # eq. 2
        normed_prime = self.norm2(z_prime)
        _record(trace, prefix, z_prime=z_prime, norm2=normed_prime)
        z_out = self.mlp(normed_prime, trace, prefix + "mlp.") + z_prime  # eq. 3
        _record(trace, prefix, z=z_out)
        return z_out


class PatchEmbedding(nn.Module):
    """Eq. 1, inside: every P x P patch (P^2 C numbers) times one matrix E plus a bias, which is exactly a
    convolution with kernel P and stride P. Pixels past the last whole patch are left out."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images)  # (B, D, H // P, W // P): one D-vector per patch, on the patch grid


class ReferenceViT(nn.Module):
    """ViT from eqs. 1-4 with every size an argument. num_classes=0: no head, forward returns y = LN(z_L^0)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 768,
        num_heads: int = 12,
        depth: int = 12,
        mlp_dim: int = 3072,
        num_classes: int = 1000,
        in_chans: int = 3,
        qkv_bias: bool = True,
        eps: float = 1e-6,  # timm's ViT LayerNorm epsilon (torch's default is 1e-5)
    ) -> None:
        super().__init__()
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2  # N = HW / P^2
        self.num_features = embed_dim
        self.patch_embed = PatchEmbedding(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))  # x_class
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches + 1, embed_dim))  # E_pos, index 0: x_class
        self.blocks = nn.ModuleList(
            EncoderBlock(embed_dim, num_heads, mlp_dim, qkv_bias, eps) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=eps)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random init as timm's ViT: weights and embeddings N(0, 0.02^2) (cut at +-2, far out), zero biases,
        LayerNorm at identity."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes), no softmax; without a head: y = LN(z_L^0), (B, D)."""
        patches = self.patch_embed(images)
        if patches.shape[-2:] != (self.grid_size, self.grid_size):
            raise ValueError(
                f"{tuple(images.shape[-2:])} px gives a {tuple(patches.shape[-2:])} patch grid; this model's "
                f"position embeddings are for {self.grid_size} x {self.grid_size} (img_size={self.img_size}); "
                "resample them with interpolate_position_embeddings for another size"
            )
        tokens = patches.flatten(2).transpose(1, 2)  # (B, N, D), patches in raster order
        with_class = torch.cat([self.cls_token.expand(len(images), -1, -1), tokens], dim=1)  # (B, N + 1, D)
        z = with_class + self.pos_embed  # eq. 1: z_0
        _record(trace, "", image=images, patch_embed=patches, tokens=tokens, with_class_token=with_class, z0=z)
        for index, block in enumerate(self.blocks):
            z = block(z, trace, f"blocks.{index}.")
        # timm normalises every token; only the class token's row is y of eq. 4, the head reads nothing else
        normed = self.norm(z)
        y = normed[:, 0]
        logits = self.head(y)
        _record(trace, "", norm=normed, y=y, logits=logits)
        return logits

    def forward_trace(self, images: torch.Tensor) -> Trace:
        """Every intermediate tensor of one forward pass, by name in the order computed (`blocks.0.attn.attention`
        holds block 0's attention weights, (B, heads, N + 1, N + 1))."""
        trace: Trace = {}
        self.forward(images, trace)
        return trace

    def load_timm_state_dict(self, state_dict: Mapping[str, torch.Tensor], assign: bool = False) -> None:
        """Load a timm VisionTransformer's state dict (the names are the same), strictly.

        Without a head here (num_classes=0) the file's head is dropped. Position embeddings made for another grid are
        interpolated to this model's (chapter 9 of the course, as timm does when it loads a checkpoint).
        """
        state = dict(state_dict)
        if isinstance(self.head, nn.Identity):
            state = {name: tensor for name, tensor in state.items() if not name.startswith("head.")}
        pos_embed = state.get("pos_embed")
        if pos_embed is not None and pos_embed.shape[1] != self.num_patches + 1:
            state["pos_embed"] = interpolate_position_embeddings(pos_embed, (self.grid_size, self.grid_size))
        self.load_state_dict(state, strict=True, assign=assign)


def interpolate_position_embeddings(
    pos_embed: torch.Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1, antialias: bool = True
) -> torch.Tensor:
    """Position embeddings (1, prefix + g*g, D) of a g x g patch grid, resampled in 2-D to `new_grid`.

    The class token's embedding has no place on the grid and is kept as it is; the others are laid back on their
    g x g grid (raster order), interpolated bicubically as D images, and read off the new grid in raster order.
    antialias=True is timm's choice (torch's antialiased bicubic kernel, which also differs when upsampling).
    """
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    side = math.isqrt(grid.shape[1])
    if side * side != grid.shape[1]:
        raise ValueError(f"{grid.shape[1]} position embeddings do not fill a square grid")
    dim = grid.shape[-1]
    as_images = grid.reshape(1, side, side, dim).permute(0, 3, 1, 2)  # (1, D, g, g)
    resized = F.interpolate(as_images, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=antialias)
    return torch.cat([prefix, resized.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)
