"""What a run trains, read once from its config and passed down as a value (`WhatTrains`): the task, the fine-tuning
strategy, the head and its mode's policy (`head_modes.head_mode`), the embedding cache's augmented views, the output
and the personalisation protocol. The plan, a fold, a trial and the final model each read it once at their entry and
ask it, not the config, whether the strategy allows the mode (`check`), whether `augment.*` is applied, whether the
calls are graded, and what to tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.personalise import PersonaliseConfig, refuse_unapplied
from pipeline.data.tasks import Task
from pipeline.models.finetune import FinetuneConfig
from pipeline.models.ordinal import OutputConfig, graded_scoring
from pipeline.models.temporal_heads import HeadConfig
from pipeline.runs.jobs.head_modes import HeadMode, head_mode
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.runs.store import tracking
from pipeline.runs.store.cv_runs import protocol_tags


@dataclass(frozen=True)
class WhatTrains:
    """What a run trains (see the module docstring); its mode's policy is built once here."""

    task: Task
    finetune: FinetuneConfig
    head: HeadConfig
    cache_views: int  # cache.views: augmented views per crop in the embedding cache (0: the plain embedding)
    output: OutputConfig
    personalise: PersonaliseConfig
    mode: HeadMode

    @classmethod
    def of(cls, training: TrainingSettings) -> WhatTrains:
        """What the training of `training` trains; its head mode's policy built here."""
        return cls(training.task, training.finetune, training.head, training.cache.views, training.output,
                   training.personalise, head_mode(training.head))

    def check(self) -> WhatTrains:
        """Refuse, before anything is planned or built, a head mode the strategy cannot train under, and a
        personalisation protocol where it would not be applied (to anything but a fixed backbone's cached
        embeddings, under a frame head or a two-stage head's clips)."""
        refuse_unapplied(self.personalise, reads_cache=self.finetune.reads_cache)
        self.mode.check(self.finetune)
        return self

    @property
    def graded(self) -> bool:
        """Whether the calls are scored as levels too (`ordinal.graded_scoring`: MAE, kappa, ...)."""
        return bool(graded_scoring(self.task, self.output))

    @property
    def augmentation_applied(self) -> bool:
        """Whether training applies the `augment.*` settings (the mode's answer: not for a frozen head on cached
        embeddings without augmented views, nor for a frozen backbone's two-stage head); the settings stay in the
        run's params, as part of its identity."""
        return self.mode.augmentation(self.finetune, self.cache_views)[0]

    @property
    def augmentation_label(self) -> str:
        """What augmentation training saw, in words: the `augmentation` tag and the fold's and the CV's lines."""
        return self.mode.augmentation(self.finetune, self.cache_views)[1]

    def tags(self) -> dict[str, str]:
        """What trains, as tags: the strategy's label (full, frozen, top_blocks2, lora_r8), whether embeddings fed
        it, and whether the `augment.*` settings (logged as params either way) were applied, in words."""
        return {tracking.FINETUNE_TAG: self.finetune.label,
                tracking.EMBEDDING_CACHE_TAG: str(self.finetune.reads_cache).lower(),
                tracking.AUGMENT_APPLIED_TAG: str(self.augmentation_applied).lower(),
                tracking.AUGMENTATION_TAG: self.augmentation_label}

    def protocol_tags(self) -> dict[str, str]:
        """The output and personalisation protocol as tags (`cv_runs.protocol_tags`)."""
        return protocol_tags(self.output, self.personalise)
