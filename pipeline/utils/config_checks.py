"""What a command line may say to the configuration, checked before Hydra composes it, so that a mistake is answered
in one line that names the fix (`UsageError`) instead of a composition traceback: a key that does not exist (with the
nearest keys that do), an option that a group (`configs/<group>/`) does not have (with the ones it has), a group
written as a key (`model.output=ordinal` for `model/output=ordinal`), a value of the wrong type for its key's default,
a section given a single value, words that are not `key=value`.

`python -m pipeline` prints a UsageError's message after the command's name and exits with 2; VERBOSE=1 shows the
traceback too (pipeline/cli.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import MISSING, OmegaConf

# The Makefile's variable for each group it sets (make cv TASK=...): named in the answer beside the group's key
MAKE_VARIABLES = {"model": "MODEL", "data": "DATA", "protocol": "PROTOCOL", "task": "TASK", "launcher": "LAUNCHER"}
# A bool key's third state in these configs ("true | false | auto": model.pretrained, data.pretrained)
BOOL_WORDS = ("auto",)
# Files a group's options extend, never named by a user: base.yaml (protocol/, task/), and model/timm.yaml, which a
# model name without a file of its own gets (MODEL=<any timm name>)
SHARED_RECIPES = ("base", "timm")
# A command's options it cannot run without: option -> the Makefile variable that sets it, and an example
REQUIRED_OPTIONS = {"predict": {"video": ("VIDEO", "make predict VIDEO=path/to/clip.mp4 (or a folder)")}}
ALL_KEYS = "every key: .venv/bin/python -m pipeline config"


class UsageError(ValueError):
    """A mistake on the command line (a key, a group's option, a value, a missing variable such as BIOVID_ROOT or
    VIDEO): `python -m pipeline` prints this one line after the command's name and exits with 2, no traceback."""


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """The overrides as Hydra reads them; a word that is not `key=value` (or a broken list, an unclosed quote) is a
    UsageError naming the word."""
    parser = OverridesParser.create()
    parsed = []
    for word in overrides:
        try:
            [override] = parser.parse_overrides([word])
        except OverrideParseException as error:
            reason = str(error).splitlines()[0]
            reason = "" if reason.startswith("Error parsing override") else f" ({reason})"
            raise UsageError(f"{word!r} is not a key=value setting{reason}; e.g. ARGS=\"trainer.max_epochs=3\"") \
                from None
        if override.is_sweep_override():
            values = getattr(override.value(), "list", None) or ["a", "b"]
            raise UsageError(f"{word}: one value per key (a comma lists several values): a list is written "
                             f"{override.key_or_group}=[{','.join(map(value_text, values))}], a text with a comma "
                             f"in quotes")
        parsed.append(override)
    return parsed


def is_group(config_dir: Path, name: str) -> bool:
    """Whether `name` (`task`, `model/output`) is a config group: a folder of option files under configs/."""
    return bool(name) and (config_dir / name).is_dir()


def group_options(config_dir: Path, group: str) -> list[str]:
    """The options a user picks from: the group's files, less the recipes the others extend (`SHARED_RECIPES`)."""
    return [path.stem for path in sorted(config_dir.glob(f"{group}/*.yaml")) if path.stem not in SHARED_RECIPES]


def check_group_choice(config_dir: Path, override: Override) -> None:
    """A group's option that has no file under configs/<group>/: a UsageError listing the options it has."""
    group, value = override.key_or_group, override.value()
    if not isinstance(value, str) or "${" in value or (config_dir / group / f"{value}.yaml").is_file():
        return
    variable = MAKE_VARIABLES.get(group)
    said = f"{variable}={value}" if variable else f"{group}={value}"
    options = ", ".join(group_options(config_dir, group))
    raise UsageError(f"{said}: no {group} of that name (no configs/{group}/{value}.yaml); the {group} options: "
                     f"{options}")


def check_choices(overrides: Sequence[Override], config_dir: Path) -> None:
    """Group options that exist, and no group written as a key (`model.output=ordinal`)."""
    for override in overrides:
        key = override.key_or_group
        if override.is_delete():
            raise UsageError(f"~{key}: removing a key is not allowed; every key must stay as configs/ has it")
        if "." in key and is_group(config_dir, key.replace(".", "/")):
            group = key.replace(".", "/")
            raise UsageError(f"{group} is a group: write {group}={override.value()} (its options: "
                             f"{', '.join(group_options(config_dir, group))})")
        if is_group(config_dir, key):
            check_group_choice(config_dir, override)


def key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a composed config's tree (`defaults_tree`), sections and leaves, as dotted paths."""
    if isinstance(node, dict):
        for name, child in node.items():
            path = f"{prefix}{name}"
            yield path
            yield from key_paths(child, f"{path}.")


def defaults_tree(composed: Any) -> dict:
    """The composed config as plain data, unresolved: an interpolation stays its `${...}` text, a value to be given
    its `???` (what `check_values` compares a command line against)."""
    return OmegaConf.to_container(composed, resolve=False)  # type: ignore[return-value]


def section(tree: dict, path: str) -> Any:
    """The node at a dotted path of a `defaults_tree` (`""`: the whole tree), or None where there is none."""
    node: Any = tree
    for part in path.split(".") if path else ():
        node = node.get(part) if isinstance(node, dict) else None
    return node


