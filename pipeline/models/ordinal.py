"""Outputs over K ordered levels of pain (BL1 < PA1 < ... < PA4), beside the softmax head: ordinal (CORAL, CORN) and
regression, each a `Linear(D, ...)`-shaped head that can take the place of the `Linear(D, C)` head, with its loss and
its decoding.

- CORAL (Cao, Mirjalili and Raschka 2020): one weight vector shared by the K-1 binary tasks "level > k" and K-1
  biases; the loss is the sum of the tasks' binary cross-entropies. The biases are kept ordered by construction (the
  first bias, then cumulative softplus decrements), so P(level > k) never rises with k and the level probabilities
  are never negative, however the weights train.
- CORN (Shi, Cao and Raschka 2023): K-1 conditional tasks "level > k given level > k - 1", each trained on the
  samples of level >= k; P(level > k) is the product of the conditional probabilities (the product rule), so it too
  never rises with k.
- regression: one unit whose target is the level index (MSE or Huber); decoded as the rounded, clipped level, and
  as a cumulative logit with fixed cut points halfway between levels, so that it too gives level probabilities and
  a pain score P(level >= t) = sigmoid(intensity - t + 1/2), monotone in the intensity.

The outputs are a registry (`OUTPUT_KINDS`, name -> `OutputKind`: how it is checked, named and built), which
`model.output.name` names and the factory, the temporal heads and the model file ask; a new output is one
`register_output` call.

Decoding gives what the project's aggregation and threshold paths take: the level probabilities are the `prob_<class>`
columns (a video's mean of them is again a distribution), and the pain probability at level t is P(level >= t), which
at t = 1 is 1 - P(BL1), the binary rule of `data.tasks.NO_PAIN`. Every operation exports to ONNX (cumulative products
are taken as exponentials of cumulative sums of log-sigmoids).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.data.tasks import Task, graded_levels

SOFTMAX = "softmax"  # the default output: a kept model or a config without `output` has it
ORDINAL_METHODS = ("coral", "corn")
REGRESSION_LOSSES = ("mse", "huber")


@dataclass(frozen=True)
class OutputConfig:
    """`model.output` (configs/model/output/): what the network's last layer predicts. `softmax` (the default) adds no
    key to the config, so its section is absent and `from_config(None)` is softmax."""

    name: str
    ordinal: str | None = None  # ordinal: coral | corn
    loss: str | None = None  # regression: mse | huber
    huber_delta: float | None = None  # regression with huber: the error (in levels) where the loss turns linear
    pain_level: int | None = None  # ordinal, regression: the binary decision is pain = level >= pain_level

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> OutputConfig:
        """The config's `model.output` section (None or empty: softmax), checked."""
        if not section:
            return cls(SOFTMAX)
        config = cls(**dict(section))
        if config.name not in OUTPUT_KINDS:
            raise ValueError(f"model.output.name={config.name!r}: expected one of {', '.join(OUTPUT_KINDS)}")
        config.kind.check(config)
        if config.over_levels and (config.pain_level is None or config.pain_level < 1):
            raise ValueError(f"model.output.pain_level={config.pain_level!r}: expected a level of 1 or more")
        return config

    @property
    def kind(self) -> OutputKind:
        return OUTPUT_KINDS[self.name]

    @property
    def over_levels(self) -> bool:
        """Whether the output predicts ordered levels (ordinal, regression), not classes (softmax)."""
        return self.kind.over_levels

    def meta(self) -> dict[str, Any]:
        """What a kept model records of its output (`model_file`): nothing for softmax (a kept model without the
        key is softmax, as every model kept before outputs existed), else `{"output": <the settings>}`."""
        return {} if self.name == SOFTMAX else {"output": asdict(self)}

    @property
    def label(self) -> str:
        """How a run names its output: softmax, ordinal_coral, ordinal_corn, regression_huber."""
        return self.kind.label(self)


def task_levels(task: Task, config: OutputConfig) -> int:
    """K, the number of levels the output predicts for `task` (its labels 0..K-1 are its levels in order); an ordinal
    or regression output on a task whose classes are not ordered levels is refused, naming them."""
    if config.over_levels:
        graded_levels(task)
        if config.pain_level is not None and config.pain_level >= task.n_classes:
            raise ValueError(f"model.output.pain_level={config.pain_level} is not a level of task {task.name!r} "
                             f"(levels 0..{task.n_classes - 1}: {', '.join(task.classes)})")
    return task.n_classes


def graded_scoring(task: Task, config: OutputConfig) -> bool:
    """Whether a task's test videos are scored with the graded metrics (`evaluation.graded`: MAE, kappa, Spearman
    within subject, the level-ordered confusion): a task whose classes are BioVid's levels in order, with more than
    two of them (five_class) or an output over levels (ordinal, regression). A binary softmax task is not: its MAE is
    1 - accuracy and its kappa Cohen's, beside the accuracy and balanced accuracy it logs already, and a default
    run's metrics stay as they were."""
    try:
        graded_levels(task)
    except ValueError:
        return False
    return task.n_classes > 2 or config.over_levels


