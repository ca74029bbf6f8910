"""Temporal heads: a clip's T frame embeddings (B, T, D) -> class logits (B, n_classes).

`linear` is not a temporal head: it is today's per-frame `Linear(D, n)` of `PainNet`, whose frame probabilities are
aggregated per video afterwards (`pipeline.evaluation.aggregation`). The others see the whole clip at once:

- `attention`: a learned score per frame, softmax over time, the weighted mean of the embeddings, then a linear layer.
- `gru`: a (bidirectional) GRU over the frames in time order; its last states, then a linear layer.
- `transformer`: a small transformer encoder over the frames with learned time-position embeddings and a class token
  whose final state is classified (the frame-encoder + temporal-transformer design of the BioVid literature).

Every head projects D to `hidden` first, so its size does not grow with the backbone's width. Its last layer is
`Linear(hidden, n_classes)`, or under `model.output=ordinal|regression` that output's head over the levels
(`ClipLevels`): a temporal head predicts levels as a frame model does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.models.ordinal import LevelHead, OutputConfig, build_output_head

HEADS = ("linear", "attention", "gru", "transformer")


@dataclass(frozen=True)
class HeadConfig:
    """The `model.head` group: which head and its sizes (values in configs/model/timm.yaml)."""

    name: str  # linear | attention | gru | transformer
    hidden: int  # the width every temporal head works at (D is projected to it)
    layers: int  # gru / transformer layers
    attention_heads: int  # transformer attention heads (hidden must divide by it)
    dropout: float
    max_frames: int  # transformer: the longest clip its time-position embeddings cover
    epochs: int  # two_stage: the head's epochs at most (an epoch over a fold's clips takes milliseconds)
    patience: int  # two_stage: epochs without a better validation score before the head stops
    # the head mode (pipeline.runs.jobs.head_modes, which checks the names): of a temporal head, `mode`: two_stage (on
    # the fold's frame model's embeddings) | end_to_end; of the linear head, `fit`: lightning | in_memory
    mode: str
    fit: str

    def __post_init__(self) -> None:
        if self.name not in HEADS:
            raise ValueError(f"model.head.name={self.name!r}: expected one of {', '.join(HEADS)}")
        if min(self.hidden, self.layers, self.attention_heads, self.max_frames) < 1:
            raise ValueError(f"model.head sizes must be >= 1, got {self}")
        if self.name == "transformer" and self.hidden % self.attention_heads:
            raise ValueError(f"model.head.hidden={self.hidden} must divide by attention_heads={self.attention_heads}")

    @property
    def temporal(self) -> bool:
        """Whether the head sees a whole clip (anything but the per-frame linear head)."""
        return self.name != "linear"

    @property
    def label(self) -> str:
        """The head and its training mode as one tag value: `linear`, `attention_h64_two_stage`,
        `transformer_h64x2_end_to_end`."""
        if self.name == "linear":
            return "linear"
        size = f"h{self.hidden}" if self.name == "attention" else f"h{self.hidden}x{self.layers}"
        return f"{self.name}_{size}_{self.mode}"

    @classmethod
    def from_config(cls, head: Mapping[str, Any]) -> HeadConfig:
        """The `model.head` group, every setting given (configs/model/timm.yaml holds the defaults)."""
        names = {field.name for field in fields(cls)}
        unknown, missing = sorted(set(dict(head)) - names), sorted(names - set(dict(head)))
        if unknown or missing:
            raise ValueError(f"model.head: unknown setting(s) {unknown}, missing {missing}; known: {sorted(names)}")
        return cls(**dict(head))

    @classmethod
    def from_model_file(cls, head: Mapping[str, Any]) -> HeadConfig:
        """The head a kept model file records; one kept before a training setting was recorded (`fit` before
        2026-12-04, `epochs`, `patience` before the two-stage head) trained as every head did then (`RECORDED_LATER`):
        these settings shape how a head trains, never the network a file holds."""
        return cls.from_config({**RECORDED_LATER, **dict(head)})


# What a head kept before its file recorded these settings trained with: the only fit there was (Lightning's), and
# the two-stage head's first epochs and patience.
RECORDED_LATER = {"fit": "lightning", "epochs": 50, "patience": 10}


class AttentionPoolHead(nn.Module):
    """Softmax-over-time attention pooling of the projected frame embeddings, then a linear classifier."""

    def __init__(self, in_features: int, n_classes: int, config: HeadConfig) -> None:
        super().__init__()
        self.project = nn.Sequential(nn.Linear(in_features, config.hidden), nn.GELU(), nn.Dropout(config.dropout))
        self.score = nn.Linear(config.hidden, 1)
        self.classify = nn.Linear(config.hidden, n_classes)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        hidden = self.project(embeddings)  # (B, T, H)
        weights = self.score(hidden).softmax(dim=1)  # (B, T, 1): how much each frame counts
        return self.classify((weights * hidden).sum(dim=1))


class GruHead(nn.Module):
    """A bidirectional GRU over the frames in time order; the two directions' final states, then a linear layer."""

    def __init__(self, in_features: int, n_classes: int, config: HeadConfig) -> None:
        super().__init__()
        self.project = nn.Linear(in_features, config.hidden)
        self.gru = nn.GRU(config.hidden, config.hidden, num_layers=config.layers, batch_first=True,
                          bidirectional=True, dropout=config.dropout if config.layers > 1 else 0.0)
        self.dropout = nn.Dropout(config.dropout)
        self.classify = nn.Linear(2 * config.hidden, n_classes)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(self.project(embeddings))  # last: (2 * layers, B, H)
        return self.classify(self.dropout(torch.cat([last[-2], last[-1]], dim=1)))


