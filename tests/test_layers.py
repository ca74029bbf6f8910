"""The layers contract (pyproject.toml, import-linter): the tree keeps it, and an upward import breaks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.utils.paths import PROJECT_ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def test_the_package_keeps_its_layers() -> None:
    result = lint_imports(PROJECT_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pipeline layers KEPT" in result.stdout
    assert "no import circle KEPT" in result.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path)
    paths = tmp_path / "pipeline" / "utils" / "paths.py"
    # the bottom floor reaching for the cross-validation driver, lazily: the kind of import a contract exists for
    paths.write_text(paths.read_text() + "\n\ndef _driver():\n"
                     "    from pipeline.runs.orchestration import cross_validation\n\n    return cross_validation\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "pipeline layers BROKEN" in result.stdout
    assert "pipeline.utils.paths -> pipeline.runs.orchestration.cross_validation" in result.stdout


def test_an_import_circle_breaks_the_contract_even_for_a_type(tmp_path: Path) -> None:
    """The circle issue 44 removed (`fold_run` imports `fold_job`; `fold_job` importing `fold_run` back, if only for
    a type) is found by the "no import circle" contract."""
    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path)
    fold_job = tmp_path / "pipeline" / "runs" / "jobs" / "fold_job.py"
    fold_job.write_text(fold_job.read_text() + "\n\nfrom typing import TYPE_CHECKING  # noqa: E402\n\n"
                        "if TYPE_CHECKING:\n    from pipeline.runs.jobs.fold_run import run_fold_job  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "no import circle BROKEN" in result.stdout
    assert "in pipeline.runs.jobs" in result.stdout and ".fold_run -> .fold_job" in result.stdout


def contract_layers() -> list[list[str]]:
    import tomllib

    config = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]


def package_modules() -> list[str]:
    root = PROJECT_ROOT / "pipeline"
    return sorted(".".join(("pipeline", *path.relative_to(root).with_suffix("").parts))
                  for path in root.rglob("*.py") if path.name != "__init__.py")


def test_every_module_of_the_package_is_in_a_layer() -> None:
    named = [name for layer in contract_layers() for name in layer]
    modules = package_modules()
    assert len(modules) > 50  # the walk found the package
    outside = [m for m in modules if not any(m == name or m.startswith(name + ".") for name in named)]
    assert outside == [], f"modules no layer of the contract names: {outside}"


def test_deployment_imported_from_runs_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path)
    registry = tmp_path / "pipeline" / "runs" / "store" / "registry.py"
    registry.write_text(registry.read_text() + "\n\nfrom pipeline.deployment import predict  # noqa: E402,F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "pipeline.runs.store.registry -> pipeline.deployment.predict" in result.stdout


def imports_of(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module, names, inside a function) for every `from pipeline... import ...` of a file."""
    import ast

    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("pipeline"):
                    found.append((inner.module, [a.name for a in inner.names], True))
    top = [(n.module, [a.name for a in n.names], False) for n in tree.body
           if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipeline")]
    return found + top


DRIVER = "pipeline.runs.orchestration.cross_validation"


def test_no_private_name_crosses_a_subpackage_and_nothing_reaches_into_the_cv_driver() -> None:
    root = PROJECT_ROOT / "pipeline"
    private, lazy_driver = [], []
    for path in root.rglob("*.py"):
        here = path.relative_to(root).parts[0]
        for module, names, in_function in imports_of(path):
            there = module.split(".")[1] if module.count(".") else ""
            if there != here:
                private += [f"{path.relative_to(PROJECT_ROOT)}: {module}.{n}" for n in names if n.startswith("_")]
            driver = module == DRIVER or (module == DRIVER.rsplit(".", 1)[0] and DRIVER.rsplit(".", 1)[1] in names)
            if in_function and driver and path.name != "cli.py":  # `from ...orchestration import cross_validation` too
                lazy_driver.append(f"{path.relative_to(PROJECT_ROOT)}: {module}")
    assert private == []
    assert lazy_driver == []
