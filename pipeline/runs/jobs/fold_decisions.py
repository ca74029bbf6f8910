"""What a cross-validation decides once for every fold, and what the device a fold trains on decides.

`plan_decisions` resolves, once in the plan, what is the same on every machine: the fold file, the backbone family
and the weights source; they travel in every `FoldJob` as `FoldDecisions`. A fold job uses them as given and only
checks that it can honour them (`DecisionNotHonoured` otherwise). What depends on the device (precision,
channels-last) the fold job resolves on the device it trains on (`settings_on_device`, `settings_here`), within what
the plan allows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.models.backbone_adapter import family_traits
from pipeline.models.backbones import model_family, weights_source
from pipeline.models.weights import WeightsSource
from pipeline.runs.jobs.training_settings import TrainingSettings
from pipeline.utils.accelerator import TrainingDevice, training_device
from pipeline.utils.devices import DeviceSettings, device_settings
from pipeline.utils.paths import resolve_path


@dataclass(frozen=True)
class FoldDecisions:
    """What the plan decides once for every fold of a cross-validation. A fold job uses it as given: on a SLURM node
    it only checks that it can honour it (the same weights file, the same backbone family) and fails loudly if not.
    What depends on the device (precision, channels_last) is not decided here but by the fold job on the device it
    trains on (`settings_on_device`), within what the plan allows."""

    fold_file: str  # the checked fold file, absolute
    precision: str  # trainer.precision as asked: `auto` (each fold resolves it on its device) or an explicit value
    model_family: str  # the backbone adapter's family (pipeline.models.backbone_adapter.FAMILIES)
    weights: dict[str, str | None]  # where the initial weights come from: WeightsSource's kind, ref, sha256

    @property
    def weights_source(self) -> WeightsSource:
        return WeightsSource(**self.weights)


def plan_decisions(training: TrainingSettings, fold_file: Path) -> FoldDecisions:
    """Resolve the fold file, the backbone family and the weights source of a training, once; carry the precision as
    asked (the fold job resolves `auto` on its device).

    A missing weights file or hub cache entry fails here, in seconds, not in the first fold.
    """
    family = model_family(training.model_name, training.img_size)
    weights = weights_source(training.model_name, training.pretrained, training.weights)
    return FoldDecisions(str(resolve_path(fold_file)), str(training.trainer.precision), family, asdict(weights))


def settings_on_device(decisions: FoldDecisions, channels_last: bool | str, device_kind: str) -> DeviceSettings:
    """Precision and channels_last (`trainer.channels_last` as asked) for a fold training on a `device_kind`
    device: `auto` resolved from that device's facts, an explicit value honoured; an error if the result is not one
    the plan allows."""
    try:
        return device_settings(decisions.precision, channels_last, family_traits(decisions.model_family), device_kind)
    except ValueError as error:
        raise DecisionNotHonoured(str(error)) from error


def settings_here(decisions: FoldDecisions, channels_last: bool | str, accelerator: str,
                  device: TrainingDevice | None = None) -> DeviceSettings:
    """`settings_on_device` for the device this process trains on (`trainer.accelerator`)."""
    device = device or training_device(accelerator)
    return settings_on_device(decisions, channels_last, device.kind)


class DecisionNotHonoured(RuntimeError):
    """A fold job cannot do what its plan decided (other weights on this node, another backbone family)."""