# A transformer head's keys as `nn.TransformerEncoder(nn.TransformerEncoderLayer(norm_first=True))` named them
# before `TemporalBlock` replaced it (the same weights in the same packing): kept models of then still load.
ENCODER_LAYER_KEYS = {"self_attn.in_proj_weight": "qkv.weight", "self_attn.in_proj_bias": "qkv.bias",
                      "self_attn.out_proj.weight": "proj.weight", "self_attn.out_proj.bias": "proj.bias",
                      "linear1.weight": "mlp.0.weight", "linear1.bias": "mlp.0.bias",
                      "linear2.weight": "mlp.3.weight", "linear2.bias": "mlp.3.bias",
                      "norm1.weight": "norm1.weight", "norm1.bias": "norm1.bias",
                      "norm2.weight": "norm2.weight", "norm2.bias": "norm2.bias"}


class TemporalBlock(nn.Module):
    """A pre-norm transformer encoder block (self-attention, then a GELU MLP of twice the width, each with a residual)
    over (B, L, H) tokens: the computation of `nn.TransformerEncoderLayer(norm_first=True, activation="gelu")`,
    initialised as it is. Written out because that layer's attention fixes the sequence length when traced for ONNX:
    every reshape here keeps L free, so an exported clip model takes windows of any length up to `max_frames`."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * hidden, hidden))
        self.dropout = nn.Dropout(dropout)
        self.attention_dropout = dropout
        nn.init.xavier_uniform_(self.qkv.weight)  # nn.MultiheadAttention's initialisation
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = tokens.shape
        qkv = self.qkv(self.norm1(tokens)).reshape(batch, -1, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, L, head width)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout if self.training else 0.0)
        tokens = tokens + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, -1, hidden)))
        return tokens + self.dropout(self.mlp(self.norm2(tokens)))


class TransformerHead(nn.Module):
    """A class token and the projected frames, plus learned time-position embeddings, through a pre-norm
    transformer encoder; the class token's final state (after a LayerNorm) is classified."""

    def __init__(self, in_features: int, n_classes: int, config: HeadConfig) -> None:
        super().__init__()
        self.project = nn.Linear(in_features, config.hidden)
        self.class_token = nn.Parameter(torch.zeros(1, 1, config.hidden))
        self.time_position = nn.Parameter(torch.zeros(1, config.max_frames + 1, config.hidden))
        nn.init.trunc_normal_(self.class_token, std=0.02)
        nn.init.trunc_normal_(self.time_position, std=0.02)
        self.encoder = nn.Sequential(*(TemporalBlock(config.hidden, config.attention_heads, config.dropout)
                                       for _ in range(config.layers)))
        self.norm = nn.LayerNorm(config.hidden)
        self.classify = nn.Linear(config.hidden, n_classes)
        self.max_frames = config.max_frames
        self.register_load_state_dict_pre_hook(_rename_encoder_layer_keys)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        frames = embeddings.shape[1]
        if frames > self.max_frames:
            raise ValueError(f"a clip of {frames} frames is longer than model.head.max_frames={self.max_frames}")
        tokens = torch.cat([self.class_token.expand(embeddings.shape[0], -1, -1), self.project(embeddings)], dim=1)
        encoded = self.encoder(tokens + self.time_position[:, : frames + 1])
        return self.classify(self.norm(encoded[:, 0]))


