"""The composed config: configs/config.yaml with its groups and the command line's overrides, through Hydra's compose
API (no @hydra.main, so every command and test composes the same way), with unknown keys as errors. A mistake in the
overrides (a key, a group's option, a value's type) is a `config_checks.UsageError` of one line, found before Hydra
composes the config (pipeline/utils/config_checks.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipeline.utils.config_checks import (
    UsageError,
    check_choices,
    check_values,
    defaults_tree,
    is_group,
    parse_overrides,
)
from pipeline.utils.paths import PROJECT_ROOT

CONFIG_DIR = PROJECT_ROOT / "configs"


def backbone_choice(override: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    """`model=<name>` as every command (and the Makefile's MODEL=) means it: a backbone with its own file in
    configs/model/ selects that file, any other name is a timm model (`model=timm`, `model.name=<name>`). Any other
    override is itself."""
    key, equals, name = override.partition("=")
    if key.strip() != "model" or not equals or name in {path.stem for path in (config_dir / "model").glob("*.yaml")}:
        return [override]
    return ["model=timm", f"model.name={name}"]


def load_config(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR, groups: Sequence[str] = ()) -> DictConfig:
    """Compose configs/config.yaml with overrides; unknown keys are errors (no `+key=` additions).

    As under @hydra.main, ${hydra:runtime.choices.<group>} is the option chosen for a group (the protocol and task
    files take their name from it); the hydra node itself is left out of the result. `groups` ("tune=default") are
    groups a command adds to the defaults list (`make tune`'s `tune` section), so other commands' configs lack them.
    The overrides are checked first (`config_checks`): group options against configs/, then keys and value types
    against the config composed with the groups alone; what Hydra still refuses is a UsageError with its first line.
    """
    added = [o for o in overrides if o.lstrip().startswith("+")]
    if added:
        raise UsageError(f"adding keys is not allowed ({', '.join(added)}): every key must exist in configs/")
    overrides = [word for override in overrides for word in backbone_choice(override, config_dir)]
    parsed = parse_overrides(overrides)
    check_choices(parsed, config_dir)
    chosen = [word for word, override in zip(overrides, parsed, strict=True)
              if is_group(config_dir, override.key_or_group)]
    if len(chosen) < len(parsed):
        check_values([o for o in parsed if not is_group(config_dir, o.key_or_group)],
                     defaults_tree(_compose(config_dir, groups, chosen)), config_dir)
    cfg = _compose(config_dir, groups, overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.set_struct(cfg, True)
    OmegaConf.resolve(cfg)
    return cfg


def _compose(config_dir: Path, groups: Sequence[str], overrides: Sequence[str]) -> DictConfig:
    """The config with its hydra node, that node made current (what ${hydra:...} reads)."""
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"+{group}" for group in groups] + list(overrides),
                          return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:  # what the checks did not foresee, in Hydra's words
        raise UsageError(" ".join(str(error).split("\n")[:2]).strip()) from error
    HydraConfig.instance().set_config(cfg)
    return cfg
