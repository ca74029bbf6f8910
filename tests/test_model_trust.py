"""A model runs no code but the installed package's: copies of a really logged model (the untrained session model)
changed as an attacker would, handed to `make predict` (MODEL_URI= and a moved champion alias), `make export`,
`make serve` and `mlflow models serve`; each is refused with its reason and its code never runs (it would write a
file). The untouched model, and older models of the project, still load and score."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from pipeline.deployment.predict import run_predict
from pipeline.deployment.video_frames import sampled_frames
from pipeline.runs.serving.mlflow_model import load_scorer
from pipeline.runs.serving.model_trust import FORMER_CODE_FILES, RETIRED_CODE_FILES, UntrustedModel, check_model_folder
from pipeline.runs.store.registry import CHAMPION, registered_name
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The code files older models carry, as the project wrote them, by the commit that wrote them (git show
# 34b0214:pipeline/runs/pain_model_code.py, git show 8e322e8:pipeline/runs/mlflow_model_code.py, git show
# f4cb953:pipeline/runs/mlflow_model_code.py: the last before `runs/` was split, which imports the old paths
# `pipeline.runs.serving_input` and `pipeline.runs.mlflow_model`)
DOCSTRING = ('"""The code file of the MLflow pain model ("models from code"): MLflow stores this file with the model '
             'and runs it\nwhen the model is loaded; everything it needs comes from the installed `pipeline` '
             'package."""\n\nimport mlflow\n\n')
BEFORE_THE_SPLIT = '''\
"""The code file of the MLflow pain model ("models from code"): MLflow stores this file with the model and runs it
when the model is loaded; everything it needs comes from the installed `pipeline` package. It is also where a scoring
process that MLflow starts (`mlflow models serve`) first touches the project, before OpenCV loads: OpenCV's own pixel
cap is set to the frame cap there (`pipeline.runs.serving_input`). `pipeline.runs.model_trust` refuses a model whose
copy of this file differs from the installed one."""

import mlflow

from pipeline.runs.serving_input import ServingLimits, cap_opencv_pixels

cap_opencv_pixels(ServingLimits.from_env().max_frame_pixels)

from pipeline.runs.mlflow_model import PainMlflowModel  # noqa: E402  (after the cap: it loads OpenCV)

mlflow.models.set_model(PainMlflowModel())
'''
FORMER = {"34b0214": ("pain_model_code.py", DOCSTRING + "from pipeline.runs.pain_model import PainFrameModel\n\n"
                                                        "mlflow.models.set_model(PainFrameModel())\n"),
          "8e322e8": ("mlflow_model_code.py", DOCSTRING + "from pipeline.runs.mlflow_model import PainMlflowModel\n\n"
                                                          "mlflow.models.set_model(PainMlflowModel())\n"),
          "f4cb953": ("mlflow_model_code.py", BEFORE_THE_SPLIT)}
RETIRED = DOCSTRING + "from pipeline.pain_model import PainFrameModel\n\nmlflow.models.set_model(PainFrameModel())\n"


def code_that_writes(marker: Path) -> str:
    return f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"


def read_mlmodel(folder: Path) -> dict:
    return yaml.safe_load((folder / "MLmodel").read_text())


def write_mlmodel(folder: Path, description: dict) -> None:
    (folder / "MLmodel").write_text(yaml.safe_dump(description))


def copy_model(untrained_model, to: Path) -> Path:
    shutil.copytree(untrained_model["local"], to)
    return to


def code_name(folder: Path) -> str:
    return Path(read_mlmodel(folder)["flavors"]["python_function"]["model_code_path"]).name


def with_code_line(folder: Path, marker: Path) -> Path:
    """The copy's code file with one line added at its top."""
    code = folder / code_name(folder)
    code.write_text(code_that_writes(marker) + code.read_text())
    return folder


def with_loader(folder: Path, marker: Path) -> Path:
    """A loader_module of its own, in a `code` path MLflow puts on sys.path first."""
    (folder / "code").mkdir()
    (folder / "code" / "evil_loader.py").write_text(code_that_writes(marker) + "def _load_pyfunc(path, config=None):\n"
                                                    "    raise SystemExit('loaded')\n")
    description = read_mlmodel(folder)
    description["flavors"]["python_function"].update(loader_module="evil_loader", code="code")
    write_mlmodel(folder, description)
    return folder