def _rename_encoder_layer_keys(module, state_dict, prefix, *_) -> None:
    """Load a state dict written when the encoder was `nn.TransformerEncoder` (`encoder.layers.<i>.<old key>`)."""
    for key in [k for k in state_dict if k.startswith(f"{prefix}encoder.layers.")]:
        layer, _, rest = key.removeprefix(f"{prefix}encoder.layers.").partition(".")
        if rest in ENCODER_LAYER_KEYS:
            state_dict[f"{prefix}encoder.{layer}.{ENCODER_LAYER_KEYS[rest]}"] = state_dict.pop(key)


class PerFrameLinearHead(nn.Module):
    """The linear head applied to every frame of a clip, its logits averaged over time: the frame model's view of a
    clip, so a `linear` head can be trained or scored on clips too."""

    def __init__(self, in_features: int, n_classes: int) -> None:
        super().__init__()
        self.classify = nn.Linear(in_features, n_classes)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.classify(embeddings).mean(dim=1)


def build_temporal_head(config: HeadConfig, in_features: int, n_classes: int,
                        output: OutputConfig | None = None) -> nn.Module:
    """The head of `config` over clips of `in_features`-wide frame embeddings. `output`: its last layer (None or
    softmax: `Linear(hidden, n_classes)`; ordinal or regression: that head over `n_classes` levels, the temporal head
    then a `ClipLevels`)."""
    if config.name == "attention":
        head: nn.Module = AttentionPoolHead(in_features, n_classes, config)
    elif config.name == "gru":
        head = GruHead(in_features, n_classes, config)
    elif config.name == "transformer":
        head = TransformerHead(in_features, n_classes, config)
    else:
        head = PerFrameLinearHead(in_features, n_classes)
    if output is None or not output.over_levels:
        return head
    head.classify = build_output_head(output, head.classify.in_features, n_classes)
    return ClipLevels(head)


class ClipLevels(LevelHead):
    """A temporal head whose last layer (`classify`) is an ordinal or regression head over K levels: the clip's
    outputs are that layer's, decoded, scored and trained as it does (`pipeline.models.ordinal`), so a clip model
    over levels is read like a frame model over levels (`output_probabilities`, the LightningModule's loss, export)."""

    def __init__(self, temporal: nn.Module) -> None:
        super().__init__()
        if not isinstance(temporal.classify, LevelHead):
            raise TypeError(f"ClipLevels needs a temporal head whose last layer is a level head, got "
                            f"{type(temporal.classify).__name__}")
        self.temporal = temporal
        self.n_levels = temporal.classify.n_levels

    @property
    def levels(self) -> LevelHead:
        return self.temporal.classify

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.temporal(embeddings)

    def cumulative(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.levels.cumulative(outputs)

    def loss(self, outputs: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        return self.levels.loss(outputs, levels)

    def level_probabilities(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.levels.level_probabilities(outputs)

    def predicted_level(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.levels.predicted_level(outputs)


def head_parameters(head: nn.Module) -> int:
    """The head's parameter count (logged as `head_parameters` on its run)."""
    return sum(p.numel() for p in head.parameters())


class ClipNet(nn.Module):
    """A frame backbone and a temporal head: clips (B, T, 3, H, W) -> logits (B, n_classes), trained end to end.

    `forward_embeddings` runs the head alone on precomputed frame embeddings (B, T, D): the second stage of
    two-stage training and the frozen-backbone probe over time.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, channels_last: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.channels_last = channels_last  # the backbone runs its (B * T) frames in channels-last memory

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        batch, frames = clips.shape[:2]
        images = clips.flatten(0, 1)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        embeddings = self.backbone(images).reshape(batch, frames, -1)
        return self.head(embeddings)

    def forward_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.head(embeddings)
