"""Command-line entry point: it dispatches, and nothing else. Config loading and logging set-up live in
`pipeline.utils`, the commands in the subpackages; each command is imported where it is dispatched (explicit imports,
inside functions so that `python -m pipeline ui-url` answers without importing torch or MLflow).

    python -m pipeline data        [key=value ...]   generate (synthetic twin) or validate (BioVid), crop faces, folds
    python -m pipeline aug-preview [key=value ...]   PNG grid of augmented crops
    python -m pipeline cv          [key=value ...]   participant-grouped cross-validation, tracked in MLflow
    python -m pipeline embed       [key=value ...]   the embedding cache of a frozen backbone (model.finetune=frozen)
    python -m pipeline pretrain    [key=value ...]   a starting point: the backbone trained on faces outside the dataset
    python -m pipeline compare     [key=value ...] [--tuned=latest|versus_untuned|<trials>,<scope>,<space hash>]
                                       compare the backbones' latest cross-validations (untuned ones unless --tuned)
    python -m pipeline tune        [key=value ...]   per-fold hyper-parameter search, then the tuned CV (tune.*)
    python -m pipeline inspect     [key=value ...] [--run=<parent run id>] [--untrained=1]
                                       attention rollout, Grad-CAM and region score on each fold's test videos
    python -m pipeline calc        [key=value ...]   a backbone's shapes, parameters, MACs and training memory
    python -m pipeline table       [key=value ...] [--models="vit_b16 cvt_13"] [--tasks="bl1_vs_pa4 ..."]
                                       the BioVid benchmark table: every task's CV run or reused, beside published rows
    python -m pipeline power       [key=value ...]   error rates of make compare's test on twins with a planted effect
    python -m pipeline fidelity    [key=value ...]   a twin's difficulty: a reference method's curve beside BioVid's
    python -m pipeline final       [key=value ...] [--run=<CV parent run>]
                                       one model on all subjects with a CV's settings, registered in MLflow
    python -m pipeline promote     [key=value ...] --version=<n>   move the registered model's champion alias
    python -m pipeline predict     [key=value ...] --video=<file or folder> [--model_uri=...] [--run=<run>]
                                       pain timeline (CSV + PNG) of any video
    python -m pipeline serve       [key=value ...] [--model_uri=...]   the scoring server, with limits per request
    python -m pipeline export      [key=value ...] --model_uri=... [--format=onnx] [--out=...]   the network as ONNX
    python -m pipeline config      [key=value ...]   print the resolved config
    python -m pipeline fold-job    JOB.json          run one fold job (what the parallel launcher starts per fold)
    python -m pipeline tune-worker WORKER.json       run one search worker (what `make tune LAUNCHER=parallel` starts)
    python -m pipeline job-worker  FD                one of the parallel launcher's workers: the jobs sent over FD
    python -m pipeline fold-files  write-biovid | check PATH...   regenerate or check committed fold files
    python -m pipeline server      --artifacts DIR [--host H --port P ...]   the tracking server (store: $SERVER_STORE)
    python -m pipeline ui          [--port 5000]     the MLflow UI on loopback, asking for a password made for it
    python -m pipeline ui-url      [--port 5000]     the MLflow UI address of the cross-validation runs page

The Makefile is the front door (`make help`); it turns MODEL=, DATA=, PROTOCOL=, TASK= into these overrides, and
ARGS="a=1 b='x y'" into one argument --args="a=1 b='x y'" that takes its words' place (split here, not by a shell).
Every command creates its files under umask 077 (this user's alone), and one whose store, artifact, runs or crops
folder others can read or write is refused unless PAINVIT_STORE_SHARED_OK=1 (`pipeline.utils.permissions`).
"""

from __future__ import annotations

import shlex
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.utils.atomic_io import SettingsMismatch
from pipeline.utils.config import CONFIG_DIR, load_config
from pipeline.utils.config_checks import UsageError, check_required, unknown_model
from pipeline.utils.logging_setup import is_verbose, setup_logging
from pipeline.utils.permissions import StoreNotPrivate, private_umask, refuse_open_stores

Command = Callable[..., Any]  # a command: the composed config and its --name=value options


def _data() -> Command:
    from pipeline.data.prepare import run_data

    return run_data


def _aug_preview() -> Command:
    from pipeline.analysis.aug_preview import run_aug_preview

    return run_aug_preview


def _cv() -> Command:
    from pipeline.runs.orchestration.cross_validation import run_cv

    return run_cv


