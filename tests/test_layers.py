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


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(PROJECT_ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "pyproject.toml", tmp_path)
    paths = tmp_path / "pipeline" / "utils" / "paths.py"
    # the bottom floor reaching for the cross-validation driver, lazily: the kind of import a contract exists for
    paths.write_text(paths.read_text() + "\n\ndef _driver():\n    from pipeline.runs import cross_validation\n\n"
                     "    return cross_validation\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "pipeline layers BROKEN" in result.stdout
    assert "pipeline.utils.paths -> pipeline.runs.cross_validation" in result.stdout
