"""What trains in a fine-tuning run: one small strategy object per `model.finetune`, not branches in the training step.

- `full` (default): every backbone weight trains, at the discriminative learning rates of `parameter_groups`.
- `frozen`: the backbone is fixed and runs in eval mode (batch-norm statistics, dropout and drop-path fixed too), only
  the head trains: a linear probe on the backbone's features. Its per-crop features never change, so they can be
  computed once (`pipeline.models.embedding_cache`); `FrozenOnEmbeddings` is the same strategy fed those features.
- `top_blocks` (`model.finetune_blocks=k`): the top k of the backbone's parameter groups (stem to top, as
  `Backbone.parameter_groups` lists them; the final norm is a group of its own) train with the head.
- `lora`: low-rank adapters (Hu et al. 2021) injected by `peft` into the modules `model.lora.target_modules` names
  (a full-match regex over the backbone's module names); the backbone's own weights stay fixed. A kept model has the
  adapters merged into the weights they adapt, so it is a plain `PainNet` again.

The strategies are a registry (`STRATEGIES`, name -> class; `register_strategy`): `model.finetune` names one, and
`FinetuneConfig` and `strategy_for` ask it, so a new strategy is one class here or in a module of its own.

A strategy does three things: `prepare` the network once (requires_grad, adapters), keep the frozen part in eval mode
whenever Lightning puts the module in train mode (`after_train_mode`), and give the network to keep (`for_keeping`).
The optimizer then takes what requires a gradient (`lightning_module.parameter_groups`), so layer-wise LR decay
applies to whatever trains.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from pipeline.models.backbones import PainNet

ADAPTER_MARK = "lora_"  # peft's adapter parameters carry it in their names (lora_A, lora_B, ...)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's hyper-parameters, from `model.lora` (configs/model/)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: str  # full-match regex over the backbone's module names, e.g. r".*\.attn\.(qkv|proj)"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"model.lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        re.compile(self.target_modules)


@dataclass(frozen=True)
class FinetuneConfig:
    """`model.finetune`, `model.finetune_blocks`, `model.lora` and `cache.embeddings` as one checked object: the one
    place a strategy's name is read (`backbone_fixed`, `reads_cache` answer what the rest of the code asks of it)."""

    strategy: str
    blocks: int | None
    lora: LoraSettings
    cache_embeddings: bool  # cache.embeddings: a fixed backbone's features read from the embedding cache

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown model.finetune={self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        STRATEGIES[self.strategy].check(self)

    @classmethod
    def from_config(cls, model: Mapping[str, Any], cache: Mapping[str, Any]) -> FinetuneConfig:
        """The strategy of the `model` and `cache` groups."""
        lora = dict(model["lora"])
        return cls(str(model["finetune"]), model.get("finetune_blocks"),
                   LoraSettings(int(lora["rank"]), float(lora["alpha"]), float(lora["dropout"]),
                                str(lora["target_modules"])), bool(cache["embeddings"]))

    @property
    def backbone_fixed(self) -> bool:
        """The backbone's weights never change (`frozen`): nothing to fine-tune, its features a function of the crop."""
        return STRATEGIES[self.strategy].backbone_fixed

    @property
    def reads_cache(self) -> bool:
        """A fixed backbone's head trains on its cached embeddings (unless cache.embeddings=false)."""
        return self.backbone_fixed and self.cache_embeddings

    @property
    def label(self) -> str:
        """A short name for tags and tables: full, frozen, top_blocks3, lora_r8."""
        return STRATEGIES[self.strategy].label(self)


def refuse_embeddings(config: FinetuneConfig, embeddings: bool) -> None:
    """Cached embeddings feed a fixed backbone's head only: any other strategy trains the backbone on images."""
    if embeddings:
        raise ValueError(f"cached embeddings serve model.finetune=frozen only, not {config.strategy}")


class FinetuneStrategy:
    """Full fine-tuning: everything trains. The base of the other strategies."""

    name = "full"
    backbone_fixed = False  # True: the backbone's weights never change, so checkpoints need not hold them
    on_embeddings = False  # True: fed the backbone's cached embeddings, only the head runs (tiny ops: one thread)

    def __init__(self) -> None:
        self.frozen_norms: list[nn.Module] = []

    @classmethod
    def from_config(cls, config: FinetuneConfig, embeddings: bool) -> FinetuneStrategy:
        """The strategy object of `config`; `embeddings`: fed a fixed backbone's cached embeddings."""
        refuse_embeddings(config, embeddings)
        return cls()

    @classmethod
    def check(cls, config: FinetuneConfig) -> None:
        """Refuse settings this strategy cannot train with."""

    @classmethod
    def label(cls, config: FinetuneConfig) -> str:
        """Its short name for tags and tables."""
        return cls.name

    def prepare(self, net: PainNet) -> PainNet:
        """Set what trains (and inject adapters); returns the same network."""
        net.requires_grad_(True)
        return self.remember_frozen_norms(net)

    def remember_frozen_norms(self, net: PainNet) -> PainNet:
        """The batch norms whose weights this strategy froze: they keep their running statistics (eval mode)."""
        self.frozen_norms = [module for module in net.backbone.modules() if isinstance(module, _NormBase)
                             and not any(p.requires_grad for p in module.parameters())]
        return net

    def after_train_mode(self, net: PainNet) -> None:
        """Called whenever the module goes to train mode and at every training epoch's start: what the strategy
        froze stays exactly what it was (frozen batch norms in eval mode)."""
        for module in self.frozen_norms:
            module.eval()

    def forward(self, net: PainNet, inputs: torch.Tensor) -> torch.Tensor:
        return net(inputs)

    def for_keeping(self, net: PainNet) -> PainNet:
        """The network as a kept model holds it (a plain PainNet)."""
        return net


class FrozenBackbone(FinetuneStrategy):
    """Only the head trains; the whole backbone runs in eval mode (its features are then a function of the crop)."""

    name = "frozen"
    backbone_fixed = True

    @classmethod
    def from_config(cls, config: FinetuneConfig, embeddings: bool) -> FinetuneStrategy:
        return FrozenOnEmbeddings() if embeddings else cls()

    def prepare(self, net: PainNet) -> PainNet:
        net.backbone.requires_grad_(False)
        net.head.requires_grad_(True)
        return self.remember_frozen_norms(net)

    def after_train_mode(self, net: PainNet) -> None:
        net.backbone.eval()


class FrozenOnEmbeddings(FrozenBackbone):
    """`frozen`, fed the backbone's cached per-crop embeddings instead of images: only the head runs."""

    on_embeddings = True

    def forward(self, net: PainNet, inputs: torch.Tensor) -> torch.Tensor:
        return net.head(inputs)


class TopBlocks(FinetuneStrategy):
    """The top `blocks` parameter groups of the backbone and the head train; the groups below are frozen."""

    name = "top_blocks"

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = int(blocks)

    @classmethod
    def from_config(cls, config: FinetuneConfig, embeddings: bool) -> FinetuneStrategy:
        refuse_embeddings(config, embeddings)
        assert config.blocks is not None  # checked
        return cls(config.blocks)

    @classmethod
    def check(cls, config: FinetuneConfig) -> None:
        if config.blocks is None or config.blocks < 1:
            raise ValueError(f"model.finetune=top_blocks needs model.finetune_blocks >= 1, got {config.blocks}")

    @classmethod
    def label(cls, config: FinetuneConfig) -> str:
        return f"top_blocks{config.blocks}"

    def prepare(self, net: PainNet) -> PainNet:
        groups = net.backbone.parameter_groups()
        if self.blocks > len(groups):
            raise ValueError(f"model.finetune_blocks={self.blocks}, but {net.backbone.name} has {len(groups)} "
                             f"parameter groups ({', '.join(name for name, _ in groups)})")
        for index, (_, parameters) in enumerate(groups):
            for parameter in parameters:
                parameter.requires_grad_(index >= len(groups) - self.blocks)
        net.head.requires_grad_(True)
        return self.remember_frozen_norms(net)


class Lora(FinetuneStrategy):
    """LoRA adapters on the target modules (peft); the backbone's own weights are frozen, the head trains."""

    name = "lora"

    def __init__(self, settings: LoraSettings) -> None:
        super().__init__()
        self.settings = settings

    @classmethod
    def from_config(cls, config: FinetuneConfig, embeddings: bool) -> FinetuneStrategy:
        refuse_embeddings(config, embeddings)
        return cls(config.lora)

    @classmethod
    def label(cls, config: FinetuneConfig) -> str:
        return f"lora_r{config.lora.rank}"

    def prepare(self, net: PainNet) -> PainNet:
        names = [name for name, _ in net.backbone.named_modules()]
        if not any(re.fullmatch(self.settings.target_modules, name) for name in names):
            raise ValueError(f"model.lora.target_modules={self.settings.target_modules!r} matches no module of "
                             f"{net.backbone.name} (e.g. {', '.join(names[1:6])})")
        config = LoraConfig(r=self.settings.rank, lora_alpha=self.settings.alpha, lora_dropout=self.settings.dropout,
                            target_modules=self.settings.target_modules, bias="none")
        inject_adapter_in_model(config, net.backbone)
        for name, parameter in net.backbone.named_parameters():
            parameter.requires_grad_(ADAPTER_MARK in name)
        net.head.requires_grad_(True)
        return self.remember_frozen_norms(net)

    def for_keeping(self, net: PainNet) -> PainNet:
        return merged_copy(net)


def merged_copy(net: PainNet) -> PainNet:
    """A copy of `net` with every LoRA adapter merged into the layer it adapts and the layer put back in its place:
    the same function as `net` (to rounding), with the plain module names a kept model is loaded with."""
    merged = copy.deepcopy(net)
    for name, module in list(merged.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            parent_name, _, child = name.rpartition(".")
            setattr(merged.get_submodule(parent_name) if parent_name else merged, child, module.get_base_layer())
    for parameter in merged.parameters():
        parameter.requires_grad_(True)
    return merged


STRATEGIES: dict[str, type[FinetuneStrategy]] = {}


def register_strategy(strategy: type[FinetuneStrategy]) -> type[FinetuneStrategy]:
    """Add a strategy that `model.finetune` may name (its `name`; a name already taken is an error)."""
    if strategy.name in STRATEGIES:
        raise ValueError(f"a fine-tuning strategy named {strategy.name!r} exists already")
    STRATEGIES[strategy.name] = strategy
    return strategy


for _strategy in (FinetuneStrategy, FrozenBackbone, TopBlocks, Lora):
    register_strategy(_strategy)


def strategy_for(config: FinetuneConfig, *, embeddings: bool = False) -> FinetuneStrategy:
    """The strategy object of `config`; `embeddings`: a frozen run fed cached embeddings (`config.reads_cache`)."""
    return STRATEGIES[config.strategy].from_config(config, embeddings)


def parameter_counts(net: nn.Module) -> dict[str, int]:
    """Trainable and total parameters, of the whole network and of its backbone (adapters counted apart)."""
    backbone = getattr(net, "backbone", None)
    counts = {"parameters_total": sum(p.numel() for p in net.parameters()),
              "parameters_trainable": sum(p.numel() for p in net.parameters() if p.requires_grad)}
    if backbone is not None:
        named = list(backbone.named_parameters())
        counts["backbone_parameters"] = sum(p.numel() for name, p in named if ADAPTER_MARK not in name)
        counts["backbone_adapter_parameters"] = sum(p.numel() for name, p in named if ADAPTER_MARK in name)
        counts["backbone_parameters_trainable"] = sum(p.numel() for _, p in named if p.requires_grad)
    return counts