def _embed() -> Command:
    from pipeline.runs.jobs.embed import run_embed

    return run_embed


def _pretrain() -> Command:
    from pipeline.runs.jobs.pretrain import run_pretrain

    return run_pretrain


def _tune() -> Command:
    from pipeline.runs.orchestration.tuning import run_tune

    return run_tune


def _compare() -> Command:
    from pipeline.analysis.compare import run_compare

    return run_compare


def _inspect() -> Command:
    from pipeline.analysis.inspection import run_inspect

    return run_inspect


def _calc() -> Command:
    from pipeline.analysis.calculator import run_calc

    return run_calc


def _table() -> Command:
    from pipeline.analysis.results_table import run_table

    return run_table


def _power() -> Command:
    from pipeline.analysis.power import run_power

    return run_power


def _fidelity() -> Command:
    from pipeline.analysis.fidelity import run_fidelity

    return run_fidelity


def _final() -> Command:
    from pipeline.deployment.final_model import run_final

    return run_final


def _promote() -> Command:
    from pipeline.runs.store.registry import run_promote

    return run_promote


def _predict() -> Command:
    from pipeline.deployment.predict import run_predict

    return run_predict


def _serve() -> Command:
    from pipeline.deployment.serving import run_serve

    return run_serve


def _export() -> Command:
    from pipeline.deployment.export import run_export

    return run_export


def print_config(cfg: DictConfig) -> None:
    """`python -m pipeline config`: the composed config, as every command sees it."""
    print(OmegaConf.to_yaml(cfg))


def _print_config() -> Command:
    return print_config


def _fold_job(argv: list[str]) -> int:
    from pipeline.runs.jobs.fold_run import main

    return main(argv)


def _tune_worker(argv: list[str]) -> int:
    from pipeline.runs.orchestration.search_workers import tune_worker_main

    return tune_worker_main(argv)


def _job_worker(argv: list[str]) -> int:
    from pipeline.runs.orchestration.job_workers import worker_main

    return worker_main(argv)


def _fold_files(argv: list[str]) -> int:
    from pipeline.data.biovid_folds import main

    return main(argv)


def _server(argv: list[str]) -> int:
    from pipeline.runs.store.tracking_server import main

    return main(argv)


def _ui(argv: list[str]) -> int:
    from pipeline.runs.store.private_server import ui_main

    return ui_main(argv)


def _ui_url(argv: list[str]) -> int:
    from pipeline.runs.store.ui_pages import main

    main(argv)
    return 0


# commands over the composed config (key=value overrides, --name=value options): each entry imports its command
# when it runs (so that `--help` and `ui-url` answer at once) and returns it; the command takes the config
COMMANDS: dict[str, Callable[[], Command]] = {
    "data": _data, "aug-preview": _aug_preview, "cv": _cv, "embed": _embed, "pretrain": _pretrain, "tune": _tune,
    "compare": _compare,
    "inspect": _inspect, "calc": _calc, "table": _table, "power": _power, "fidelity": _fidelity,
    "final": _final, "promote": _promote,
    "predict": _predict,
    "serve": _serve,
    "export": _export,
    "config": _print_config,
}
# tools with arguments of their own
TOOLS: dict[str, Callable[[list[str]], int]] = {"fold-job": _fold_job, "tune-worker": _tune_worker,
                                                "job-worker": _job_worker,
                                                "fold-files": _fold_files, "ui-url": _ui_url, "server": _server,
                                                "ui": _ui}
# commands that read the dataset's own files (BioVid's need BIOVID_ROOT=, data.root)
DATASET_COMMANDS = ("data", "aug-preview", "cv", "embed", "tune", "final")
# config groups a command adds to the defaults list: `make tune` has a `tune` section, `make pretrain` a `pretrain` one
COMMAND_GROUPS: dict[str, tuple[str, ...]] = {"tune": ("tune=default",), "pretrain": ("pretrain=default",),
                                              "power": ("power=default",), "fidelity": ("fidelity=default",)}


ARGS_OPTION = "--args="


