"""Classification tasks over BioVid's five classes: which classes take part, and the label each one gets."""

from __future__ import annotations

from dataclasses import dataclass

CLASS_NAMES: tuple[str, ...] = ("BL1", "PA1", "PA2", "PA3", "PA4")
NO_PAIN = CLASS_NAMES[0]  # baseline, no heat: a video's pain probability is 1 - P(NO_PAIN)


def no_pain_index(class_names) -> int:
    """The position of NO_PAIN among a model's classes (0 where it has none, e.g. a PA1-vs-PA4 model)."""
    names = list(class_names)
    return names.index(NO_PAIN) if NO_PAIN in names else 0


@dataclass(frozen=True)
class Task:
    """A task keeps the samples of `classes`; the i-th class gets label i."""

    name: str
    classes: tuple[str, ...]

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    @property
    def is_binary(self) -> bool:
        return self.n_classes == 2

    def label_map(self) -> dict[str, int]:
        return {name: label for label, name in enumerate(self.classes)}


TASKS: dict[str, Task] = {
    "bl1_vs_pa1": Task("bl1_vs_pa1", ("BL1", "PA1")),
    "bl1_vs_pa2": Task("bl1_vs_pa2", ("BL1", "PA2")),
    "bl1_vs_pa3": Task("bl1_vs_pa3", ("BL1", "PA3")),
    "bl1_vs_pa4": Task("bl1_vs_pa4", ("BL1", "PA4")),
    "five_class": Task("five_class", CLASS_NAMES),
}


def graded_levels(task: Task) -> tuple[int, ...]:
    """The intensity level (BL1 = 0 .. PA4 = 4, the place in CLASS_NAMES) of each of `task`'s classes, in label order:
    a task is graded when its classes are BioVid's levels in increasing order (five_class, BL1 vs PA4, PA1..PA4), so
    that label order is intensity order and an ordinal or regression output can take its labels as levels. Any other
    task is refused, naming its classes."""
    unknown = [name for name in task.classes if name not in CLASS_NAMES]
    if unknown:
        raise ValueError(f"task {task.name!r} is not graded: its classes {', '.join(unknown)} are not BioVid levels "
                         f"({' < '.join(CLASS_NAMES)})")
    levels = tuple(CLASS_NAMES.index(name) for name in task.classes)
    if len(levels) < 2 or levels != tuple(sorted(set(levels))):  # strictly increasing
        raise ValueError(f"task {task.name!r} is not graded: its classes {', '.join(task.classes)} are not BioVid "
                         f"levels in increasing order ({' < '.join(CLASS_NAMES)})")
    return levels


def get_task(name: str) -> Task:
    """Look a task up by name, with an error that lists the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None