def _check_levels(n_levels: int) -> None:
    if n_levels < 2:
        raise ValueError(f"an output over ordered levels needs at least 2 levels, got {n_levels}")


def _level_targets(levels: torch.Tensor, n_tasks: int) -> torch.Tensor:
    """(N, K-1) booleans: level > k for k = 0..K-2."""
    return levels.long().unsqueeze(1) > torch.arange(n_tasks, device=levels.device)


def levels_from_cumulative(cumulative: torch.Tensor) -> torch.Tensor:
    """Level probabilities (N, K) from P(level > k) (N, K-1), non-increasing in k: P(level = k) = P(level > k - 1) -
    P(level > k), with P(level > -1) = 1 and P(level > K - 1) = 0; non-negative, and they sum to 1."""
    ones = torch.ones_like(cumulative[:, :1])
    return torch.cat([ones, cumulative], dim=1) - torch.cat([cumulative, torch.zeros_like(ones)], dim=1)


class LevelHead(nn.Module):
    """A head over K ordered levels, decoded through P(level > k) for k = 0..K-2; the decoding is shared."""

    n_levels: int

    def cumulative(self, outputs: torch.Tensor) -> torch.Tensor:
        """P(level > k), (N, K-1), non-increasing in k."""
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def level_probabilities(self, outputs: torch.Tensor) -> torch.Tensor:
        """P(level = k), (N, K): the `prob_<class>` columns."""
        return levels_from_cumulative(self.cumulative(outputs))

    def predicted_level(self, outputs: torch.Tensor) -> torch.Tensor:
        """The number of tasks "level > k" with P(level > k) > 0.5 (CORAL's rule; for CORN with its product rule's
        probabilities)."""
        return (self.cumulative(outputs) > 0.5).sum(dim=1)

    def pain_probability(self, outputs: torch.Tensor, level: int) -> torch.Tensor:
        """P(level >= `level`), the binary pain probability at a chosen level (1: any pain, 1 - P(BL1))."""
        if not 1 <= level < self.n_levels:
            raise ValueError(f"pain level {level} outside 1..{self.n_levels - 1}")
        return self.cumulative(outputs)[:, level - 1]


class OrdinalHead(LevelHead):
    """An ordinal head: K-1 logits, one per task "level > k"."""


