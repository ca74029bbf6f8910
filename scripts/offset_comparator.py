"""A baseline CV against the plain CV given the same k references as a per-person score offset (issue 43, item 5b).

Reads two finished CVs of one binary task from the project's run store: a plain one and a `personalise=baseline` one
(its k and seed say which BL1 videos are each person's references). The plain CV's stored validation and test
videos are offset by the person's mean reference score, a threshold is chosen on the validation offsets by the CV's
own rule, and the three (plain, baseline_k<k>, plain_offset_k<k>) are paired on the videos all three tested by
`make compare`'s subject-level statistics (pipeline/analysis/score_offset.py). Prints the intervals and the paired
differences, and writes them as CSV beside a JSON of what was compared.

Run (the two CVs' parent run ids, as `make cv` prints them or the UI shows):
    .venv/bin/python scripts/offset_comparator.py --plain <run id> --baseline <run id> --out reports/offset
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from mlflow import MlflowClient

    from pipeline.analysis.score_offset import compare_with_offset
    from pipeline.runs.store import tracking

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", required=True, help="the plain CV's parent run id")
    parser.add_argument("--baseline", required=True, help="the baseline CV's parent run id (personalise=baseline)")
    parser.add_argument("--tracking-uri", default=None, help="the run store (default: the project's)")
    parser.add_argument("--out", type=Path, required=True, help="folder for intervals.csv, paired.csv, videos.csv")
    args = parser.parse_args()
    client = MlflowClient(tracking.store_uri(args.tracking_uri))
    plain, baseline = client.get_run(args.plain), client.get_run(args.baseline)
    tables = compare_with_offset(client, plain, baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(args.out / f"{name}.csv", index=False)
    (args.out / "compared.json").write_text(json.dumps(
        {"plain": args.plain, "baseline": args.baseline, "dataset": plain.data.tags.get("dataset"),
         "task": plain.data.tags.get("task"), "k": baseline.data.params.get("personalise.k"),
         "seed": baseline.data.params.get("personalise.seed")}, indent=2))
    with_columns = ["model", "metric", "value", "ci95_low", "ci95_high", "n_subjects"]
    print(tables["videos"].to_string(index=False))
    print(tables["intervals"][with_columns].to_string(index=False, float_format="%.3f"))
    paired = ["metric", "model_a", "model_b", "mean_diff", "diff_ci95_low", "diff_ci95_high", "p_value", "p_holm",
              "mde80"]
    print(tables["paired"][paired].to_string(index=False, float_format="%.3f"))


if __name__ == "__main__":
    main()
