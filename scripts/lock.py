"""`make lock`: write the constraints file (requirements/constraints.txt) from the working environment.

The lock is what `make install` (and so CI) installs: `pip install -c requirements/constraints.txt -e '.[...]'`.
It is `pip freeze` of an environment whose tests pass, less the project itself and anything pip could not install
again by name and version (editable or direct-URL installs: refused, so they are fixed rather than dropped).

A lock pins versions, not builds: a torch build for another CUDA version (`torch==2.14.1` installed from the
pytorch.org index of a cuXYZ build) satisfies it, so a GPU server with an older driver can keep it.

Refresh after changing a dependency:
    .venv/bin/pip install -U 'package>=x.y'   # or edit pyproject.toml, then `make install`
    make test
    make lock                                 # = .venv/bin/python scripts/lock.py
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = PROJECT_ROOT / "requirements" / "constraints.txt"
PROJECT_NAME = "painvit"
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


def write_lock(lines: Sequence[str], out: Path, head: Sequence[str]) -> None:
    from pipeline.utils.atomic_io import atomic_write_text

    atomic_write_text(out, "\n".join([*head, *lines]) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    try:
        lines = lock_lines(freeze(args.python))
    except ValueError as error:
        raise SystemExit(f"lock: {error}") from None
    write_lock(lines, args.out, header(args.python))
    print(f"wrote {args.out}: {len(lines)} pinned packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
