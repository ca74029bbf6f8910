"""The Makefile passes words, not code (issue 37): whatever a user gives MODEL=, VIDEO=, ARGS=, ... (a file name from
a watch folder included) reaches the command as the characters given, one argument each. Neither make (`$(shell
...)`, `$X`) nor the shell (`$(...)`, backticks, `;`, quotes, spaces, backslashes, newlines) runs any of it, on the
command line or from the environment, in a dry run (`make -n`) or a real one. Real runs use a stand-in for the
environment's python that writes down its arguments (PY=), a real `make predict` that fails fast on a missing video,
and `make export RUN=` on a real logged model. The CLI splits ARGS into its words (shlex), never a shell."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main, split_args
from pipeline.utils.paths import PROJECT_ROOT

# -o: the environment is installed already (the shared one; its stamp may predate this checkout's files)
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed"]
CURDIR = os.path.realpath(PROJECT_ROOT)  # make's $(CURDIR): relative BIOVID_ROOT= and WEIGHTS= paths start there

# Each value tries to create its canary file ({canary}) the way its characters would if make or a shell read them.
PAYLOADS = {
    "dollar": "a$HOME$$b$(touch {canary})",
    "make_shell": "a$(shell touch {canary})b",
    "backtick": "a`touch {canary}`b",
    "semicolon": "a;touch {canary};b",
    "single_quote": "a';touch {canary};'b",
    "double_quote": 'a";touch {canary};"b',
    "newline": "a\ntouch {canary}\nb",
    "space": "a >{canary} b",
    "backslash": "a\\';touch {canary};'\\",
}
# The words each variable must become (in this order, side by side) in the command's arguments
WORDS = {
    "MODEL": lambda value: [f"model={value}"],  # the command reads it (config.backbone_choice)
    "DATA": lambda value: [f"data={value}"],
    "TASK": lambda value: [f"task={value}"],
    "BIOVID_ROOT": lambda value: [f"data.root={CURDIR}/{value}"],  # every payload is relative
    "WEIGHTS": lambda value: [f"model.weights={CURDIR}/{value}"],
    "ARGS": lambda value: [f"--args={value}"],  # one argument: the command splits it (test_args_...)
    "VIDEO": lambda value: [f"--video={value}"],
    "FPS": lambda value: [f"predict.fps={value}"],
    "OUT": lambda value: [f"--out={value}"],
    "MODEL_URI": lambda value: [f"--model_uri={value}"],
    "RUN": lambda value: [f"--run={value}"],
}
OVERRIDE_VARIABLES = ("MODEL", "DATA", "TASK", "BIOVID_ROOT", "WEIGHTS", "ARGS")
TARGETS = {  # the variables each target passes on
    "predict": (*OVERRIDE_VARIABLES, "VIDEO", "FPS", "OUT", "MODEL_URI", "RUN"),
    "export": (*OVERRIDE_VARIABLES, "MODEL_URI", "OUT", "RUN"),
    "serve": (*OVERRIDE_VARIABLES, "MODEL_URI"),
    "final": (*OVERRIDE_VARIABLES, "RUN"),
    "inspect": (*OVERRIDE_VARIABLES, "RUN"),
    "table": ("MODEL", "DATA", "BIOVID_ROOT", "ARGS"),  # MODEL: the backbones, --models=
    "fidelity": ("DATA", "ARGS"),
}
ECHO = """#!{python}
import json, os, sys
with open(os.environ["ECHO_FILE"], "a") as file:
    file.write(json.dumps({{"argv": sys.argv[1:], "env": {{n: os.environ.get(n) for n in {names!r}}}}}) + "\\n")
"""


def echo_python(folder: Path) -> Path:
    """A stand-in for the environment's python (PY=): it writes its arguments and the variables' environment."""
    path = folder / "echo_python"
    path.write_text(ECHO.format(python=sys.executable, names=sorted(WORDS)))
    path.chmod(0o755)
    return path


def values_for(variables: tuple[str, ...], payload: str, folder: Path) -> dict[str, str]:
    """Each variable's value: the payload with a canary file of its own."""
    return {name: PAYLOADS[payload].format(canary=folder / f"canary_{name}") for name in variables}


def canaries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("canary_*"))


# what an enclosing make (CI's `make test`) hands its children: a nested make would report as make[1] and inherit
# the parent's flags and command-line variables; the tests run make as a user at a shell does
PARENT_MAKE = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR")


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {name: value for name, value in os.environ.items() if name not in WORDS and name not in PARENT_MAKE}
    return subprocess.run([*MAKE, *args], cwd=PROJECT_ROOT, env={**clean, **(env or {})}, capture_output=True,
                          text=True, timeout=120)


def contains(words: list[str], part: list[str]) -> bool:
    return any(words[i:i + len(part)] == part for i in range(len(words) - len(part) + 1))