class CoralHead(OrdinalHead):
    """CORAL: logits w.x + b_k with one shared `w` and biases b_0 > b_1 > ... > b_{K-2}, ordered by construction
    (b_k = first_bias - sum of softplus(bias_steps) up to k). Initial biases as coral-pytorch's: (K-1-k)/(K-1)."""

    def __init__(self, in_features: int, n_levels: int) -> None:
        super().__init__()
        _check_levels(n_levels)
        self.n_levels = n_levels
        self.weight = nn.Linear(in_features, 1, bias=False)
        self.first_bias = nn.Parameter(torch.ones(1))
        step = 1.0 / (n_levels - 1)
        self.bias_steps = nn.Parameter(torch.full((n_levels - 2,), math.log(math.expm1(step))))  # softplus = step

    def biases(self) -> torch.Tensor:
        """The K-1 biases, strictly decreasing (softplus > 0; equal only where a step underflows to 0)."""
        drops = torch.cumsum(F.softplus(self.bias_steps), dim=0)
        return self.first_bias - torch.cat([torch.zeros_like(self.first_bias), drops])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.weight(features) + self.biases()

    def cumulative(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.exp(F.logsigmoid(logits))

    def loss(self, logits: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Sum over the K-1 tasks of their binary cross-entropies, mean over the batch."""
        targets = _level_targets(levels, logits.shape[1]).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(dim=1).mean()


class CornHead(OrdinalHead):
    """CORN: K-1 conditional logits (a `Linear(D, K-1)`), task k trained only on samples of level >= k; P(level > k)
    is the product of sigmoid(logit_j) for j <= k."""

    def __init__(self, in_features: int, n_levels: int) -> None:
        super().__init__()
        _check_levels(n_levels)
        self.n_levels = n_levels
        self.linear = nn.Linear(in_features, n_levels - 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    def cumulative(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.cumsum(F.logsigmoid(logits), dim=1))

    def loss(self, logits: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Binary cross-entropy of each task over its conditional training subset (level >= k), summed over tasks
        and divided by the subsets' total size (Shi et al.; coral-pytorch's corn_loss)."""
        tasks = torch.arange(logits.shape[1], device=levels.device)
        subset = (levels.long().unsqueeze(1) >= tasks).to(logits.dtype)
        targets = _level_targets(levels, logits.shape[1]).to(logits.dtype)
        terms = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        return (terms * subset).sum() / subset.sum().clamp_min(1.0)


class RegressionHead(LevelHead):
    """One unit predicting the level index (intensity); MSE or Huber loss. Decoded as a cumulative logit with fixed
    cut points halfway between levels, P(level > k) = sigmoid(intensity - k - 1/2): the level probabilities are a
    distribution (the `prob_<class>` columns, as an ordinal head's), and the pain probability at level t,
    sigmoid(intensity - t + 1/2), grows with the intensity and is 0.5 where the rounded level reaches t."""

    def __init__(self, in_features: int, n_levels: int, loss: str, huber_delta: float | None = None) -> None:
        super().__init__()
        _check_levels(n_levels)
        if loss not in REGRESSION_LOSSES or (loss == "huber" and huber_delta is None):
            raise ValueError(f"regression loss {loss!r} (huber_delta {huber_delta}): expected mse, or huber with "
                             f"a delta")
        self.n_levels, self.loss_name, self.huber_delta = n_levels, loss, huber_delta
        self.linear = nn.Linear(in_features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    @staticmethod
    def intensity(outputs: torch.Tensor) -> torch.Tensor:
        """The predicted intensity (N,), on the level scale."""
        return outputs[:, 0]

    def cumulative(self, outputs: torch.Tensor) -> torch.Tensor:
        cut_points = torch.arange(self.n_levels - 1, device=outputs.device, dtype=outputs.dtype) + 0.5
        return torch.sigmoid(outputs[:, :1] - cut_points)

    def loss(self, outputs: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        target = levels.to(outputs.dtype)
        if self.loss_name == "mse":
            return F.mse_loss(self.intensity(outputs), target)
        return F.huber_loss(self.intensity(outputs), target, delta=float(self.huber_delta))

    def predicted_level(self, outputs: torch.Tensor) -> torch.Tensor:
        """The rounded intensity, clipped to 0..K-1 (the count of cut points passed, but at exact halves, which
        round to even)."""
        return torch.round(self.intensity(outputs)).clamp(0, self.n_levels - 1).long()


@dataclass(frozen=True)
class OutputKind:
    """One `model.output.name`: `build(config, in_features, n_levels)`, its last layer; `label(config)`, how runs name
    it; `check(config)`, its own settings refused where wrong; `over_levels`: it predicts ordered levels."""

    name: str
    build: Callable[[OutputConfig, int, int], nn.Module]
    label: Callable[[OutputConfig], str]
    check: Callable[[OutputConfig], None] = lambda config: None
    over_levels: bool = True


OUTPUT_KINDS: dict[str, OutputKind] = {}


def register_output(kind: OutputKind) -> OutputKind:
    """Add an output that `model.output.name` may name (a name already taken is an error)."""
    if kind.name in OUTPUT_KINDS:
        raise ValueError(f"an output named {kind.name!r} exists already")
    OUTPUT_KINDS[kind.name] = kind
    return kind


def _check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"model.output.{setting}={value!r}: expected one of {', '.join(choices)}")


def _ordinal_head(config: OutputConfig, in_features: int, n_levels: int) -> nn.Module:
    return (CoralHead if config.ordinal == "coral" else CornHead)(in_features, n_levels)


def _regression_head(config: OutputConfig, in_features: int, n_levels: int) -> nn.Module:
    return RegressionHead(in_features, n_levels, str(config.loss), config.huber_delta)


register_output(OutputKind(SOFTMAX, lambda config, features, levels: nn.Linear(features, levels),
                           lambda config: SOFTMAX, over_levels=False))
register_output(OutputKind("ordinal", _ordinal_head, lambda config: f"ordinal_{config.ordinal}",
                           lambda config: _check_choice("ordinal", config.ordinal, ORDINAL_METHODS)))
register_output(OutputKind("regression", _regression_head, lambda config: f"regression_{config.loss}",
                           lambda config: _check_choice("loss", config.loss, REGRESSION_LOSSES)))


def build_output_head(config: OutputConfig, in_features: int, n_levels: int) -> nn.Module:
    """The last layer `config` asks for, over `in_features` embeddings: `Linear(D, K)` for softmax (the head the
    network has now), `CoralHead` / `CornHead`, or `RegressionHead`."""
    return config.kind.build(config, in_features, n_levels)


def output_probabilities(head: nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    """The `prob_<class>` of a batch of any output head: softmax of a `Linear(D, K)`'s logits (what a fold scores
    now), the level probabilities of an ordinal or regression head. Where an evaluation step calls `softmax`."""
    if isinstance(head, LevelHead):
        return head.level_probabilities(outputs)
    return outputs.softmax(dim=1)


class LevelProbabilities(nn.Module):
    """An ordinal or regression head that outputs its level probabilities: what an exported (ONNX) or served model
    returns, so that a runtime reads `prob_<class>` as it does of a softmax model."""

    def __init__(self, head: LevelHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.level_probabilities(self.head(features))