def nearest_keys(key: str, paths: Sequence[str], n: int = 3) -> list[str]:
    """The keys closest to `key`, by the whole path or by its last word (`max_epoch` -> `trainer.max_epochs`)."""
    last = key.rsplit(".", 1)[-1]

    def score(path: str) -> float:
        whole = difflib.SequenceMatcher(None, key, path).ratio()
        word = difflib.SequenceMatcher(None, last, path.rsplit(".", 1)[-1]).ratio()
        return max(whole, 0.95 * word)

    ranked = sorted(((score(path), path) for path in paths), key=lambda pair: (-pair[0], pair[1]))
    return [path for value, path in ranked[:n] if value >= 0.75]


def option_holding(key: str, config_dir: Path) -> str | None:
    """The group option that would bring `key` (`personalise.k` -> `personalise=baseline`), or None."""
    parts = key.split(".")
    for size in range(len(parts) - 1, 0, -1):
        group, rest = "/".join(parts[:size]), parts[size:]
        if not is_group(config_dir, group):
            continue
        for option in group_options(config_dir, group):
            node: Any = yaml.safe_load((config_dir / group / f"{option}.yaml").read_text()) or {}
            for part in rest[:-1]:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and rest[-1] in node:
                return f"{group}={option}"
    return None


def unknown_key(key: str, value: Any, defaults: dict, config_dir: Path) -> UsageError:
    """A key that is not in the configuration, with the group option that brings it or the nearest keys that are."""
    option = option_holding(key, config_dir)
    if option:
        return UsageError(f"{key} is a key of {option}, not of the {option.split('=')[0]} chosen: choose it too "
                          f"(ARGS=\"{option} {key}={value_text(value)}\")")
    near = nearest_keys(key, list(key_paths(defaults)))
    if near:
        fix = f"did you mean {near[0]}={value_text(value)}?" + (f" (or {', '.join(near[1:])})" if near[1:] else "")
        return UsageError(f"{key} is not a configuration key: {fix}")
    return UsageError(f"{key} is not a configuration key ({ALL_KEYS})")


def value_text(value: Any) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(value_text(item) for item in value) + "]"
    return str(value)


def type_problem(default: Any, value: Any) -> str | None:
    """What is wrong with `value` for a key whose default is `default`, or None: numbers for numbers, true or false
    (or auto) for a switch, a list for a list, keys for a section; null is allowed everywhere, a text key takes any
    single value."""
    if value is None or default is None:
        return None
    if isinstance(default, dict):
        if isinstance(value, dict):  # a section given as {key: value, ...}: merged into it, each key checked there
            return None
        return f"a section of keys ({', '.join(map(str, list(default.keys())[:4]))}, ...): set one of them"
    if isinstance(default, list):
        return None if isinstance(value, list) else "a list, e.g. [0,1]"
    if isinstance(value, (list, dict)):
        return f"a single value like its default {value_text(default)}"
    if isinstance(default, bool):
        return None if isinstance(value, bool) or value in BOOL_WORDS else "true or false"
    if isinstance(default, (int, float)):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    return None


def check_values(overrides: Sequence[Override], defaults: dict, config_dir: Path) -> None:
    """Each key=value override against the configuration composed without them (`defaults`, its `defaults_tree`):
    the key exists, and the value has its default's type (`type_problem`; an interpolated default, `${...}`, and one
    still to be given, `???`, are not checked)."""
    for override in overrides:
        key = override.key_or_group
        if is_group(config_dir, key) or override.is_add():
            continue
        value = override.value()
        parent, _, leaf = key.rpartition(".")
        container = section(defaults, parent)
        if not isinstance(container, dict) or leaf not in container:
            raise unknown_key(key, value, defaults, config_dir)
        default = container[leaf]
        if (isinstance(default, str) and ("${" in default or default == MISSING)) or (
                isinstance(value, str) and "${" in value):
            continue
        problem = type_problem(default, value)
        if problem:
            raise UsageError(f"{key}={value_text(value)}: expected {problem} (its default: {value_text(default)})"
                             if not isinstance(default, dict) else f"{key} is {problem}, e.g. "
                             f"{key}.{next(iter(default.keys()))}=...")


def unknown_model(name: str, config_dir: Path, model_names: Sequence[str]) -> UsageError:
    """MODEL=<name> where neither configs/model/ nor timm (`model_names`: every name a backbone is built from) has
    it, with the nearest names that exist."""
    files = group_options(config_dir, "model")
    near = difflib.get_close_matches(name, list(dict.fromkeys([*files, *model_names])), n=3, cutoff=0.7)
    hint = f"nearest: {', '.join(near)}" if near else f"configs/model/ has {', '.join(files)}"
    return UsageError(f"MODEL={name}: no configs/model/{name}.yaml and no timm model of that name; {hint} "
                      f"(timm's: .venv/bin/python -c 'import timm; print(timm.list_models())')")


def check_required(command: str, options: dict) -> None:
    """A UsageError for the first option of REQUIRED_OPTIONS that `command` was not given (make predict's VIDEO)."""
    for option, (variable, example) in REQUIRED_OPTIONS.get(command, {}).items():
        if not options.get(option):
            raise UsageError(f"{variable} is not set: say which, e.g. {example}")