def expected_words(target: str, name: str, value: str) -> list[str]:
    return [f"--models={value}"] if (target, name) == ("table", "MODEL") else WORDS[name](value)


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("target", TARGETS)
def test_a_value_on_the_command_line_reaches_the_command_as_one_argument_and_runs_nothing(target: str, payload: str,
                                                                                         tmp_path: Path) -> None:
    values = values_for(TARGETS[target], payload, tmp_path)
    assignments = [f"{name}={value}" for name, value in values.items()]
    dry = make("-n", target, *assignments)
    assert dry.returncode == 0, dry.stderr
    assert canaries(tmp_path) == [], f"make -n {target} ran a value's code: {dry.stdout}"
    done = make(target, f"PY={echo_python(tmp_path)}", *assignments, env={"ECHO_FILE": str(tmp_path / "echo")})
    assert done.returncode == 0, done.stderr
    assert canaries(tmp_path) == [], f"make {target} ran a value's code: {done.stdout}"
    [call] = [json.loads(line) for line in (tmp_path / "echo").read_text().splitlines()]
    assert call["argv"][:3] == ["-m", "pipeline", target]
    for name, value in values.items():
        assert contains(call["argv"], expected_words(target, name, value)), (name, call["argv"])
        assert call["env"][name] == value, name  # exported to the command as make exports a command-line variable


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_value_from_the_environment_is_data_too(payload: str, tmp_path: Path) -> None:
    values = values_for(TARGETS["predict"], payload, tmp_path)
    assert make("-n", "predict", env=values).returncode == 0
    done = make("predict", f"PY={echo_python(tmp_path)}", env={**values, "ECHO_FILE": str(tmp_path / "echo")})
    assert done.returncode == 0, done.stderr
    assert canaries(tmp_path) == []
    [call] = [json.loads(line) for line in (tmp_path / "echo").read_text().splitlines()]
    for name, value in values.items():
        assert contains(call["argv"], WORDS[name](value)) and call["env"][name] == value, name


def test_every_variable_with_a_default_is_frozen_when_it_comes_from_the_environment(tmp_path: Path) -> None:
    """USER_VARIABLES must name every `?=` variable: one it misses, set in the environment, is expanded by make."""
    names = re.findall(r"^([A-Z_]+) \?=", (Path(PROJECT_ROOT) / "Makefile").read_text(), flags=re.MULTILINE)
    assert len(names) > 30
    env = {name: f"$(shell touch {tmp_path / f'canary_{name}'})" for name in names}
    # a target of its own that reads every one of them (make -n: the recipe is expanded, not run)
    done = make("-n", "--eval", f"read-all: ; : {' '.join(f'$({name})' for name in names)}", "read-all", env=env)
    assert done.returncode == 0, done.stderr
    assert canaries(tmp_path) == []
    assert all(value in done.stdout for value in env.values())


def test_model_names_with_a_config_file_select_it_and_others_are_timm_names() -> None:
    """MODEL= reaches the command as one word, `model=<name>`; the command (`config.backbone_choice`, the one rule)
    selects the file of that name, or reads any other name as a timm model."""
    from pipeline.utils.config import backbone_choice

    def model_words(model: str) -> list[str]:
        printed = make("-n", "cv", f"MODEL={model}").stdout
        return re.findall(r"'(model(?:\.name)?=[^']*)'", printed)

    assert model_words("mobilevit_xxs") == ["model=mobilevit_xxs"] and backbone_choice("model=mobilevit_xxs") == [
        "model=mobilevit_xxs"]
    assert backbone_choice("model=timm") == ["model=timm"]
    # a timm name, and names that a file lookup could misread (a space, a glob, a pattern, a path out of the folder)
    for name in ("eva02_tiny_patch14_224.mim_in22k", "vit_b16 cvt_13", "*", "%", "vit_b1", "../config"):
        assert model_words(name) == [f"model={name}"], name
        assert backbone_choice(f"model={name}") == ["model=timm", f"model.name={name}"], name


def test_paths_are_made_absolute_in_make_as_before(tmp_path: Path) -> None:
    echo = echo_python(tmp_path)
    env = {"ECHO_FILE": str(tmp_path / "echo")}
    for root, expected in (("rel/../PartA", f"{CURDIR}/PartA"), ("/data/Bio Vid/Part A", "/data/Bio Vid/Part A"),
                           ("Bio Vid/../A", f"{CURDIR}/Bio Vid/../A"), ("end ", f"{CURDIR}/end ")):
        assert make("data", f"PY={echo}", f"BIOVID_ROOT={root}", env=env).returncode == 0
        argv = json.loads((tmp_path / "echo").read_text().splitlines()[-1])["argv"]
        assert f"data.root={expected}" in argv, (root, argv)


