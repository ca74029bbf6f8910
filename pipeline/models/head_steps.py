"""A linear softmax head's training step written out: its gradient and torch's AdamW update as a few tensor ops, what
the in-memory probe (`probe_training`, one head) and the lockstep probes (`probe_batch`, many heads) share.

A frozen backbone's probe is one `Linear(D, C)` on cached embeddings: a step of autograd, `torch.optim.AdamW`,
`clip_grad_norm_` and the LR scheduler costs about 340 us on one CPU thread, almost all of it Python and dispatch
around a (32, D) x (D, C) product. Written out it costs about 60 us, and it is the same arithmetic:

- the mean cross-entropy over the batch (with label smoothing e: the target is (1 - e) one-hot + e / C) has the
  logits' gradient (softmax - target) / B, so the head's is that times the batch's embeddings (the bias: its sum);
- `clip_grad_norm_`'s coefficient max_norm / (norm + 1e-6), at most 1, over the weight's and the bias' gradients;
- AdamW's update as torch computes it: decoupled weight decay (none on the bias: `parameter_groups`), the two
  moments, bias corrections from the step count, eps added after the second moment's corrected root.

A head's weight and bias sit side by side (the bias as the last column), so one tensor holds its parameters and one
its gradient. `tests/test_probe_training.py` holds the written-out fit to the Lightning fit's weights.
"""

from __future__ import annotations

import math

import torch

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults, which the project's optimizer uses
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coefficient max_norm / (norm + 1e-6), at most 1


def adamw_update(param: torch.Tensor, first: torch.Tensor, second: torch.Tensor, grad: torch.Tensor,
                 rate: torch.Tensor, steps: torch.Tensor, decay: torch.Tensor) -> None:
    """AdamW's update in place of many heads' `param` and moments `first`, `second` (M, C, D + 1) from `grad`, each
    head at its learning rate `rate` (M, 1, 1) after its `steps` (M,) steps (this one counted); `decay` is the weight
    decay per column (0 for the bias)."""
    beta1, beta2 = ADAM_BETAS
    correction1 = (1 - beta1**steps).float().view(-1, 1, 1)
    correction2_sqrt = torch.sqrt(1 - beta2**steps).float().view(-1, 1, 1)
    param.mul_(1 - rate * decay)
    first.lerp_(grad, 1 - beta1)
    second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_((rate / correction1) * first / (second.sqrt() / correction2_sqrt + ADAM_EPS))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_`'s factor for gradients of total norm `norm`."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


class LinearHeadStep:
    """Training steps of one linear softmax head: the cross-entropy against a target distribution per crop (one-hot,
    or smoothed), gradient clipping and AdamW at the learning rate each step is given (module docstring). It reads
    embeddings with a last column of ones (`with_ones`): the bias is that column's weight, so the logits and the
    gradient are one matrix product each.

    `weight` (C, D) and `bias` (C,) are the head's parameters; `write_back` puts the current ones into them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, weight_decay: float, max_norm: float | None) -> None:
        classes, features = weight.shape
        self.weight, self.bias = weight, bias
        self.state = torch.zeros(3, classes, features + 1)  # parameters, first and second moments
        self.state[0, :, :features], self.state[0, :, features] = weight.detach(), bias.detach()
        self.weight_decay, self.max_norm, self.steps = float(weight_decay), max_norm, 0
        self.param, self.first, self.second = self.state.unbind(0)

    @staticmethod
    def with_ones(x: torch.Tensor) -> torch.Tensor:
        """Embeddings (N, D) as the step reads them: (N, D + 1), the last column ones."""
        return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)

    @staticmethod
    def targets(labels: torch.Tensor, classes: int, smoothing: float) -> torch.Tensor:
        """The cross-entropy's target distribution per crop: (1 - smoothing) one-hot + smoothing / classes, as
        `F.cross_entropy(label_smoothing=...)` takes it."""
        return torch.nn.functional.one_hot(labels, classes).float() * (1 - smoothing) + smoothing / classes

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, targets: torch.Tensor, rate: float) -> torch.Tensor:
        """One step on the batch `x` (B, D + 1) with its `targets` (B, C) at learning rate `rate`; the batch's logits
        before the step."""
        param, first, second = self.param, self.first, self.second
        logits = x @ param.T
        grad = torch.softmax(logits, dim=1).sub_(targets).T @ x  # B times the mean loss's gradient
        scale = 1 / len(x)
        if self.max_norm:
            scale *= min(self.max_norm / (float(torch.linalg.vector_norm(grad)) * scale + CLIP_EPS), 1.0)
        grad.mul_(scale)
        self.steps += 1
        beta1, beta2 = ADAM_BETAS
        param[:, :-1].mul_(1 - rate * self.weight_decay)  # decoupled weight decay: not on the bias
        first.lerp_(grad, 1 - beta1)
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = second.sqrt().div_(math.sqrt(1 - beta2**self.steps)).add_(ADAM_EPS)
        param.addcdiv_(first, denominator, value=-rate / (1 - beta1**self.steps))
        return logits

    def write_back(self) -> None:
        """The current parameters into the head's `weight` and `bias`."""
        with torch.no_grad():
            self.weight.copy_(self.state[0, :, :-1])
            self.bias.copy_(self.state[0, :, -1])
