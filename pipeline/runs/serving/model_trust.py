"""A model folder is this project's before anything of it runs.

`mlflow.pyfunc.load_model` runs code that the folder names: its code file ("models from code"), its python_function
`loader_module`, modules of its `code` paths (put first on sys.path), a pickled python model. A folder someone handed
over, or a registry alias moved by anyone with write access to the registry, would run its code before the project
could ask whether it is a pain model (`weights_only=True` protects the weights file, nothing else). So every way the
project loads a model first calls `check_model_folder` on the local folder MLflow will load: `make predict`
(MODEL_URI=, RUN= and the champion) and `make export` through `mlflow_model.load_scorer`, `make serve` before the
scoring app loads it, and the model's own `load_context` (the one place the project has a say under `mlflow models
serve`). It refuses, with the reason, a folder

- whose MLmodel has a flavor besides python_function, or python_function settings the project does not write
  (a pickled `python_model`, a `data` folder, another `predict_fn`, ...);
- whose loader is not MLflow's own loader of models from code (`mlflow.pyfunc.loaders.code_model`), or that names
  `code` paths;
- whose code file is not a regular file that is, byte for byte, one of the project's: the installed
  `mlflow_model_code.py` (SHA-256 of the installed file), or one of the code files older models carry
  (`FORMER_CODE_FILES`);
- that holds a `code` folder or any other file Python could import or unpickle (.py, .pyc, .so, .pth, .pkl, ...);
- whose artifacts are other than `weights` and `weights_<i>`, or lie outside the folder.

What is left to run is the installed package: the code file only imports `pipeline.runs.serving`, and the weights
are read with `weights_only=True` (`pipeline.models.model_file`). Under `mlflow models serve`, MLflow runs the code
file before the project has a say: a changed code file has run by the time `load_context` refuses the model (use
`make serve`, which checks first). The folder is checked where it lies: whoever can write it while it is being
loaded could change it between the check and the load.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from pipeline.utils.digests import file_sha256

CODE_FILE = Path(__file__).with_name("mlflow_model_code.py")  # what MLflow stores with every model the project logs
LOADER_MODULE = "mlflow.pyfunc.loaders.code_model"  # MLflow's own loader of models from code
# Code files older models carry, by SHA-256, with where they come from; all only import the installed package:
# pain_model_code.py (logged 2026-12-01, 34b0214, to 2026-12-02, 8e322e8) imports `PainFrameModel` from
# `pipeline.runs.pain_model`, which that module keeps; mlflow_model_code.py as it was from 8e322e8 until the frame
# cap came (it imports `PainMlflowModel` without setting OpenCV's own cap first); mlflow_model_code.py as it was from
# the frame cap (f4cb953) until `runs/` was split (it imports `pipeline.runs.serving_input` and
# `pipeline.runs.mlflow_model`, which those modules keep). Such models still load.
FORMER_CODE_FILES = {
    "798ca3c3a6ff841e56018ec6dd97b1ed97b06a514fdd2b1ec847a6d2d08d1631": "pain_model_code.py of 34b0214",
    "b7fd12f1b15f5783780cc53c51fab14ae00f5c136fd327efb1e59f00fbf8c5a3": "mlflow_model_code.py of 8e322e8",
    "d303ce6e4f2cde928caa2a28e1e2676d9735b2338f7a391c4017837b1a37ff31": "mlflow_model_code.py of f4cb953",
}
# The code file of the first layout (8747c8e) imports `pipeline.pain_model`, which no longer exists: refused by name.
RETIRED_CODE_FILES = {"5c6bf5c7ae43095a0ee9e3a72af5223e1d37e47934927bd03385039cf9bf5775":
                      "it was logged by the project's first layout (8747c8e), whose module pipeline.pain_model no "
                      "longer exists: log it again with `make final`"}
# python_function settings a model the project logs has (MLflow 3 writes these for a model from code)
PYFUNC_KEYS = frozenset({"loader_module", "model_code_path", "code", "config", "artifacts", "env", "python_version",
                         "cloudpickle_version", "streamable"})
# files Python imports, loads as extensions or unpickles; the weights (.pt) are read with weights_only=True
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".pyi", ".so", ".dylib", ".dll", ".pth", ".pkl", ".pickle",
                 ".cloudpickle", ".joblib", ".dill", ".egg", ".whl", ".pyz")
ARTIFACT_NAME = re.compile(r"weights(_[1-9][0-9]*)?")


class UntrustedModel(ValueError):
    """A model folder that is not this project's as it logged it: loading it would run code the project does not
    know. The message says what is wrong."""


def check_model_folder(model_dir: str | Path) -> None:
    """Refuse (UntrustedModel, with the reason) a local MLflow model folder that could run code other than the
    installed package's when MLflow loads it; see the module docstring for what is checked."""
    folder = Path(model_dir)
    mlmodel = folder / "MLmodel"
    if not mlmodel.is_file():
        raise UntrustedModel(f"{folder} is not an MLflow model folder (no MLmodel file)")
    try:
        description = yaml.safe_load(mlmodel.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise UntrustedModel(f"its MLmodel file is not YAML ({type(error).__name__})") from None
    flavors = description.get("flavors") if isinstance(description, dict) else None
    if not isinstance(flavors, dict) or set(flavors) != {"python_function"}:
        found = sorted(flavors) if isinstance(flavors, dict) else "none"
        raise UntrustedModel(f"its flavors are {found}, not python_function alone as the project logs it")
    pyfunc = flavors["python_function"]
    if not isinstance(pyfunc, dict):
        raise UntrustedModel("its python_function flavor is not a mapping")
    extra = sorted(set(pyfunc) - PYFUNC_KEYS)
    if extra:
        raise UntrustedModel(f"its python_function flavor has settings the project does not write: {extra}")
    if pyfunc.get("loader_module") != LOADER_MODULE:
        raise UntrustedModel(f"its loader_module is {pyfunc.get('loader_module')!r}, not MLflow's own "
                             f"{LOADER_MODULE!r}")
    if pyfunc.get("code"):
        raise UntrustedModel(f"it names code paths ({pyfunc['code']!r}) that MLflow would put on sys.path")
    check_code_file(folder, pyfunc.get("model_code_path"))
    check_artifacts(folder, pyfunc.get("artifacts"))
    check_no_other_code(folder, Path(str(pyfunc["model_code_path"])).name)


def check_code_file(folder: Path, model_code_path: Any) -> None:
    """The code file MLflow runs (the folder's file of `model_code_path`'s name) is the project's, byte for byte."""
    if not isinstance(model_code_path, str) or not model_code_path:
        raise UntrustedModel("it has no model_code_path: it is not a model from code as the project logs it")
    name = Path(model_code_path).name
    code_file = folder / name
    try:
        mode = os.lstat(code_file).st_mode
    except OSError:
        raise UntrustedModel(f"its code file {name} is missing") from None
    if not stat.S_ISREG(mode):
        raise UntrustedModel(f"its code file {name} is not a regular file (a link, folder or device)")
    digest = file_sha256(code_file)
    if digest == file_sha256(CODE_FILE) or digest in FORMER_CODE_FILES:
        return
    if digest in RETIRED_CODE_FILES:
        raise UntrustedModel(f"its code file {name} is not loaded any more: {RETIRED_CODE_FILES[digest]}")
    raise UntrustedModel(f"its code file {name} differs from the project's (SHA-256 {digest[:16]}..., the installed "
                         f"{CODE_FILE.name} has {file_sha256(CODE_FILE)[:16]}...): it would run code the project does "
                         f"not know")


def check_artifacts(folder: Path, artifacts: Any) -> None:
    """The artifacts are the weights (`weights`, and `weights_<i>` of an ensemble), inside the folder."""
    if not isinstance(artifacts, dict) or "weights" not in artifacts:
        raise UntrustedModel("it has no `weights` artifact")
    root = folder.resolve()
    for name, info in artifacts.items():
        if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
            raise UntrustedModel(f"it has an artifact {name!r}; a pain model has `weights` and `weights_<i>` only")
        relative = info.get("path") if isinstance(info, dict) else None
        if not isinstance(relative, str) or not (folder / relative).resolve().is_relative_to(root):
            raise UntrustedModel(f"its artifact {name!r} does not lie inside the model folder")


def check_no_other_code(folder: Path, code_name: str) -> None:
    """No `code` folder and no file Python could import or unpickle, but the code file itself."""
    if (folder / "code").exists():
        raise UntrustedModel("it holds a `code` folder (modules MLflow would put on sys.path)")
    for path in sorted(folder.rglob("*")):
        if path.name.lower().endswith(CODE_SUFFIXES) and path != folder / code_name:
            raise UntrustedModel(f"it holds {path.relative_to(folder)}, code the project's model does not carry")