def test_help_lists_the_targets_and_the_defaults() -> None:
    done = make("help", "MODEL=a'$(shell id)\"b")
    assert done.returncode == 0, done.stderr
    assert "  make export       the network of MODEL_URI= or RUN=" in done.stdout
    assert "Variables: MODEL=a'$(shell id)\"b DATA=synthetic PROTOCOL=kfold5 TASK=bl1_vs_pa4 BIOVID_ROOT=" \
        in done.stdout
    assert "LAUNCHER=local (local|parallel|slurm)" in make("help").stdout


def test_args_are_split_into_words_as_a_shell_would_but_nothing_in_them_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    words = split_args(["--video=x", f"--args=a=1 b='x y' c=\"$(touch {canary})\" d='`touch {canary}`';e\\ f", "g=2"])
    assert words == ["--video=x", "a=1", "b=x y", f"c=$(touch {canary})", f"d=`touch {canary}`;e f", "g=2"]
    assert not canary.exists()


def test_the_command_reads_the_words_of_args_and_names_args_when_they_cannot_be_split(capsys) -> None:
    from omegaconf import OmegaConf

    assert main(["config", "--args=trainer.max_epochs=3 reports_dir='/tmp/two words'"]) == 0
    cfg = OmegaConf.create(capsys.readouterr().out)
    assert cfg.trainer.max_epochs == 3 and cfg.reports_dir == "/tmp/two words"
    assert main(["config", "--args=reports_dir='open"]) == 2
    assert "config: ARGS=\"reports_dir='open\": No closing quotation" in capsys.readouterr().err


def test_make_predict_runs_python_with_the_video_path_as_given(tmp_path: Path) -> None:
    """The real command: a missing video is refused before any model loads, naming the path as it was given."""
    video = f"{tmp_path}/no such/a$(shell touch {tmp_path}/canary_1)`touch {tmp_path}/canary_2`;" \
            f"touch {tmp_path}/canary_3;'\"\ntouch {tmp_path}/canary_4\\.mp4"
    done = make("predict", f"VIDEO={video}", "MODEL=mobilevit_xxs")
    assert done.returncode == 2 and "make: *** [Makefile" in done.stderr  # the command's 1, as make reports it
    assert f"predict: VIDEO={video}: no such file or folder" in done.stderr
    assert canaries(tmp_path) == []


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A store of its own with a final model's run that logged an untrained MobileViT-XXS (32 px, random weights,
    no training) and a cross-validation's parent run, made by hand."""
    import mlflow
    from mlflow import MlflowClient

    from pipeline.models.factory import create_model
    from pipeline.models.model_file import model_meta, save_model_file
    from pipeline.runs.serving.mlflow_model import log_mlflow_model, model_config
    from pipeline.runs.store import tracking
    from pipeline.utils.config import load_config

    own = tmp_path_factory.mktemp("make export")  # a space: the store's path travels through ARGS quoted
    uri = f"sqlite:///{own / 'mlflow.db'}"
    cfg = load_config([f"mlflow.tracking_uri={uri}"])
    net, _ = create_model("mobilevit_xxs", 2, pretrained=False, img_size=32)
    class_names = ["BL1", "PA4"]
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=class_names, task=cfg.task.name,
                      loader={"crop_fraction": 1.0}, weights={"weights_source": "random"})
    path = save_model_file(net, meta, own / "model.pt")
    mlflow.set_tracking_uri(uri)
    experiment = tracking.get_or_create_experiment("make-export", own / "art", client=MlflowClient(uri))
    with mlflow.start_run(experiment_id=experiment, tags={tracking.RUN_KIND_TAG: tracking.FINAL_RUN}) as run:
        log_mlflow_model(path, model_config(cfg, class_names, 0.5, "fixed"), {"model": "mobilevit_xxs"},
                         with_example=False)
    parent = MlflowClient(uri).create_run(experiment, tags={tracking.RUN_KIND_TAG: tracking.CV_RUN})
    return {"args": f"ARGS=mlflow.tracking_uri='{uri}'", "cfg": cfg, "final": run.info.run_id,
            "cv": parent.info.run_id}


def test_make_export_run_exports_that_runs_model(model_runs: dict, tmp_path: Path) -> None:
    """RUN= was ignored by make export, which exported the champion (or failed for want of one)."""
    done = make("export", f"RUN={model_runs['final']}", f"OUT={tmp_path / 'out'}", model_runs["args"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [onnx] = (tmp_path / "out").glob("*.onnx")
    contract = json.loads(onnx.with_suffix(".json").read_text())
    assert contract["source"].startswith(f"run {model_runs['final']} (models:/")
    assert contract["model"] == "mobilevit_xxs" and onnx.stat().st_size > 0


def test_export_refuses_a_cross_validations_parent_run(model_runs: dict, tmp_path: Path) -> None:
    """A parent run logs no model: refused, naming the run (in-process; the test above takes RUN= through make)."""
    from pipeline.deployment.export import run_export

    with pytest.raises(SystemExit, match=f"run {model_runs['cv']} is neither a fold's nor a final model's run"):
        run_export(model_runs["cfg"], run=model_runs["cv"], out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
