"""The comparator a baseline protocol must beat (issue 43, item 5b): a plain model given the same k references as a
per-person score offset.

`personalise=baseline` shows the head each crop's embedding minus the mean of k of the person's BL1 videos. Its gain
over a plain model mixes two things: knowing the person's resting level at all, and using it inside the embedding.
The fair comparator knows the same: the plain CV's own video scores, each minus the mean score of the person's k
reference BL1 videos, the very videos the baseline CV took (`personalise.select_baseline` with the same k and seed,
on the person's videos of the split, as the baseline CV draws them), and those references removed from its test set.
A threshold is then chosen on the validation people's offset scores by the CV's own rule (`eval.threshold`) and
applied to the test people's, fold by fold, as every CV decides.

An offset score s - m lies in [-1, 1]; it is carried in the `prob_<pain class>` column as (1 + s - m) / 2, which keeps
its order (the threshold rules and the AUROCs read only the order, `logit_midpoint` its own scale) and makes the
video table one that `make compare`'s statistics read as any CV's (`offset_cv`). Binary tasks only: on five classes
a score offset has no single score to shift.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run

from pipeline.analysis.comparison_runs import POOLED_VIDEOS, pooled_videos
from pipeline.analysis.comparison_statistics import subject_tables
from pipeline.data.personalise import VIDEO_KEYS, label_free_rows, select_baseline
from pipeline.data.tasks import get_task
from pipeline.evaluation.statistics import common_videos
from pipeline.evaluation.thresholds import FoldDecision, decide_fold, parse_rule
from pipeline.runs.jobs.fold_job import VAL_VIDEO_PREDICTIONS
from pipeline.runs.jobs.sealing import VIDEO_PREDICTIONS
from pipeline.runs.store import tracking


def offset_label(k: int) -> str:
    """How tables name the comparator: `plain_offset_k2`."""
    return f"plain_offset_k{k}"


def _check_binary(class_names: Sequence[str]) -> None:
    if len(class_names) != 2:
        raise ValueError(f"a score offset shifts one pain score a video: a binary task only, not the classes "
                         f"{', '.join(class_names)}")


def reference_videos(videos: pd.DataFrame, class_names: Sequence[str], k: int, seed: int) -> np.ndarray:
    """Which rows of a video table (one row per video: subject_name, sample_name, label) are their person's k
    reference BL1 videos: `select_baseline` on the rows without their labels and the BL1 mask, so the same videos a
    baseline CV with this k and seed takes from these people's rows."""
    named = videos[VIDEO_KEYS].assign(class_name=np.asarray(class_names)[videos["label"].to_numpy(dtype=int)])
    free, is_bl1 = label_free_rows(named)
    split = select_baseline(free, is_bl1, k, seed)
    return videos.index.isin(split.reference.index)


def offset_videos(videos: pd.DataFrame, reference: np.ndarray, class_names: Sequence[str]) -> pd.DataFrame:
    """The videos that are not references, each pain score minus its person's mean reference score, carried as
    (1 + s - m) / 2 in `prob_<pain>` (and 1 minus it in `prob_<no pain>`); the plain score stays as `plain_score`.
    A person without a reference video is an error that names them."""
    _check_binary(class_names)
    reference = np.asarray(reference, dtype=bool)
    if reference.shape != (len(videos),):
        raise ValueError(f"the reference mask has shape {reference.shape}, the video table {len(videos)} rows")
    no_pain, pain = (f"prob_{name}" for name in class_names)
    means = videos[reference].groupby("subject_name")[pain].mean()
    remaining = videos[~reference].copy()
    without = sorted(set(remaining["subject_name"]) - set(means.index))
    if without:
        raise ValueError(f"no reference video for {', '.join(map(str, without))}: a score offset needs one")
    offset = remaining[pain].to_numpy(dtype=float) - means.loc[remaining["subject_name"]].to_numpy()
    remaining["plain_score"] = remaining[pain]
    remaining[pain] = (1.0 + offset) / 2.0
    remaining[no_pain] = 1.0 - remaining[pain]
    remaining["pred"] = (remaining[pain] > 0.5).astype(int)
    return remaining.reset_index(drop=True)


def offset_fold(val_videos: pd.DataFrame, test_videos: pd.DataFrame, class_names: Sequence[str], k: int, seed: int,
                rule: str | float) -> FoldDecision:
    """One fold of the comparator: validation and test people's references drawn from their own videos, their
    scores offset, a threshold chosen by `rule` on the validation offsets (`thresholds.decide_fold`) and applied to
    the test offsets."""
    val = offset_videos(val_videos, reference_videos(val_videos, class_names, k, seed), class_names)
    test = offset_videos(test_videos, reference_videos(test_videos, class_names, k, seed), class_names)
    return decide_fold(val, test, class_names, rule)


def _fold_table(client: MlflowClient, run: Run, name: str) -> pd.DataFrame:
    return pd.read_csv(client.download_artifacts(run.info.run_id, name))


def offset_cv(client: MlflowClient, plain: Run, k: int, seed: int) -> pd.DataFrame:
    """A plain CV's pooled test videos as the comparator calls them: every finished fold's stored validation and
    test videos (`predictions_videos_val.csv`, `predictions_videos.csv`) through `offset_fold` at the CV's own
    threshold rule; the references left out. A fold column, a `decision` per video, as `make compare` pools a CV."""
    class_names = get_task(plain.data.tags[tracking.TASK_TAG]).classes
    _check_binary(class_names)
    rule = parse_rule(plain.data.params["eval.threshold"])
    folds = tracking.finished_fold_runs(client, plain.info.run_id)
    if not folds:
        raise ValueError(f"CV {plain.info.run_id} has no finished fold run to offset")
    parts = []
    for fold, run in sorted(folds.items()):
        decided = offset_fold(_fold_table(client, run, VAL_VIDEO_PREDICTIONS),
                              _fold_table(client, run, VIDEO_PREDICTIONS), class_names, k, seed, rule)
        parts.append(decided.videos.assign(fold=fold))
    return pd.concat(parts, ignore_index=True)


def compare_with_offset(client: MlflowClient, plain: Run, baseline: Run) -> dict[str, pd.DataFrame]:
    """A baseline CV, the plain CV it was trained beside, and the plain CV given the baseline's references as a
    score offset (its k and seed read from the baseline CV), paired on the videos all three tested (the references
    left out of each) by `make compare`'s subject-level statistics: `intervals` (each metric per CV, with its
    subject-bootstrap interval), `paired` (each pair's difference, interval, permutation p, Holm, mde80) and
    `videos` (what each tested and dropped)."""
    params = baseline.data.params
    if params.get("personalise.mode") != "baseline":
        raise ValueError(f"CV {baseline.info.run_id} is not a baseline CV (personalise.mode="
                         f"{params.get('personalise.mode')!r})")
    k, seed = int(params["personalise.k"]), int(params["personalise.seed"])
    tables = {label: pooled_videos(client, run) for label, run in (("plain", plain), (f"baseline_k{k}", baseline))}
    missing = [label for label, table in tables.items() if table is None]
    if missing:
        raise ValueError(f"no pooled test videos ({POOLED_VIDEOS}) on the CV(s) {', '.join(missing)}")
    tables[offset_label(k)] = offset_cv(client, plain, k, seed)
    common, record = common_videos(tables)
    intervals, _, paired = subject_tables(common)
    return {"intervals": intervals, "paired": paired, "videos": record}
