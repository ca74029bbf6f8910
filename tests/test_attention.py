"""Attention rollout, attention capture from timm's ViT, mean attention distance, the ViT paper's pictures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.analysis.attention import (
    AttentionRecorder,
    NoAttentionCaptured,
    attention_rollout,
    mean_attention_distance,
    patch_embedding_components,
    position_embedding_similarity,
)
from pipeline.models.factory import create_model


def test_rollout_equals_the_hand_computation_on_two_layers() -> None:
    # 3 tokens (class token, two patches), 2 heads. Layer 1's heads differ; layer 2's are equal.
    layer1 = torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.6, 0.2], [0.1, 0.3, 0.6]],
                           [[0.2, 0.4, 0.4], [0.4, 0.4, 0.2], [0.3, 0.1, 0.6]]])
    layer2 = torch.tensor([[[0.6, 0.2, 0.2], [0.25, 0.5, 0.25], [0.2, 0.2, 0.6]]] * 2)
    # By hand: heads averaged, 0.5 A + 0.5 I, rows re-normalised (they already sum to 1):
    #   Ã1 = [[0.675, 0.1625, 0.1625], [0.15, 0.75, 0.1], [0.1, 0.1, 0.8]]
    #   Ã2 = [[0.8, 0.1, 0.1], [0.125, 0.75, 0.125], [0.1, 0.1, 0.8]]
    # R = Ã2 Ã1, class-token row = 0.8 Ã1[0] + 0.1 Ã1[1] + 0.1 Ã1[2] = [0.565, 0.215, 0.22]; patches: [0.215, 0.22].
    # (The other order, Ã1 Ã2, would give [0.205625, 0.2178125].)
    rollout = attention_rollout([layer1, layer2], num_prefix_tokens=1)
    np.testing.assert_allclose(rollout.numpy(), [[0.215, 0.22]], atol=1e-6)


def test_rollout_renormalises_rows_and_takes_batches() -> None:
    # rows summing to 2: after 0.5 A + 0.5 I a row sums to 1.5 and must be divided by it
    weights = torch.full((4, 1, 2, 2), 1.0)
    rollout = attention_rollout([weights], num_prefix_tokens=1)
    # one layer: Ã = [[1, 0.5], [0.5, 1]] / 1.5 -> class token's patch entry 0.5 / 1.5
    np.testing.assert_allclose(rollout.numpy(), np.full((4, 1), 1 / 3), atol=1e-6)


def test_rollout_without_weights_fails_loudly() -> None:
    with pytest.raises(NoAttentionCaptured):
        attention_rollout([])


@pytest.fixture(scope="module")
def tiny_vit():
    torch.manual_seed(0)
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, pretrained=False, img_size=32)
    return net.eval()


def test_recorder_captures_the_softmax_weights_of_every_block(tiny_vit) -> None:
    vit = tiny_vit.backbone.model
    fused_before = [block.attn.fused_attn for block in vit.blocks]
    block_input = {}
    handle = vit.blocks[0].register_forward_hook(lambda module, inputs, output: block_input.update(x=inputs[0]))
    images = torch.randn(2, 3, 32, 32)
    try:
        with torch.no_grad(), AttentionRecorder(tiny_vit) as recorder:
            tiny_vit(images)
    finally:
        handle.remove()
    weights = recorder.checked()
    assert len(weights) == len(vit.blocks) and weights[0].shape == (2, 3, 5, 5)  # 2 x 2 patches + class token
    # block 0's attention recomputed from its own q and k
    attn = vit.blocks[0].attn
    with torch.no_grad():
        qkv = attn.qkv(vit.blocks[0].norm1(block_input["x"])).reshape(2, 5, 3, 3, 64).permute(2, 0, 3, 1, 4)
        expected = (qkv[0] @ qkv[1].transpose(-2, -1) / math.sqrt(64)).softmax(-1)
    torch.testing.assert_close(weights[0], expected, atol=1e-5, rtol=1e-5)
    assert [block.attn.fused_attn for block in vit.blocks] == fused_before  # the fast path is restored


def test_no_capture_is_an_error_not_a_uniform_map(tiny_vit) -> None:
    recorder = AttentionRecorder(tiny_vit)
    with torch.no_grad():
        tiny_vit(torch.randn(1, 3, 32, 32))  # outside the recording: the fused kernel keeps no weights
    with pytest.raises(NoAttentionCaptured, match="no attention weights"):
        recorder.checked()
    with pytest.raises(TypeError, match="VisionTransformer"):
        AttentionRecorder(create_model("resnet10t", n_classes=2, pretrained=False)[0])


def test_mean_attention_distance_of_identity_and_uniform_attention() -> None:
    grid, patch = (2, 2), 16
    identity = torch.eye(5).expand(3, 5, 5)  # 3 heads, class token + 4 patches
    np.testing.assert_allclose(mean_attention_distance(identity, grid, patch).numpy(), np.zeros(3), atol=1e-6)
    uniform = torch.full((2, 3, 5, 5), 1 / 5)
    # every patch of a 2 x 2 grid sees itself (0), two neighbours (P) and the diagonal one (P sqrt 2)
    expected = (0 + 2 * patch + patch * math.sqrt(2)) / 4
    np.testing.assert_allclose(mean_attention_distance(uniform, grid, patch).numpy(), np.full(3, expected),
                               rtol=1e-6)


def test_mean_attention_distance_of_a_head_that_looks_one_patch_right() -> None:
    # 1 x 3 grid, no class token: patches 0 and 1 attend to their right neighbour, patch 2 to patch 0
    weights = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    distance = mean_attention_distance(weights, (1, 3), patch_size=8, num_prefix_tokens=0)
    np.testing.assert_allclose(distance.numpy(), [(8 + 8 + 16) / 3], rtol=1e-6)


def test_patch_embedding_components_are_orthonormal_and_ordered() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 3, 4, 4) * torch.linspace(0.1, 2, 48).reshape(1, 3, 4, 4)
    components, explained = patch_embedding_components(weight, n_components=6)
    assert components.shape == (6, 4, 4, 3)
    flat = components.transpose(0, 3, 1, 2).reshape(6, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(6), atol=1e-5)
    assert np.all(np.diff(explained) <= 0) and 0 < explained.sum() <= 1


def test_position_embedding_similarity_has_ones_on_the_diagonal(tiny_vit) -> None:
    similarity = position_embedding_similarity(tiny_vit.backbone.model.pos_embed, (2, 2), num_prefix_tokens=1)
    assert similarity.shape == (2, 2, 2, 2)
    np.testing.assert_allclose([similarity[i, j, i, j] for i in range(2) for j in range(2)], 1.0, atol=1e-5)
    assert np.all(similarity <= 1 + 1e-5) and np.allclose(similarity, similarity.transpose(2, 3, 0, 1), atol=1e-6)
