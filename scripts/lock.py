"""`make lock`: write the locks (requirements/) from the working environment.

Three files, one freeze:
- `constraints.txt`: `pip freeze` of an environment whose tests pass, less the project itself and anything pip could
  not install again by name and version (editable or direct-URL installs: refused, so they are fixed rather than
  dropped). Versions, not builds: a torch of the same version built for another CUDA (pytorch.org's cuXYZ indexes)
  satisfies it, so a GPU server with an older driver can keep it (`pip install -c requirements/constraints.txt ...`).
- `lock.txt`: the same versions, each with the SHA-256 of the file this machine's indexes serve for it (pip's own
  resolution report), pip, setuptools and wheel included: what `make install` and CI install, with
  `pip install --require-hashes --no-deps -r requirements/lock.txt` (a file that differs from the one locked is
  refused by pip), then the project itself without dependencies.
- `serving.txt`: the part of `lock.txt` a served model needs (`make serve`, `mlflow models serve`, `make predict`):
  the distributions the served model's code requires (`pipeline.runs.serving.mlflow_model.REQUIREMENTS`, the scoring
  server), closed over their own requirements, with MLflow's skinny distribution in place of the full one (no Jupyter,
  no debugpy, no docker, no UI server); tests/test_lock.py checks that loading and scoring a model imports nothing else.

Refresh after changing a dependency:
    .venv/bin/pip install -U 'package>=x.y'   # or edit pyproject.toml, then `make install`
    make test
    make lock                                 # = .venv/bin/python scripts/lock.py
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = PROJECT_ROOT / "requirements" / "constraints.txt"
HASHED_OUT = PROJECT_ROOT / "requirements" / "lock.txt"
SERVING_OUT = PROJECT_ROOT / "requirements" / "serving.txt"
PROJECT_NAME = "painvit"
BUILD_TOOLS = ("pip", "setuptools", "wheel")  # not in `pip freeze`; the hashed lock installs them too
# What a served model needs besides what its code names (pipeline.runs.serving.mlflow_model.REQUIREMENTS): the scoring
# server `make serve` runs (uvicorn: MLflow's FastAPI app), kept models loaded without initialisation (accelerate), the
# config the serving limits are read from (hydra-core), and what MLflow and the project import on that path when
# installed (pyarrow, attrs, defusedxml): tests/test_lock.py records every distribution loading and scoring imports
SERVING_EXTRA = ("uvicorn", "accelerate", "hydra-core", "pyarrow", "attrs", "defusedxml")
# MLflow's full distribution brings its UI and tracking server (docker, gunicorn, Flask, alembic ...): a served model
# needs only its skinny part, which holds the pyfunc loader and the scoring server
SERVING_SWAPS = {"mlflow": "mlflow-skinny"}
_PINNED = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;#]+)$")


def canonical(name: str) -> str:
    """PEP 503 name: `Pillow`, `pillow` and `PIL_low` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines(freeze: Iterable[str], project: str = PROJECT_NAME) -> list[str]:
    """`name==version` lines of a `pip freeze` output, sorted by name, without `project` or local version labels.

    Comments and blank lines are dropped; an editable (`-e ...`) or direct-URL (`name @ url`) install, other than
    the project itself, is an error naming the line: a constraint must be installable from an index.
    """
    pins: dict[str, str] = {}
    for raw in freeze:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-e ", "--editable")):
            raise ValueError(f"editable install in the environment: {line!r}; install it from an index to lock it")
        name = re.split(r"[\s=@<>!~;\[]", line, maxsplit=1)[0]
        if canonical(name) == canonical(project):
            continue
        match = _PINNED.match(line)
        if match is None:
            raise ValueError(f"cannot lock {line!r}: not a `name==version` install (direct URL or local path?)")
        # a local label (+cu130, +cpu) names a build; the lock keeps the version so any build of it satisfies it
        pins[canonical(match["name"])] = f"{match['name']}=={match['version'].split('+', 1)[0]}"
    return [pins[key] for key in sorted(pins)]


def freeze(python: str) -> list[str]:
    """`pip freeze` of the environment of `python` without the project (pip, setuptools and wheel are left out by
    pip), after `pip check` says its requirements are consistent."""
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the environment is inconsistent, not locking it:\n{check.stdout}{check.stderr}")
    result = subprocess.run([python, "-m", "pip", "freeze", "--exclude", PROJECT_NAME], capture_output=True, text=True,
                            check=True)
    return result.stdout.splitlines()


def header(python: str) -> list[str]:
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return [
        "# The versions `make install` installs (pip's -c): `pip freeze` of an environment whose tests passed.",
        "# Written by `make lock` (scripts/lock.py); do not edit by hand. Versions, not builds: a torch of the same",
        "# version built for another CUDA (pytorch.org's cuXYZ indexes) satisfies it. A constraint only limits what",
        "# is installed: packages another platform does not need (nvidia-*, triton) are not installed there.",
        f"# Locked on Python {version}, {platform.system()} {platform.machine()}.",
    ]


