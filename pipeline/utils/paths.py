"""Where the project is, and how a path from the config is read: relative to the project root, from any folder."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str | Path) -> Path:
    """Relative paths in the config are relative to the project root, so commands work from any folder."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else (PROJECT_ROOT / path).resolve()
