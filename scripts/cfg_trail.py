"""How far a config travels through `make cv`: the pipeline/ files whose functions are called with it (issue 35).

Runs the test suite's tiny twin (tests/conftest.py) through `run_cv` (one fold of MobileViT-XXS, one epoch) under
`sys.setprofile`, and records every call of a function of `pipeline/` that receives an OmegaConf config (a
`DictConfig` among its arguments: the composed config, or a group of it such as `cfg.model`). It prints the number of
distinct files those calls are in, the number of stops (consecutive calls in another file than the one before) and,
per file, its calls. Data preparation (`make data`) is not counted: it runs before the trace starts.

Run:
    PYTHONPATH=. .venv/bin/python scripts/cfg_trail.py [--variant frame|two_stage|frozen] [--list]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.cv_metrics import FAST, VARIANTS  # noqa: E402

PACKAGE = str(ROOT / "pipeline")


def trail(work: Path, variant: str) -> list[tuple[str, str]]:
    """(file, function) of every call with a config argument, in order."""
    from omegaconf import DictConfig

    from pipeline.data.prepare import DataSettings, prepare_data
    from pipeline.runs.orchestration.cross_validation import run_cv
    from pipeline.utils.config import load_config
    from tests.conftest import tiny_overrides

    prepare_data(DataSettings.from_config(load_config(tiny_overrides(work))), progress=False)
    cfg = load_config(tiny_overrides(work, *FAST, *VARIANTS[variant], "trainer.folds=[0]", "trainer.max_epochs=1"))
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(name), DictConfig) for name in names):
            calls.append((str(Path(code.co_filename).relative_to(ROOT)), code.co_name))

    sys.setprofile(profile)
    try:
        run_cv(cfg)
    finally:
        sys.setprofile(None)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="frame")
    parser.add_argument("--list", action="store_true", help="also print every file's calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        calls = trail(Path(work), args.variant)
    files = [file for file, _ in calls]
    stops = sum(1 for before, after in zip([None, *files], files, strict=False) if before != after)
    returns = stops - len(set(files))
    print(f"{len(set(files))} files, {stops} stops ({returns} of them returns to a file already left), "
          f"{len(calls)} calls with a config")
    if args.list:
        for file, count in Counter(files).most_common():
            functions = sorted({name for f, name in calls if f == file})
            print(f"{count:5d}  {file}: {', '.join(functions)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
