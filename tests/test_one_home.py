"""One answer per question, in one home (issue 35): the store's names only in its tag module, a strategy's name read
only by the strategy module. Read from the source with `ast`, so that a second copy fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.utils.paths import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pipeline"
TAG_HOME = PACKAGE / "runs" / "store" / "tracking.py"
STRATEGY_HOME = PACKAGE / "models" / "finetune.py"
# file formats, not store names: what a kept model file and an embedding-cache record say they are
FORMATS = {("pipeline/models/model_file.py", "painvit.fold_model/1"),
           ("pipeline/models/embedding_cache.py", "painvit.embeddings/1")}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module (f-strings' literal parts too), with its line."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_every_store_name_lives_in_the_tag_module() -> None:
    outside = []
    for path in modules():
        relative = path.relative_to(PROJECT_ROOT).as_posix()
        if path == TAG_HOME:
            continue
        outside += [f"{relative}:{line}: {value!r}" for line, value in string_constants(path)
                    if value.startswith("painvit.") and (relative, value) not in FORMATS]
    assert outside == [], "tag names outside pipeline/runs/store/tracking.py:\n" + "\n".join(outside)


def test_only_the_strategy_module_reads_a_strategy_name() -> None:
    """`FinetuneConfig.backbone_fixed` / `reads_cache` answer whether the backbone is fixed and whether the head reads
    the cache; nothing else compares a string with "frozen"."""
    found = []
    for path in modules():
        if path == STRATEGY_HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(part, ast.Constant) and part.value == "frozen"
                                                     for part in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}")
    assert found == [], f"strategy names compared outside {STRATEGY_HOME.name}: {found}"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The two walks above see a tag literal in an f-string and a comparison written either way round."""
    sample = tmp_path / "sample.py"
    sample.write_text('def f(cfg, k):\n    return "frozen" == cfg.x, {f"painvit.tune_{k}": 1}\n')
    assert any(value.startswith("painvit.") for _, value in string_constants(sample))
    compares = [node for node in ast.walk(ast.parse(sample.read_text())) if isinstance(node, ast.Compare)]
    assert compares and isinstance(compares[0].left, ast.Constant) and compares[0].left.value == "frozen"
