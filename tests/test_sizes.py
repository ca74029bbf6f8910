"""Sizes that keep the package readable (issue 35, item 5), read from the source with `ast`: no module over 500
lines, no function over 60, and no function-level `import pipeline...` across subpackages (it hides a dependency
from the module's head and from the layers contract's reader), except what the allow-lists below name and why.

The allow-lists hold REASONED entries only: a table or a list of plain statements that reads better whole, an optional
dependency too heavy to import with the module. The DEBT entries (what the `runs/` split, issue 35, items 1-4, had not
reached) are gone: item 5 split those modules by concern and those functions into named steps. No new entry is added
for new code: a module or function that grows past the limit is split."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.utils.paths import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pipeline"
MODULE_LINES, FUNCTION_LINES = 500, 60

# module -> its line ceiling: none now (issue 35, item 5 split every module over 500 lines)
LONG_MODULES: dict[str, int] = {}
# module::function -> its line ceiling
LONG_FUNCTIONS = {
    # REASONED: `make calc`'s report, its sections as a list of lines in the order printed
    "pipeline/analysis/calculator.py::report": 75,
    # REASONED: the crop contract, a dict of plain values (settings, rules, OpenCV flags) written out whole
    "pipeline/models/scoring.py::crop_contract": 61,
}
# function-level imports across subpackages: (module, imported module prefix) pairs allowed anywhere in the module
LAZY_IMPORTS = {
    # REASONED: the command line imports each command when it runs, so `--help` and `ui-url` answer at once
    ("pipeline/cli.py", "pipeline."),
    # REASONED: face detectors (MTCNN's weights, OpenCV's cascades, LiteRT) only when a video is searched for faces
    ("pipeline/models/scoring.py", "pipeline.data.faces"),
    ("pipeline/models/scoring.py", "pipeline.data.mtcnn"),
    # REASONED: the synthetic twin's generator (scikit-image, its planted effects) only where a twin is drawn
    ("pipeline/analysis/regions.py", "pipeline.data.synthetic"),
    ("pipeline/analysis/throughput.py", "pipeline.data.synthetic"),
    ("pipeline/runs/serving/mlflow_model.py", "pipeline.data.synthetic"),
    ("pipeline/runs/jobs/pretrain.py", "pipeline.data.synthetic"),
    # REASONED: a job's entry point sets up logging before anything else it imports logs
    ("pipeline/runs/jobs/fold_run.py", "pipeline.utils.logging_setup"),
    ("pipeline/runs/orchestration/launchers.py", "pipeline.utils.logging_setup"),
    ("pipeline/runs/orchestration/search_workers.py", "pipeline.utils.logging_setup"),
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(PROJECT_ROOT).as_posix()


def functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def subpackage(name: str) -> str:
    """`pipeline.runs.jobs.fold_job` -> `runs`; a module of the package's top (`pipeline.cli`) is its own."""
    return name.split(".")[1]


def test_no_module_is_longer_than_its_allowance() -> None:
    too_long = []
    for path in modules():
        lines = len(path.read_text().splitlines())
        if lines > LONG_MODULES.get(relative(path), MODULE_LINES):
            too_long.append(f"{relative(path)}: {lines} lines")
    assert too_long == [], f"modules over {MODULE_LINES} lines (or their ceiling): {too_long}"


def test_no_function_is_longer_than_its_allowance() -> None:
    too_long = []
    for path in modules():
        for node in functions(ast.parse(path.read_text())):
            lines = node.end_lineno - node.lineno + 1
            key = f"{relative(path)}::{node.name}"
            if lines > LONG_FUNCTIONS.get(key, FUNCTION_LINES):
                too_long.append(f"{key}: {lines} lines")
    assert too_long == [], f"functions over {FUNCTION_LINES} lines (or their ceiling): {too_long}"


def test_no_hidden_import_crosses_subpackages() -> None:
    hidden = []
    for path in modules():
        own = subpackage(".".join(("pipeline", *path.relative_to(PACKAGE).with_suffix("").parts)))
        for function in functions(ast.parse(path.read_text())):
            for node in ast.walk(function):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline.")):
                    continue
                allowed = any(relative(path) == module and node.module.startswith(prefix)
                              for module, prefix in LAZY_IMPORTS)
                if subpackage(node.module) != own and not allowed:
                    hidden.append(f"{relative(path)}::{function.name} imports {node.module}")
    assert hidden == [], "function-level imports across subpackages, not in LAZY_IMPORTS:\n" + "\n".join(hidden)


def test_the_allowances_name_what_exists() -> None:
    """An allowance for a module or function that is gone (or now fits) is taken off, so the lists only shrink."""
    sizes = {relative(p): len(p.read_text().splitlines()) for p in modules()}
    lengths = {f"{relative(p)}::{node.name}": node.end_lineno - node.lineno + 1
               for p in modules() for node in functions(ast.parse(p.read_text()))}
    stale = [m for m in LONG_MODULES if sizes.get(m, 0) <= MODULE_LINES]
    stale += [f for f in LONG_FUNCTIONS if lengths.get(f, 0) <= FUNCTION_LINES]
    stale += [m for m, _ in LAZY_IMPORTS if m not in sizes]
    assert stale == [], f"allowances no longer needed: {stale}"


# Functions of pipeline/ that take the composed config (a parameter annotated `DictConfig`, or an unannotated one named
# `cfg` / `*_cfg`): only the commands (`run_*`, and `make config`'s print) and the builders of typed settings
# (`from_config`, and the fidelity command's `reference_settings`) read it; everything below them takes typed values
# (issue 44, item 1: at most 25; 144 in 31 modules before). A reader of one group
# (`HeadConfig.from_config(cfg.model.head)`, `LauncherSettings.of(cfg.launcher)`) takes that group as a mapping.
CONFIG_TAKERS_CEILING = 25
CONFIG_TAKER_NAMES = {"from_config", "print_config", "reference_settings"}


def config_takers() -> list[str]:
    found = []
    for path in modules():
        for node in functions(ast.parse(path.read_text())):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any((argument.annotation is not None and "DictConfig" in ast.unparse(argument.annotation))
                   or (argument.annotation is None and (argument.arg == "cfg" or argument.arg.endswith("_cfg")))
                   for argument in arguments):
                found.append(f"{relative(path)}::{node.name}")
    return found


def test_few_functions_take_the_composed_config() -> None:
    takers = config_takers()
    assert len(takers) <= CONFIG_TAKERS_CEILING, (f"{len(takers)} functions take the composed config (at most "
                                                  f"{CONFIG_TAKERS_CEILING}): pass typed settings down instead:\n"
                                                  + "\n".join(takers))
    others = [taker for taker in takers
              if not (taker.split("::")[1].startswith("run_") or taker.split("::")[1] in CONFIG_TAKER_NAMES)]
    assert others == [], f"neither a command nor a builder of settings, yet they take the composed config: {others}"
