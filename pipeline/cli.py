"""Command-line entry point: compose the Hydra config, then hand plain objects to the library.

    python -m pipeline data        [key=value ...]   generate (synthetic twin) or validate (BioVid), crop faces, folds
    python -m pipeline aug-preview [key=value ...]   PNG grid of augmented crops
    python -m pipeline cv          [key=value ...]   participant-grouped cross-validation, tracked in MLflow
    python -m pipeline compare     [key=value ...]   compare the backbones' latest cross-validations
    python -m pipeline inspect     [key=value ...] [--run=<parent run id>] [--untrained=1]
                                       attention rollout, Grad-CAM and region score on each fold's test videos
    python -m pipeline calc        [key=value ...]   a backbone's shapes, parameters, MACs and training memory
    python -m pipeline final       [key=value ...] [--run=<CV parent run>]
                                       one model on all subjects with a CV's settings, registered in MLflow
    python -m pipeline promote     [key=value ...] --version=<n>   move the registered model's champion alias
    python -m pipeline predict     [key=value ...] --video=<file or folder> [--model_uri=...] [--run=<run>]
                                       pain timeline (CSV + PNG) of any video
    python -m pipeline export      [key=value ...] --model_uri=... [--format=onnx] [--out=...]   the network as ONNX
    python -m pipeline config      [key=value ...]   print the resolved config

The Makefile is the front door (`make help`); it turns MODEL=, DATA=, PROTOCOL=, TASK= into these overrides.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

# resolve_path lives in pipeline/ now; re-exported here until every caller imports it from there.
from pipeline import PROJECT_ROOT, resolve_path  # noqa: F401

CONFIG_DIR = PROJECT_ROOT / "configs"
log = logging.getLogger("pipeline")


def load_config(overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> DictConfig:
    """Compose configs/config.yaml with overrides; unknown keys are errors (no `+key=` additions).

    As under @hydra.main, ${hydra:runtime.choices.<group>} is the option chosen for a group (the protocol and task
    files take their name from it); the hydra node itself is left out of the result.
    """
    added = [o for o in overrides if o.lstrip().startswith("+")]
    if added:
        raise ValueError(f"adding keys is not allowed ({', '.join(added)}): every key must exist in configs/")
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.set_struct(cfg, True)
    OmegaConf.resolve(cfg)
    return cfg


def setup_logging(verbose: bool | None = None) -> None:
    """What a person sees: the pipeline's own lines, its warnings about the run, progress bars and results.

    Quiet by default: other libraries' info lines (Lightning's tips and device banners) and warnings (deprecations
    inside dependencies) are hidden. VERBOSE=1 (`make cv VERBOSE=1`) brings everything back.
    """
    verbose = os.environ.get("VERBOSE", "") not in ("", "0") if verbose is None else verbose
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    if verbose:
        logging.getLogger("pipeline").setLevel(logging.INFO)
        return
    for variable, value in (("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false"), ("MLFLOW_LOGGING_LEVEL", "WARNING"),
                            ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
        os.environ.setdefault(variable, value)  # read by MLflow when it is imported and when it prints
    # Lightning resets its package logger's level when it is imported, so the loggers it writes through are set too.
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning", "mlflow", "alembic",
                 "pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "lightning_fabric.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Python warnings come from dependencies; what concerns the user's run (training from scratch, skipped videos)
    # the pipeline also logs as a warning, and those log lines stay.
    warnings.filterwarnings("ignore")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"data": "pipeline.prepare:run_data", "aug-preview": "pipeline.prepare:run_aug_preview",
                "cv": "pipeline.cv:run_cv", "compare": "pipeline.compare:run_compare",
                "inspect": "pipeline.inspection:run_inspect", "calc": "pipeline.calc:run_calc",
                "final": "pipeline.final:run_final", "promote": "pipeline.registry:run_promote",
                "predict": "pipeline.predict:run_predict",
                "export": "pipeline.export:run_export", "config": None}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    command, overrides = argv[0], argv[1:]
    # --name=value options belong to the command itself (make inspect RUN=...), key=value ones to the config
    flags = [option for option in overrides if option.startswith("--")]
    if any("=" not in flag for flag in flags):
        print(f"options take a value (--name=value): {' '.join(flags)}", file=sys.stderr)
        return 2
    options = dict(flag[2:].split("=", 1) for flag in flags)
    overrides = [option for option in overrides if not option.startswith("--")]
    setup_logging()
    cfg = load_config(overrides)
    if command == "config":
        print(OmegaConf.to_yaml(cfg))
        return 0
    module_name, function_name = commands[command].split(":")
    module = __import__(module_name, fromlist=[function_name])
    from pipeline.io import SettingsMismatch

    try:
        getattr(module, function_name)(cfg, **options)
    except KeyboardInterrupt:
        print(f"\ninterrupted: `make {command}` with the same settings continues where this one stopped",
              file=sys.stderr)
        return 130
    except SettingsMismatch as error:  # a folder made with other settings: what to do, without a traceback
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    return 0
