"""What a ViT attends to: captured attention weights, attention rollout, mean attention distance, and the ViT
paper's pictures of the patch embedding and the position embeddings (course chapter 10).

timm computes attention with `F.scaled_dot_product_attention` (`Attention.fused_attn`), a fused kernel that never
materialises the attention matrix. `AttentionRecorder` switches that path off on every attention module it records
and takes the weights from the module's `attn_drop` (the softmax output goes through it in the explicit path). No
function here ever makes up a map: with no weights captured they raise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pipeline.models.introspection import disable_fused_attention, restore_fused_attention, vit_of


class NoAttentionCaptured(RuntimeError):
    """A forward pass ran but no attention weights were recorded (fused kernel still on, or no attention layers)."""


class AttentionRecorder:
    """Records the attention weights (B, heads, tokens, tokens) of every timm attention block of a ViT, in order.

    with AttentionRecorder(net) as recorder:
        net(images)
    recorder.attentions  # one tensor per block

    The fused kernel is switched off for the recording and restored afterwards.
    """

    def __init__(self, model: nn.Module) -> None:
        vit = vit_of(model)
        if vit is None:
            raise TypeError(f"{type(model).__name__} holds no timm VisionTransformer: attention rollout needs one")
        self.vit = vit
        self.blocks = [block.attn for block in vit.blocks]
        missing = [index for index, attn in enumerate(self.blocks)
                   if not isinstance(getattr(attn, "attn_drop", None), nn.Module)]
        if missing:
            raise TypeError(f"attention modules of blocks {missing} have no attn_drop to read the weights from")
        self.attentions: list[torch.Tensor] = []
        self._handles: list = []
        self._flags: dict[nn.Module, bool] = {}

    @property
    def num_prefix_tokens(self) -> int:
        return int(getattr(self.vit, "num_prefix_tokens", 1))

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(int(side) for side in self.vit.patch_embed.grid_size)

    @property
    def patch_size(self) -> int:
        return int(self.vit.patch_embed.patch_size[0])

    def __enter__(self) -> AttentionRecorder:
        self.attentions = []
        self._flags = {}
        for attn in self.blocks:
            self._flags.update(disable_fused_attention(attn))
            self._handles.append(attn.attn_drop.register_forward_hook(self._keep))
        return self

    def _keep(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.attentions.append(output.detach().float())  # blocks run in order: one entry per block

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        restore_fused_attention(self._flags)

    def checked(self) -> list[torch.Tensor]:
        """The recorded weights of one forward pass, one per block; raises unless every block gave a row-stochastic
        (B, heads, T, T) matrix."""
        if not self.attentions:
            raise NoAttentionCaptured(
                "no attention weights were captured: the fused attention kernel computes them without keeping them; "
                "run the forward pass inside `with AttentionRecorder(model)`")
        if len(self.attentions) != len(self.blocks):
            raise NoAttentionCaptured(f"captured {len(self.attentions)} attention maps for {len(self.blocks)} blocks "
                                      f"(run exactly one forward pass per recording)")
        for index, weights in enumerate(self.attentions):
            if weights.ndim != 4 or weights.shape[-1] != weights.shape[-2]:
                raise NoAttentionCaptured(f"block {index}: expected (B, heads, T, T) weights, "
                                          f"got {tuple(weights.shape)}")
            if float((weights.sum(-1) - 1).abs().max()) > 1e-3:
                raise NoAttentionCaptured(f"block {index}: captured weights are not softmax rows")
        return self.attentions


def attention_rollout(attentions: Sequence[torch.Tensor], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Abnar & Zuidema's rollout as in the ViT paper: per layer average the heads, add the identity (the residual),
    re-normalise the rows, multiply through the layers (R = Ã_L ... Ã_1) and take the class token's row.

    attentions: per layer (B, heads, T, T) or (heads, T, T). Returns (B, T - num_prefix_tokens): what the class token
    attends to over the patches, in raster order.
    """
    if not attentions:
        raise NoAttentionCaptured("attention rollout needs at least one layer of attention weights")
    rollout = None
    for weights in attentions:
        weights = weights.float()
        if weights.ndim == 3:
            weights = weights.unsqueeze(0)
        mean = weights.mean(dim=1)  # (B, T, T)
        identity = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
        layer = 0.5 * mean + 0.5 * identity
        layer = layer / layer.sum(dim=-1, keepdim=True)
        rollout = layer if rollout is None else layer @ rollout
    return rollout[:, 0, num_prefix_tokens:]


def patch_distances(grid: tuple[int, int], patch_size: float) -> torch.Tensor:
    """(N, N) distances in pixels between the centres of the patches of a (rows, cols) grid, raster order."""
    rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    centres = np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.float64) * patch_size
    return torch.from_numpy(np.linalg.norm(centres[:, None] - centres[None], axis=-1))


def mean_attention_distance(attention: torch.Tensor, grid: tuple[int, int], patch_size: float,
                            num_prefix_tokens: int = 1) -> torch.Tensor:
    """Per head, how far (pixels) a patch attends on average: the attention-weighted distance between query and key
    patches, averaged over query patches and images. Only patch-to-patch weights count (prefix tokens have no
    place), re-normalised per query. attention: (B, heads, T, T) or (heads, T, T) -> (heads,)."""
    if attention.ndim == 3:
        attention = attention.unsqueeze(0)
    patches = attention[..., num_prefix_tokens:, num_prefix_tokens:].double()
    if patches.shape[-1] != grid[0] * grid[1]:
        raise ValueError(f"{patches.shape[-1]} patch tokens do not fill a {grid[0]} x {grid[1]} grid")
    patches = patches / patches.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    distances = patch_distances(grid, patch_size).to(patches.device)
    return (patches * distances).sum(dim=-1).mean(dim=(0, 2)).float()


def patch_embedding_components(weight: torch.Tensor, n_components: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """The leading principal components of the patch-embedding filters, as (k, P, P, C) patches, and the share of
    variance each explains. weight: the patch-embedding convolution's (D, C, P, P) kernel (the columns of E)."""
    filters = weight.detach().float().reshape(weight.shape[0], -1).cpu().numpy()
    filters = filters - filters.mean(axis=0, keepdims=True)
    _, singular, components = np.linalg.svd(filters, full_matrices=False)
    k = min(n_components, components.shape[0])
    shape = (k, weight.shape[1], weight.shape[2], weight.shape[3])
    explained = singular**2 / max(float((singular**2).sum()), 1e-12)
    return components[:k].reshape(shape).transpose(0, 2, 3, 1), explained[:k]


def position_embedding_similarity(pos_embed: torch.Tensor, grid: tuple[int, int],
                                  num_prefix_tokens: int = 1) -> np.ndarray:
    """Cosine similarity between the position embeddings of every pair of patches: (rows, cols, rows, cols), entry
    [i, j] the map of patch (i, j) against all patches. pos_embed: (1, [prefix +] N, D) as timm stores it."""
    table = pos_embed.detach().float().reshape(-1, pos_embed.shape[-1])
    n_patches = grid[0] * grid[1]
    if table.shape[0] == n_patches + num_prefix_tokens:
        table = table[num_prefix_tokens:]
    if table.shape[0] != n_patches:
        raise ValueError(f"{table.shape[0]} position embeddings do not match a {grid[0]} x {grid[1]} grid")
    unit = torch.nn.functional.normalize(table, dim=-1)
    return (unit @ unit.T).reshape(grid[0], grid[1], grid[0], grid[1]).cpu().numpy()
