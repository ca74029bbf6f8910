"""A mistake on the command line is answered in one line that names the fix, with exit status 2 and no traceback
(issue 45, item 1): typed through `make` as a user types it, at most three lines in all with make's own (the echoed
recipe, the answer, make's `Error 2`). Every kind once through make; every group's options through `load_config`."""

from __future__ import annotations

import os
import subprocess

import pytest

from pipeline.utils.config import load_config
from pipeline.utils.config_checks import UsageError
from pipeline.utils.paths import PROJECT_ROOT
from tests.test_makefile import MAKE, PARENT_MAKE

# (make's words, what the answer must say): one of each kind of mistake
MISTAKES = {
    "unknown_key": (["cv", "ARGS=trainer.max_epoch=3"], ["trainer.max_epoch", "did you mean trainer.max_epochs=3"]),
    "unknown_option": (["cv", "TASK=bl1_vs_pa9"], ["TASK=bl1_vs_pa9", "bl1_vs_pa1", "bl1_vs_pa4", "five_class"]),
    "unknown_model": (["cv", "MODEL=vit_b17"], ["MODEL=vit_b17", "no configs/model/vit_b17.yaml",
                                               "no timm model", "nearest: vit_b16"]),
    "group_as_key": (["cv", "ARGS=model.output=ordinal"], ["model/output is a group: write model/output=ordinal"]),
    "wrong_type": (["cv", "ARGS=trainer.max_epochs=abc"], ["trainer.max_epochs=abc: expected a number"]),
    "missing_biovid_root": (["cv", "DATA=biovid"], ["BIOVID_ROOT is not set", "BIOVID_ROOT=/"]),
    "missing_video": (["predict"], ["VIDEO is not set", "make predict VIDEO=path/to/clip.mp4"]),
}


def make(*words: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`make <words>` as a user at a shell runs it (no enclosing make), stdout and stderr as one stream."""
    clean = {k: v for k, v in os.environ.items() if k not in PARENT_MAKE and k not in ("VERBOSE", "BIOVID_ROOT")}
    return subprocess.run([*MAKE, *words], cwd=PROJECT_ROOT, env={**clean, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.mark.parametrize("kind", MISTAKES)
def test_a_mistake_through_make_is_answered_in_one_line_with_exit_2(kind: str) -> None:
    words, said = MISTAKES[kind]
    done = make(*words)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 2, done.stdout
    assert len(lines) <= 3 and "Traceback" not in done.stdout, done.stdout
    assert lines[-1].startswith("make: *** [Makefile:") and lines[-1].endswith("Error 2"), lines
    answer = lines[-2]
    assert answer.startswith(f"{words[0]}: "), answer
    for part in said:
        assert part in answer, (part, answer)


def test_verbose_shows_the_traceback_beside_the_line() -> None:
    done = make("cv", "ARGS=trainer.max_epoch=3", env={"VERBOSE": "1"})
    assert done.returncode == 2
    assert "Traceback (most recent call last)" in done.stdout and "UsageError" in done.stdout
    assert "cv: trainer.max_epoch is not a configuration key" in done.stdout


@pytest.mark.parametrize(("override", "said"), [
    ("data=synth", ["DATA=synth", "biovid, synthetic, synthetic87"]),
    ("protocol=loso5", ["PROTOCOL=loso5", "holdout, kfold10, kfold5, loso"]),
    ("launcher=slurmm", ["LAUNCHER=slurmm", "local, parallel, slurm"]),
    ("model/output=coral", ["model/output=coral", "ordinal, regression, softmax"]),
    ("personalise=baselines", ["personalise=baselines", "baseline, none, subject_normalised"]),
    ("personalise.k=2", ["personalise.k is a key of personalise=baseline", "personalise=baseline personalise.k=2"]),
    ("max_epochs=3", ["did you mean trainer.max_epochs=3"]),
    ("model.optim=3", ["model.optim is a section of keys", "model.optim.head_lr="]),
    ("trainer.folds=3,4", ["one value per key", "trainer.folds=[3,4]"]),
    ("trainer.deterministic=maybe", ["expected true or false"]),
    ("trainer.max_epochs", ["is not a key=value setting"]),
    ("~seed", ["removing a key is not allowed"]),
])
def test_every_group_lists_its_options_and_every_key_mistake_names_the_fix(override: str, said: list[str]) -> None:
    with pytest.raises(UsageError) as error:
        load_config([override])
    assert "\n" not in str(error.value)
    for part in said:
        assert part in str(error.value), (part, str(error.value))


@pytest.mark.parametrize("overrides", [
    ["model.optim.head_lr=3e-4", "loader.crop_fraction=1"],  # an int where the default is a float
    ["trainer.folds=[0,1]", "data.loader.frames_per_video=null"],  # a list where the default is null; null anywhere
    ["eval.threshold=0.5", "model.pretrained=false"],  # a number for a text key; a switch for an interpolated one
    ["data=biovid", "data.pretrained=auto"],  # a switch's third state
    ["model/output=ordinal", "model.output.ordinal=corn", "personalise=baseline", "personalise.k=2"],
])
def test_what_the_configs_allow_is_still_allowed(overrides: list[str]) -> None:
    load_config(overrides)
