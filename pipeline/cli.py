"""Command-line entry point: compose the Hydra config, then hand plain objects to the library.

    python -m pipeline data        [key=value ...]   generate (synthetic twin) or validate (BioVid), crop faces, folds
    python -m pipeline aug-preview [key=value ...]   PNG grid of augmented crops
    python -m pipeline cv          [key=value ...]   participant-grouped cross-validation, tracked in MLflow
    python -m pipeline compare     [key=value ...]   compare the backbones' latest cross-validations
    python -m pipeline config      [key=value ...]   print the resolved config

The Makefile is the front door (`make help`); it turns MODEL=, DATA=, PROTOCOL=, TASK= into these overrides.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from pipeline import PROJECT_ROOT

CONFIG_DIR = PROJECT_ROOT / "configs"
log = logging.getLogger("pipeline")


def load_config(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose configs/config.yaml with overrides; unknown keys are errors (no `+key=` additions)."""
    added = [o for o in overrides if o.lstrip().startswith("+")]
    if added:
        raise ValueError(f"adding keys is not allowed ({', '.join(added)}): every key must exist in configs/")
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    OmegaConf.set_struct(cfg, True)
    OmegaConf.resolve(cfg)
    return cfg


def resolve_path(path: str | Path) -> Path:
    """Relative paths in the config are relative to the project root, so commands work from any folder."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else (PROJECT_ROOT / path).resolve()


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"data": "pipeline.prepare:run_data", "aug-preview": "pipeline.prepare:run_aug_preview",
                "cv": "pipeline.cv:run_cv", "compare": "pipeline.compare:run_compare", "config": None}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    command, overrides = argv[0], argv[1:]
    _setup_logging()
    cfg = load_config(overrides)
    if command == "config":
        print(OmegaConf.to_yaml(cfg))
        return 0
    module_name, function_name = commands[command].split(":")
    module = __import__(module_name, fromlist=[function_name])
    getattr(module, function_name)(cfg)
    return 0
