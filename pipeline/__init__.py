"""Fine-tuning pipeline for automatic pain detection from facial video (BioVid Heat Pain Database, Part A)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

__version__ = "0.1.0"