def with_code_path(folder: Path, marker: Path) -> Path:
    """MLflow's own loader and the project's code file, but a `code` path with a module in it."""
    (folder / "code").mkdir()
    (folder / "code" / "onnxruntime.py").write_text(code_that_writes(marker))  # imported later, by `make export`
    description = read_mlmodel(folder)
    description["flavors"]["python_function"]["code"] = "code"
    write_mlmodel(folder, description)
    return folder


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "the folder's code ran"


@pytest.fixture(scope="module")
def frames(untrained_model) -> list[np.ndarray]:
    video = sorted(Path(untrained_model["cfg"].data.root, "video").rglob("*PA4*.mp4"))[0]
    return next(sampled_frames(video, 5))[2][:3]


def test_each_change_an_attacker_makes_is_refused_with_its_reason(untrained_model, tmp_path, marker) -> None:
    """The check alone, on every kind of change: the reason names what is wrong, and nothing of the folder ran."""
    check_model_folder(untrained_model["local"])  # the untouched model passes

    def changed(name: str, change) -> Path:
        folder = copy_model(untrained_model, tmp_path / name)
        change(folder)
        return folder

    def edit(**settings):
        def apply(folder: Path) -> None:
            description = read_mlmodel(folder)
            for key, value in settings.items():
                if key == "flavors":
                    description["flavors"].update(value)
                else:
                    description["flavors"]["python_function"][key] = value
            write_mlmodel(folder, description)
        return apply

    cases = {
        "code line": (lambda f: with_code_line(f, marker), "differs from the project's"),
        "loader": (lambda f: with_loader(f, marker), "loader_module is 'evil_loader'"),
        "code path": (lambda f: with_code_path(f, marker), "names code paths ('code')"),
        "code folder": (lambda f: (f / "code").mkdir(), "holds a `code` folder"),
        "python file": (lambda f: (f / "artifacts" / "helper.py").write_text("x = 1\n"),
                        "holds artifacts/helper.py"),
        "pickle": (lambda f: (f / "python_model.pkl").write_bytes(b"\x80\x04N."), "holds python_model.pkl"),
        "pickled model": (edit(python_model="python_model.pkl"), "settings the project does not write: "
                                                                 "['python_model']"),
        "flavor": (edit(flavors={"pytorch": {"pickle_module_name": "pickle"}}), "not python_function alone"),
        "artifact": (edit(artifacts={"weights": {"path": "artifacts/model.pt"}, "extra": {"path": "MLmodel"}}),
                     "an artifact 'extra'"),
        "outside": (edit(artifacts={"weights": {"path": "../../model.pt"}}), "does not lie inside the model folder"),
        "no code file": (lambda f: (f / code_name(f)).unlink(), "is missing"),
        "linked code file": (lambda f: ((f / code_name(f)).unlink(), (f / code_name(f)).symlink_to(
            PROJECT_ROOT / "pipeline/runs/serving/mlflow_model_code.py")), "is not a regular file"),
        "retired": (lambda f: (f / code_name(f)).write_text(RETIRED), "first layout (8747c8e)"),
    }
    for name, (change, reason) in cases.items():
        with pytest.raises(UntrustedModel, match=re.escape(reason)):
            check_model_folder(changed(name, change))
    assert not marker.exists()