def build_tools(python: str) -> list[str]:
    """`name==version` of pip, setuptools and wheel as installed in the environment of `python` (those present)."""
    code = ("from importlib import metadata\n"
            f"for name in {BUILD_TOOLS!r}:\n"
            "    try: print(f'{name}=={metadata.version(name)}')\n"
            "    except metadata.PackageNotFoundError: pass\n")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def hashed_lines(python: str, pins: Sequence[str]) -> list[str]:
    """Each pin with the SHA-256 of the file pip would install for it here: pip's resolution report of the pins
    alone (`--dry-run --ignore-installed --no-deps --report`), which names the chosen file and its hash."""
    with tempfile.TemporaryDirectory() as tmp:
        requirements, report = Path(tmp) / "pins.txt", Path(tmp) / "report.json"
        requirements.write_text("\n".join(pins) + "\n")
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                        "--report", str(report), "-r", str(requirements)], check=True, capture_output=True)
        chosen = json.loads(report.read_text())["install"]
    hashes = {canonical(item["metadata"]["name"]): (item["metadata"]["version"],
                                                    item["download_info"].get("archive_info", {}).get("hashes", {}))
              for item in chosen}
    lines = []
    for pin in pins:
        name, version = pin.split("==")
        found_version, found = hashes.get(canonical(name), ("", {}))
        if found_version.split("+", 1)[0] != version or "sha256" not in found:
            raise ValueError(f"pip resolved {name}=={version} to {found_version or 'nothing'} without a SHA-256")
        lines.append(f"{pin} \\\n    --hash=sha256:{found['sha256']}")
    return lines


def serving_names(python: str) -> list[str]:
    """The distributions a served model needs in the environment of `python`: the served model's requirements and
    `SERVING_EXTRA`, MLflow swapped for its skinny part, closed over their requirements (markers evaluated here)."""
    code = f"""
import json, re, sys
from importlib import metadata
from packaging.requirements import Requirement
sys.path.insert(0, {str(PROJECT_ROOT)!r})
from pipeline.runs.serving.mlflow_model import REQUIREMENTS
swaps = {SERVING_SWAPS!r}
todo = [(swaps.get(name, name), "") for name in (*REQUIREMENTS, *{SERVING_EXTRA!r})]
seen, names = set(), set()
while todo:
    name, extra = todo.pop()
    name = re.sub(r"[-_.]+", "-", name).lower()
    if (name, extra) in seen:
        continue
    seen.add((name, extra))
    names.add(name)
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({{"extra": extra}}):
            wanted = swaps.get(requirement.name, requirement.name)
            todo += [(wanted, "")] + [(wanted, each) for each in requirement.extras]
print(json.dumps(sorted(names)))
"""
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def write_lock(lines: Sequence[str], out: Path, head: Sequence[str]) -> None:
    from pipeline.utils.atomic_io import atomic_write_text

    atomic_write_text(out, "\n".join([*head, *lines]) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--hashed-out", type=Path, default=HASHED_OUT, help=f"default: {HASHED_OUT}")
    parser.add_argument("--serving-out", type=Path, default=SERVING_OUT, help=f"default: {SERVING_OUT}")
    args = parser.parse_args(argv)
    try:
        lines = lock_lines(freeze(args.python))
        tools = build_tools(args.python)
        hashed = dict(zip([*lines, *tools], hashed_lines(args.python, [*lines, *tools]), strict=True))
    except (ValueError, subprocess.CalledProcessError) as error:
        raise SystemExit(f"lock: {error}") from None
    serving = set(serving_names(args.python))
    write_lock(lines, args.out, header(args.python))
    write_lock([hashed[pin] for pin in sorted(hashed, key=canonical)], args.hashed_out, hashed_header(args.python))
    served = [hashed[pin] for pin in sorted(hashed, key=canonical) if canonical(pin.split("==")[0]) in serving]
    missing = serving - {canonical(pin.split("==")[0]) for pin in hashed}
    if missing:
        raise SystemExit(f"lock: a served model needs {sorted(missing)}, which the environment does not hold")
    write_lock(served, args.serving_out, serving_header(args.python))
    print(f"wrote {args.out}: {len(lines)} pinned packages; {args.hashed_out}: {len(hashed)} with their SHA-256; "
          f"{args.serving_out}: the {len(served)} a served model needs")
    return 0


def hashed_header(python: str) -> list[str]:
    return ["# What `make install` (and CI) installs: "
            "`pip install --require-hashes --no-deps -r requirements/lock.txt`,",
            "# then the project with --no-deps. The versions of constraints.txt, each with the SHA-256 of the file",
            "# this machine's indexes serve for it; pip refuses any other file. Written by `make lock`; not by hand.",
            *header(python)[-1:]]


def serving_header(python: str) -> list[str]:
    return ["# What a served model needs (make serve, mlflow models serve, make predict), hashed as lock.txt: install",
            "# with `pip install --require-hashes --no-deps -r requirements/serving.txt`, then `pip install --no-deps`",
            "# the project. MLflow's skinny distribution, no Jupyter, debugpy or docker. Written by `make lock`.",
            *header(python)[-1:]]


if __name__ == "__main__":
    sys.exit(main())