def split_args(arguments: list[str]) -> list[str]:
    """Each `--args=<words>` (the Makefile's ARGS=) replaced by its words, split as a shell splits them (shlex: quotes
    group, a backslash escapes) but with nothing expanded or run: `$(...)`, backticks and `;` stay characters.
    ValueError (an unclosed quote) names ARGS."""
    split: list[str] = []
    for argument in arguments:
        if not argument.startswith(ARGS_OPTION):
            split.append(argument)
            continue
        try:
            split.extend(shlex.split(argument.removeprefix(ARGS_OPTION)))
        except ValueError as error:
            raise ValueError(f"ARGS={argument.removeprefix(ARGS_OPTION)!r}: {error} (ARGS holds key=value words as a "
                             f"shell writes them, e.g. ARGS=\"a=1 b='x y'\")") from None
    return split


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    private_umask()  # everything a command, its servers and its fold jobs create is this user's alone
    if argv and argv[0] in TOOLS:
        return TOOLS[argv[0]](argv[1:])
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[0]
    try:
        overrides = split_args(argv[1:])
    except ValueError as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    # --name=value options belong to the command itself (make inspect RUN=...), key=value ones to the config
    flags = [option for option in overrides if option.startswith("--")]
    if any("=" not in flag for flag in flags):
        print(f"options take a value (--name=value): {' '.join(flags)}", file=sys.stderr)
        return 2
    options: dict[str, Any] = dict(flag[2:].split("=", 1) for flag in flags)
    overrides = [option for option in overrides if not option.startswith("--")]
    if command in ("table", "power"):  # each CV it runs composes its own config from the same overrides
        options["overrides"] = overrides
    setup_logging()
    try:
        check_required(command, options)  # make predict without VIDEO: said before anything heavy is imported
        return run_command(command, overrides, options)
    except UsageError as error:  # a mistake on the command line: its one line (VERBOSE=1: the traceback too)
        if is_verbose():
            traceback.print_exception(error)
        print(f"{command}: {error}", file=sys.stderr)
        return 2


def run_command(command: str, overrides: list[str], options: dict[str, Any]) -> int:
    """Compose and check the config, refuse stores others can open, run the command; its exit status."""
    cfg = load_config(overrides, groups=COMMAND_GROUPS.get(command, ()))
    check_model(cfg.model)
    if command != "config":  # a store others can read or write: refused before anything is read or written
        from pipeline.runs.store.tracking import STORE_SETTINGS, store_paths

        try:
            refuse_open_stores(store_paths({key: OmegaConf.select(cfg, key) for key in STORE_SETTINGS}))
        except StoreNotPrivate as error:
            print(f"{command}: error: {error}", file=sys.stderr)
            return 2
    if command in DATASET_COMMANDS:
        from pipeline.data.prepare import dataset_root

        dataset_root(cfg.data.name, cfg.data.root)  # BioVid without BIOVID_ROOT: said before anything heavy is imported
    from pipeline.runs.store.unreachable import EXIT_UNREACHABLE, bound_retries, is_unreachable, unreachable_line
    from pipeline.utils.accelerator import GpuUnavailable  # here, not on top: `ui-url` must not import torch

    bound_retries(cfg.mlflow.retry_s)  # a tracking server that went away: retried this long, then one line
    try:
        COMMANDS[command]()(cfg, **options)
    except KeyboardInterrupt:
        print(f"\ninterrupted: `make {command}` with the same settings continues where this one stopped",
              file=sys.stderr)
        return 130
    except SettingsMismatch as error:  # a folder made with other settings: what to do, without a traceback
        print(f"{command}: {error}", file=sys.stderr)
        return 2
    except GpuUnavailable as error:  # the GPU asked for cannot be used: why, and which torch to install
        print(f"{command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if not is_unreachable(error):
            raise
        from pipeline.runs.store.tracking import tracking_uri
        from pipeline.utils.paths import PROJECT_ROOT

        uri = cfg.mlflow.tracking_uri or tracking_uri(PROJECT_ROOT)
        print(unreachable_line(uri, f"make {command}"), file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


def check_model(model: Mapping[str, Any]) -> None:
    """The `model` group's name (MODEL=) names a configs/model file or a backbone timm (or this project) builds; a
    UsageError otherwise, with the nearest names. The backbones are imported only for a name without a file (torch
    and timm take seconds)."""
    if OmegaConf.is_missing(model, "name"):
        raise UsageError("model=timm needs a timm model's name: MODEL=<name> through make (e.g. MODEL=resnet18), or "
                         "model=timm model.name=<name>")
    name = str(model["name"])
    if (CONFIG_DIR / "model" / f"{name}.yaml").is_file():
        return
    import timm

    from pipeline.models.backbones import backbone_names, is_backbone

    if not is_backbone(name):
        raise unknown_model(name, CONFIG_DIR, [*backbone_names(), *timm.list_models()])