def test_predict_export_and_a_moved_champion_refuse_a_changed_model_and_never_run_it(
        untrained_model, tmp_path, marker) -> None:
    """`make predict MODEL_URI=<copy>` of a copy with one line added to its code file, or with a loader_module of
    its own in a code path; `make export` of a copy with a module in a code path; and `make predict` of the champion
    after someone with registry access moved the alias to a version whose source is the changed copy."""
    from pipeline.deployment.export import run_export

    cfg = untrained_model["cfg"]
    video = sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]
    for name, change, reason in (("code line", with_code_line, "differs from the project's"),
                                 ("loader", with_loader, "loader_module is 'evil_loader'")):
        folder = change(copy_model(untrained_model, tmp_path / name), marker)
        with pytest.raises(SystemExit, match=f"predict: refused model {re.escape(str(folder))}: its .*{reason}"):
            run_predict(cfg, video=str(video), model_uri=str(folder), out=str(tmp_path / "out"))
    folder = with_code_path(copy_model(untrained_model, tmp_path / "code path"), marker)
    with pytest.raises(SystemExit, match="export: refused model .*names code paths"):
        run_export(cfg, model_uri=str(folder), out=str(tmp_path / "export"))

    client = MlflowClient(cfg.mlflow.tracking_uri)
    name = registered_name(cfg.model.name, cfg.task.name)
    client.create_registered_model(name)
    changed = with_code_line(copy_model(untrained_model, tmp_path / "registered"), marker)
    version = client.create_model_version(name, source=str(changed))
    client.set_registered_model_alias(name, CHAMPION, version.version)
    try:
        with pytest.raises(SystemExit, match=f"predict: refused model models:/{name}@{CHAMPION}: its code file"):
            run_predict(cfg, video=str(video), out=str(tmp_path / "champion"))
    finally:
        client.delete_registered_model(name)
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "export").exists()


def test_make_serve_refuses_a_changed_model_before_loading_it(untrained_model, tmp_path, marker) -> None:
    """`make serve MODEL_URI=<copy>`: the server does not start, says why, and the copy's code never ran."""
    cfg = untrained_model["cfg"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, change, reason in (("code line", with_code_line, "its code file mlflow_model_code.py differs"),
                                 ("loader", with_loader, "its loader_module is 'evil_loader'")):
        folder = change(copy_model(untrained_model, tmp_path / name), marker)
        done = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "serve",
                               f"SERVE_PORT={port}", f"MODEL_URI={folder}",
                               f"ARGS=mlflow.tracking_uri={cfg.mlflow.tracking_uri}"], cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
        assert done.returncode != 0, done.stdout[-2000:]
        assert f"serve: refused model {folder}: {reason}" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "serving " not in done.stdout
    assert not marker.exists()


def test_mlflow_models_serve_of_a_model_with_a_code_path_does_not_start(untrained_model, tmp_path, marker) -> None:
    """Under `mlflow models serve` MLflow loads the folder without asking the project; with the project's code file
    and loader, the model's own load_context refuses a folder with a code path, and the server does not serve."""
    folder = with_code_path(copy_model(untrained_model, tmp_path / "code path"), marker)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "--env-manager",
                                "local", "--host", "127.0.0.1", "--port", str(port), "-m", str(folder)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while process.poll() is None and time.monotonic() < deadline:
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, "mlflow models serve served the changed model"
            time.sleep(1)
    finally:
        stop_process_group(process)
    output = process.stdout.read().decode(errors="replace")
    assert "it names code paths ('code')" in output, output[-3000:]
    assert not marker.exists()


def test_the_untouched_model_and_older_ones_of_the_project_load_and_score(untrained_model, tmp_path, frames) -> None:
    """The untouched copy scores; a model carrying an older code file of the project (`pain_model_code.py`, which
    imports the class through `pipeline.runs.pain_model`, `mlflow_model_code.py` as it was before OpenCV's cap, or as
    it was before `runs/` was split, importing the old paths that still re-export the new ones) loads as what it is
    and scores alike."""
    assert {hashlib.sha256(text.encode()).hexdigest() for _, text in FORMER.values()} == set(FORMER_CODE_FILES)
    assert hashlib.sha256(RETIRED.encode()).hexdigest() in RETIRED_CODE_FILES
    untouched = load_scorer(str(copy_model(untrained_model, tmp_path / "untouched"))).score(frames)
    assert untouched.face_found.any() and untouched.pain_probability.dropna().between(0, 1).all()
    for commit, (name, text) in FORMER.items():
        folder = copy_model(untrained_model, tmp_path / commit)
        (folder / code_name(folder)).unlink()
        (folder / name).write_text(text)
        description = read_mlmodel(folder)
        description["flavors"]["python_function"]["model_code_path"] = f"/elsewhere/{name}"
        write_mlmodel(folder, description)
        check_model_folder(folder)
        scored = load_scorer(str(folder)).score(frames)
        np.testing.assert_allclose(scored.pain_probability, untouched.pain_probability, atol=1e-6)
