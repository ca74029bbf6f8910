"""One answer per question, in one home (issue 35): the store's names only in its tag module, a strategy's name read
only by the strategy module. Read from the source with `ast`, so that a second copy fails here, not in review."""

from __future__ import annotations

import ast
import re
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


# ---------------------------------------------------------------------------------------------------------------
# Every MLflow tag name and run or trial status, wherever a run is tagged, read, queried or ended: a name from
# pipeline/runs/store/tracking.py, never a string typed at the call.

# a filter that names a tag or status itself: tags.model = ..., tags.`fold` = ..., attributes.status = 'RUNNING'
FILTER_NAME = re.compile(r"tags\.`?[A-Za-z_][\w.]*`?\s*(=|!=|LIKE)|attributes\.status\s*(=|!=)\s*'[A-Z]",
                         re.IGNORECASE)
STATUS = re.compile(r"[A-Z_]+")


def strings(node: ast.AST | None) -> list[ast.Constant]:
    """The string constants of an expression, an f-string's literal parts included."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, ast.JoinedStr):
        return [part for part in node.values if isinstance(part, ast.Constant)]
    return []


def dict_keys(node: ast.AST | None) -> list[ast.Constant]:
    return [found for key in node.keys for found in strings(key)] if isinstance(node, ast.Dict) else []


def store_names() -> set[str]:
    """The values of tracking.py's tag-name constants (`*_TAG`)."""
    from pipeline.runs.store import tracking

    return {value for name, value in vars(tracking).items() if name.endswith("_TAG") and isinstance(value, str)}


def typed_store_names(tree: ast.AST, known: set[str]) -> list[tuple[int, str, str]]:
    """(line, literal, where) of every tag name or status written as a string at an MLflow call (see above)."""
    found: list[tuple[int, str, str]] = []

    def add(nodes: list[ast.Constant], where: str) -> None:
        found.extend((node.lineno, node.value, where) for node in nodes)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "set_tag" and node.args:
                key = 1 if len(node.args) == 3 else 0  # client.set_tag(run_id, name, value) | mlflow.set_tag(name, v)
                add(strings(node.args[key]), "set_tag name")
                if len(node.args) > key + 1:
                    add([c for c in strings(node.args[key + 1]) if STATUS.fullmatch(c.value)], "set_tag status")
            if name in ("set_tags", "end_run", "set_terminated"):
                add([c for arg in node.args for c in [*dict_keys(arg), *strings(arg)] if name != "set_terminated"
                     or arg is not node.args[0]], name)
            if name == "get" and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value).endswith(
                    "tags") and node.args:
                add(strings(node.args[0]), "tags.get")
            for keyword in node.keywords:
                if keyword.arg == "tags":
                    add(dict_keys(keyword.value), "tags=")
                if keyword.arg == "status":
                    add(strings(keyword.value), "status=")
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("tags"):
            add(strings(node.slice), "tags[...]")
        elif isinstance(node, ast.Compare) and any(ast.unparse(part).endswith(".status")
                                                   for part in [node.left, *node.comparators]):
            add([c for part in [node.left, *node.comparators] for c in strings(part)], "status compared")
        elif isinstance(node, ast.FunctionDef) and "tags" in node.name:
            add([c for inner in ast.walk(node) for c in dict_keys(inner)], f"{node.name}()")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and FILTER_NAME.search(node.value):
            add([node], "run filter")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            values = [c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if len(values) >= 3 and len(values) == len(node.elts) and set(values) <= known:
                add([c for c in node.elts if isinstance(c, ast.Constant)], "a list of tag names")
    return found


def test_every_tag_name_and_status_at_an_mlflow_call_comes_from_the_tag_module() -> None:
    known = store_names()
    outside = []
    for path in modules():
        if path == TAG_HOME:
            continue
        outside += [f"{path.relative_to(PROJECT_ROOT)}:{line}: {value!r} ({where})"
                    for line, value, where in typed_store_names(ast.parse(path.read_text()), known)]
    assert outside == [], "tag names or statuses typed outside pipeline/runs/store/tracking.py:\n" + "\n".join(outside)


def test_the_tag_walk_finds_each_kind_of_typed_name() -> None:
    """Each way a run is tagged, read, queried or ended, with a typed string: every one is found."""
    sample = '''
def f(client, run, mlflow, query):
    mlflow.set_tag("threshold_rule", "x")
    client.set_tag(run.info.run_id, "calibration_note", "x")
    mlflow.set_tag(tracking.TRIAL_STATE_TAG, "PRUNED")
    mlflow.set_tags({"finetune": "full"})
    client.create_run("0", tags={"dataset": "d"})
    client.set_terminated(run.info.run_id, "KILLED")
    mlflow.end_run("FAILED")
    client.update_run(run.info.run_id, status="RUNNING")
    run.data.tags.get("complete")
    run.data.tags["model"]
    run.info.status == "FINISHED"
    query("tags.dataset = 'x' and attributes.status = 'RUNNING'")
    keys = ("model", "dataset", "protocol")
    return keys


def device_tags():
    return {"device": "cpu"}
'''
    found = {(value, where) for _, value, where in typed_store_names(ast.parse(sample), store_names())}
    assert found >= {("threshold_rule", "set_tag name"), ("calibration_note", "set_tag name"),
                     ("PRUNED", "set_tag status"), ("finetune", "set_tags"), ("dataset", "tags="),
                     ("KILLED", "set_terminated"), ("FAILED", "end_run"), ("RUNNING", "status="),
                     ("complete", "tags.get"), ("model", "tags[...]"), ("FINISHED", "status compared"),
                     ("model", "a list of tag names"), ("device", "device_tags()")}
    assert any(where == "run filter" for _, where in found)


def test_only_a_backbone_family_knows_its_family() -> None:
    """What a family is lives in its adapter module (pipeline/models/backbone_families/): nothing else compares a
    string with a family's name, nor asks whether a backbone is an instance of an adapter class."""
    from pipeline.models.backbone_adapter import FAMILIES

    homes = (PACKAGE / "models" / "backbone_families", PACKAGE / "models" / "backbone_adapter.py")
    found = []
    for path in modules():
        if any(path == home or home in path.parents for home in homes):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(part, ast.Constant) and part.value in FAMILIES
                                                     for part in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}: a family name compared")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2
                    and ast.unparse(node.args[1]).endswith("Backbone")):
                found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno}: isinstance on a backbone class")
    assert found == [], "family knowledge outside pipeline/models/backbone_families/:\n" + "\n".join(found)


# Public names defined in two modules today, each meaning something else in its module (issue 44 gave
# `keep_fold_model`, `head_parameters` and `load_scorer` one meaning each); none may join them.
NAMES_OF_TWO = {"fold_line", "one_line", "print_table", "sampled_frames", "shown", "video_to_crop", "weights_path",
                "main", "from_config"}


def test_one_name_one_function() -> None:
    """A public function or class of pipeline/ is defined in one module: a second `load_scorer` that does
    something else is found here, not by a reader who imported the wrong one."""
    homes: dict[str, list[str]] = {}
    for path in modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(str(path.relative_to(PROJECT_ROOT)))
    twice = {name: where for name, where in homes.items() if len(where) > 1 and name not in NAMES_OF_TWO}
    assert twice == {}, f"one name, two functions: {twice}"
