"""One fold's result, from its fit to the cross-validation's aggregate: one type that each step fills in.

A fit (a Lightning fit, `pipeline.runs.jobs.fold_fit.fit_fold`, or in memory, `pipeline.models.probe_training.
fit_probe`) records its epochs, what it selected and the kept network's scores on the splits it was asked to score;
a second stage (`pipeline.runs.jobs.two_stage.second_stage`) puts its head's selection and scores in their place and
keeps the fit's test scores as `frame_model_metrics`; `pipeline.runs.jobs.fold_job.train_fold` adds the test metrics
at the fold's threshold and the decided test videos; a cross-validation reads a finished fold back from its run
(`pipeline.runs.jobs.fold_run.result_from_run`: metrics and prediction tables only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
from torch import nn

from pipeline.evaluation.metrics import Evaluation


@dataclass
class FoldResult:
    """A fold's training and test scores, as far as they are known (see the module docstring)."""

    fold: int
    metrics: dict[str, float] = field(default_factory=dict)  # the fold run's: test/<level>_<metric>, the selection
    frame_predictions: pd.DataFrame | None = None  # the kept network's test predictions (per crop; per video: clips)
    video_predictions: pd.DataFrame | None = None  # the test videos with the fold's decisions
    seconds: float = 0.0
    run_id: str = ""
    seed: int | None = None  # the training seed of a CV over several seeds (cv.seeds)
    # what was selected: the epoch, how many trained, its validation score (a second stage's head's, two-stage)
    best_epoch: int = -1
    epochs_trained: int = 0
    best_score: float = math.nan
    # what a training in this process kept (a result read back from its run has none of it)
    history: list[dict] = field(default_factory=list)  # the fitted network's epochs ([]: no fit)
    best_path: str | None = None  # the fit's best checkpoint (None: in memory, or no fit)
    validation: Evaluation | None = None  # the kept network on the validation subjects: what a threshold is chosen on
    evaluation: Evaluation | None = None  # the kept network on the test subjects
    frame_model_metrics: dict[str, float] = field(default_factory=dict)  # a two-stage head's frame model on the test
    head: nn.Module | None = None  # a second stage's clip model: the fold's frame backbone and its trained head
    head_history: list[dict] = field(default_factory=list)  # a second stage's epochs
    record: dict = field(default_factory=dict)  # a second stage's two_stage.json

    @property
    def selected(self) -> dict[str, float]:
        """What was selected, as the fold run's metrics name it."""
        return {"best_epoch": self.best_epoch, "epochs_trained": self.epochs_trained,
                "best_val_score": self.best_score}

    @property
    def held_out(self) -> Evaluation:
        """The evaluation a threshold is chosen on: the validation's, or where only the test split was scored (a
        final model, whose test split is its validation subjects) the test's."""
        chosen = self.validation if self.validation is not None else self.evaluation
        assert chosen is not None, "the training scored neither split"
        return chosen
