"""The ViT forward pass in NumPy alone: an image and the weights in, class logits out (no softmax).

Every size is read from the arrays it is given: D from the patch matrix, the MLP width from the first MLP matrix, the
number of classes from the head, the number of encoder blocks from the length of the block list. The image is
cropped to whole patches first (pixels past the last whole patch are dropped, as a stride-P convolution drops them).

Layouts (NumPy's, not torch's): images are (B, H, W, C); a patch is flattened in (row, column, channel) order, so
`W_patch` is (P*P*C, D); every matrix multiplies from the right (x @ W). `weights_from_state_dict` converts the
state dict of a timm ViT or of `pipeline.models.vit_reference.ReferenceViT` (same names) into these arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])  # NumPy has no erf; the exact GELU needs it


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU(x) = x * Phi(x), Phi the standard normal CDF (the exact form, not the tanh approximation)."""
    return x * 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Normalise each token over its D features (biased variance, as torch), then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    variance = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + eps) * gamma + beta


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))  # subtracting the row maximum changes nothing but overflow
    return shifted / shifted.sum(axis=axis, keepdims=True)


def patchify(image: np.ndarray, patch_size: int) -> np.ndarray:
    """(B, H, W, C) -> (B, N, P*P*C): whole P x P patches in raster order, each flattened row by row."""
    batch, height, width, channels = image.shape
    rows, columns = height // patch_size, width // patch_size
    if rows == 0 or columns == 0:
        raise ValueError(f"a {height} x {width} image holds no whole {patch_size} x {patch_size} patch")
    cropped = image[:, : rows * patch_size, : columns * patch_size]
    grid = cropped.reshape(batch, rows, patch_size, columns, patch_size, channels)
    return grid.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows * columns, patch_size * patch_size * channels)


def multi_head_self_attention(z: np.ndarray, block: Mapping[str, np.ndarray], num_heads: int) -> np.ndarray:
    """softmax(q k^T / sqrt(Dh)) v for every head, heads concatenated and projected. z: (B, T, D)."""
    batch, tokens, dim = z.shape
    head_dim = dim // num_heads
    qkv = z @ block["W_qkv"] + block["b_qkv"]  # (B, T, 3D): queries, then keys, then values
    q, k, v = qkv.reshape(batch, tokens, 3, num_heads, head_dim).transpose(2, 0, 3, 1, 4)  # 3 x (B, heads, T, Dh)
    attention = softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim))
    heads = (attention @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, dim)
    return heads @ block["W_out"] + block["b_out"]


def encoder_block(z: np.ndarray, block: Mapping[str, np.ndarray], num_heads: int, eps: float) -> np.ndarray:
    """Pre-norm attention then pre-norm GELU MLP, each with a residual (eqs. 2-3)."""
    z = z + multi_head_self_attention(layer_norm(z, block["ln1_gamma"], block["ln1_beta"], eps), block, num_heads)
    hidden = gelu(layer_norm(z, block["ln2_gamma"], block["ln2_beta"], eps) @ block["W_fc1"] + block["b_fc1"])
    return z + hidden @ block["W_fc2"] + block["b_fc2"]


def vit_forward(
    image: np.ndarray,
    patch_size: int,
    num_heads: int,
    W_patch: np.ndarray,
    patch_bias: np.ndarray,
    cls_token: np.ndarray,
    pos_embed: np.ndarray,
    encoder_weights: Sequence[Mapping[str, np.ndarray]],
    norm_gamma: np.ndarray,
    norm_beta: np.ndarray,
    W_head: np.ndarray,
    head_bias: np.ndarray,
    eps: float = 1e-6,
) -> np.ndarray:
    """Float64 logits (B, classes) of images (B, H, W, C).

    Shapes: W_patch (P*P*C, D), patch_bias (D,), cls_token (1, 1, D), pos_embed (1, N + 1, D) for the N whole patches
    of the image; each encoder block a dict of ln1_gamma, ln1_beta, W_qkv (D, 3D), b_qkv, W_out (D, D), b_out,
    ln2_gamma, ln2_beta, W_fc1 (D, M), b_fc1, W_fc2 (M, D), b_fc2; final norm_gamma, norm_beta (D,); W_head (D, K),
    head_bias (K,).
    """
    image = np.asarray(image, dtype=np.float64)
    tokens = patchify(image, patch_size) @ W_patch + patch_bias  # (B, N, D)
    if pos_embed.shape[1] != tokens.shape[1] + 1:
        raise ValueError(
            f"the image holds {tokens.shape[1]} whole patches, the position embeddings are for {pos_embed.shape[1] - 1}"
        )
    class_tokens = np.broadcast_to(cls_token, (len(image), 1, cls_token.shape[-1]))
    z = np.concatenate([class_tokens, tokens], axis=1) + pos_embed  # (B, N + 1, D)
    for block in encoder_weights:
        z = encoder_block(z, block, num_heads, eps)
    y = layer_norm(z[:, 0], norm_gamma, norm_beta, eps)  # only the class token reaches the head
    return y @ W_head + head_bias


def weights_from_state_dict(state_dict: Mapping[str, object]) -> dict:
    """`vit_forward`'s weight arguments from a timm ViT's (or ReferenceViT's) state dict of CPU tensors or arrays."""

    def array(name: str) -> np.ndarray:
        return np.asarray(state_dict[name], dtype=np.float64)

    def bias(name: str, width: int) -> np.ndarray:  # a ViT built with qkv_bias=False has none
        return array(name) if name in state_dict else np.zeros(width)

    conv = array("patch_embed.proj.weight")  # (D, C, P, P) -> (P, P, C, D): rows in (row, column, channel) order
    depth = len({name.split(".")[1] for name in state_dict if name.startswith("blocks.")})
    blocks = []
    for index in range(depth):
        prefix = f"blocks.{index}."
        blocks.append(
            {
                "ln1_gamma": array(prefix + "norm1.weight"),
                "ln1_beta": array(prefix + "norm1.bias"),
                "W_qkv": array(prefix + "attn.qkv.weight").T,
                "b_qkv": bias(prefix + "attn.qkv.bias", len(array(prefix + "attn.qkv.weight"))),
                "W_out": array(prefix + "attn.proj.weight").T,
                "b_out": array(prefix + "attn.proj.bias"),
                "ln2_gamma": array(prefix + "norm2.weight"),
                "ln2_beta": array(prefix + "norm2.bias"),
                "W_fc1": array(prefix + "mlp.fc1.weight").T,
                "b_fc1": array(prefix + "mlp.fc1.bias"),
                "W_fc2": array(prefix + "mlp.fc2.weight").T,
                "b_fc2": array(prefix + "mlp.fc2.bias"),
            }
        )
    return {
        "W_patch": conv.transpose(2, 3, 1, 0).reshape(-1, conv.shape[0]),
        "patch_bias": array("patch_embed.proj.bias"),
        "cls_token": array("cls_token"),
        "pos_embed": array("pos_embed"),
        "encoder_weights": blocks,
        "norm_gamma": array("norm.weight"),
        "norm_beta": array("norm.bias"),
        "W_head": array("head.weight").T,
        "head_bias": array("head.bias"),
    }
