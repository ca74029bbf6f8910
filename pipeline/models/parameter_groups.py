"""A backbone's parameters in groups, ordered from the stem to the top, each parameter exactly once: what
discriminative learning rates (layer decay) and the fine-tuning strategies (`pipeline.models.finetune`: the top blocks)
read of every adapter (`Backbone.parameter_groups`, `pipeline.models.backbones`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from torch import nn

ParameterGroups = list[tuple[str, list[nn.Parameter]]]


def timm_matcher_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], matcher: dict) -> ParameterGroups:
    """Group parameters by timm's group_matcher regexes, one group per matched layer index, ordered stem to top.

    timm's own `group_parameters` folds the final norm into the last block (for layer decay); here it stays a group
    of its own, so the top group is what sits right under the head.
    """
    rules: list[tuple[re.Pattern, tuple[float, ...], str]] = []
    for ordinal, (matcher_name, spec) in enumerate(matcher.items()):
        if spec is None:
            continue
        for pattern, suffix in [(spec, None)] if isinstance(spec, str) else spec:
            rules.append((re.compile(pattern), (float(ordinal),) + tuple(map(float, suffix or ())), matcher_name))

    def group_key(parameter_name: str) -> tuple[tuple[float, ...], str]:
        for pattern, ordinal, matcher_name in rules:
            match = pattern.match(parameter_name)
            if match:
                indices = tuple(float(index) for index in match.groups() if index is not None)
                return (ordinal[:1] + indices + ordinal[1:]), matcher_name
        return (math.inf,), "head"  # unmatched (e.g. a neck) sits on top, as in timm

    grouped: dict[tuple[float, ...], tuple[str, list[tuple[str, nn.Parameter]]]] = {}
    for parameter_name, parameter in named_parameters:
        key, matcher_name = group_key(parameter_name)
        grouped.setdefault(key, (matcher_name, []))[1].append((parameter_name, parameter))
    groups: ParameterGroups = []
    for _, (fallback, members) in sorted(grouped.items()):
        name = _group_name([parameter_name for parameter_name, _ in members], fallback)
        if name in {existing for existing, _ in groups}:
            name = f"{name}.{len(groups)}"  # names are for logs; keep them unique
        groups.append((name, [parameter for _, parameter in members]))
    return groups


def child_groups(model: nn.Module) -> ParameterGroups:
    """Fallback for models without a group matcher: one group per top-level child, in registration order."""
    groups: ParameterGroups = [(name, list(child.parameters())) for name, child in model.named_children()]
    direct = list(model.parameters(recurse=False))
    return ([("stem", direct)] if direct else []) + [(name, params) for name, params in groups if params]


def _group_name(parameter_names: Sequence[str], fallback: str) -> str:
    """The dotted module path all parameters share (e.g. "blocks.3"), else the matcher's name (e.g. "stem")."""
    common = parameter_names[0].split(".")[:-1]
    for parameter_name in parameter_names[1:]:
        parts = parameter_name.split(".")[:-1]
        length = 0
        while length < min(len(common), len(parts)) and common[length] == parts[length]:
            length += 1
        common = common[:length]
    return ".".join(common) or fallback


def check_groups_cover(module: nn.Module, groups: ParameterGroups) -> None:
    grouped = [id(parameter) for _, parameters in groups for parameter in parameters]
    expected = {id(parameter) for parameter in module.parameters()}
    if len(grouped) != len(set(grouped)) or set(grouped) != expected:
        raise RuntimeError(f"parameter groups of {type(module).__name__} do not cover each parameter exactly once")
    if any(not parameters for _, parameters in groups):
        raise RuntimeError(f"parameter groups of {type(module).__name__} include an empty group")
