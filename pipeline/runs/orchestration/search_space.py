"""The search space of `make tune`: which settings a study searches, and over what ranges, read once from
`configs/tune/spaces/<name>.yaml` (a file may `extends` another; per fine-tuning strategy it may change or remove
parameters under `strategies`). `SearchSpace.sha256` is what `make compare` matches tuned CVs on; `with_params` sets a
trial's (or the chosen) values in a config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import optuna
from omegaconf import OmegaConf

from pipeline.models.finetune import STRATEGIES
from pipeline.runs.jobs.what_trains import WhatTrains
from pipeline.utils.config import CONFIG_DIR

SPACES_DIR = CONFIG_DIR / "tune" / "spaces"


class TuneError(SystemExit):
    """A search that cannot run as configured, with what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


@dataclass(frozen=True)
class Parameter:
    key: str  # a dotted config key, e.g. model.optim.head_lr
    type: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.type == "float":
            return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log)
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_categorical(self.key, list(self.choices or ()))

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in (self.choices or ())
        return value is not None and float(self.low) <= float(value) <= float(self.high)


@dataclass(frozen=True)
class SearchSpace:
    source: str  # the file(s) it was read from
    parameters: tuple[Parameter, ...]

    @property
    def sha256(self) -> str:
        """What `make compare` matches tuned CVs on: the parameters, ranges and scales, not the file names."""
        text = json.dumps([asdict(p) for p in self.parameters], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {p.key: p.suggest(trial) for p in self.parameters}

    def defaults(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Today's hand-picked values of the searched keys in the resolved `config`: the study's first trial. Each
        must be in its range."""
        values = {}
        for p in self.parameters:
            value = config_value(config, p.key)
            if not p.contains(value):
                raise TuneError(f"{self.source}: the configured {p.key} = {value!r} lies outside the searched range "
                                f"({p.choices if p.type == 'categorical' else f'{p.low}..{p.high}'}); widen the "
                                f"range so that the first trial is today's setting")
            values[p.key] = int(value) if p.type == "int" else float(value) if p.type == "float" else value
        return values


def _space_entries(name: str, seen: tuple[str, ...] = ()) -> tuple[dict, dict, list[str]]:
    path = SPACES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))
        raise TuneError(f"no search space {path}; known: {', '.join(known)}")
    if name in seen:
        raise TuneError(f"{path}: `extends` loops back to {name}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    unknown = sorted(set(raw) - {"extends", "parameters", "strategies"})
    if unknown:
        raise TuneError(f"{path}: unknown key(s) {unknown}; expected extends, parameters, strategies")
    parameters, strategies, sources = {}, {}, []
    if raw.get("extends"):
        parameters, strategies, sources = _space_entries(str(raw["extends"]), (*seen, name))
    parameters = {**parameters, **(raw.get("parameters") or {})}
    wrong = sorted(set(raw.get("strategies") or {}) - set(STRATEGIES))
    if wrong:  # a key no `model.finetune` takes would never apply: its study would search settings that do nothing
        raise TuneError(f"{path}: strategies key(s) {', '.join(map(repr, wrong))} name no fine-tuning strategy; "
                        f"model.finetune is one of {', '.join(STRATEGIES)}")
    for strategy, extra in (raw.get("strategies") or {}).items():
        strategies[strategy] = {**strategies.get(strategy, {}), **(extra or {})}
    return parameters, strategies, [*sources, str(path)]


def config_value(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value at a dotted key of a resolved config (`default` where a part of the key is absent)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def load_space(space: str, model_name: str, trains: WhatTrains, config: Mapping[str, Any]) -> SearchSpace:
    """The search space `space` (`tune.space`; `auto`: the backbone's file, else the default one) for what `trains`
    trains, with the fine-tuning strategy's changes; every searched key must be one of the resolved `config`. A run
    whose training applies no augmentation (a frozen head on plain cached embeddings, `WhatTrains.augmentation_applied`)
    does not search `augment.*`: those settings would change nothing it trains on."""
    name = space
    if name == "auto":
        name = model_name if (SPACES_DIR / f"{model_name}.yaml").is_file() else "default"
    entries, strategies, sources = _space_entries(str(name))
    strategy = trains.finetune.strategy
    if strategy in strategies:
        entries = {**entries, **strategies[strategy]}
    source = " + ".join(sources) + (f" (strategy {strategy})" if strategy in strategies else "")
    unaugmented = not trains.augmentation_applied
    if unaugmented:
        source += f" (augment.* not searched: {trains.augmentation_label})"
    parameters = []
    for key, spec in entries.items():
        if spec is None or (unaugmented and key.startswith("augment.")):  # removed, or nothing it would change
            continue
        if config_value(config, key, "__missing__") == "__missing__":
            raise TuneError(f"{source}: parameter {key} is not a key of the composed config")
        kind = spec.get("type")
        if kind not in ("float", "int", "categorical"):
            raise TuneError(f"{source}: parameter {key}: type must be float, int or categorical, not {kind!r}")
        if kind == "categorical":
            parameters.append(Parameter(key, kind, choices=tuple(spec["choices"])))
            continue
        if spec.get("low") is None or spec.get("high") is None or spec["low"] >= spec["high"]:
            raise TuneError(f"{source}: parameter {key} needs low < high")
        parameters.append(Parameter(key, kind, spec["low"], spec["high"], bool(spec.get("log", False))))
    if not parameters:
        raise TuneError(f"{source}: no parameter to search")
    return SearchSpace(source, tuple(parameters))


def with_params(config: Mapping[str, Any], params: dict[str, Any]) -> dict:
    """A copy of the resolved config with the trial's (or the chosen) values set at their dotted keys."""
    changed = OmegaConf.create(dict(config))
    for key, value in params.items():
        OmegaConf.update(changed, key, value, merge=False)
    return OmegaConf.to_container(changed, resolve=True)
