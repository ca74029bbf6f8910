"""Fine-tuning pipeline for automatic pain detection from facial video (BioVid Heat Pain Database, Part A)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: str | Path) -> Path:
    """Relative paths in the config are relative to the project root, so commands work from any folder."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else (PROJECT_ROOT / path).resolve()


__version__ = "0.1.0"
