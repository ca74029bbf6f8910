"""When whole participants have no crops: the committed fold files stay strict, the stop names the way on, and the
`<set>_usable` subject set writes its own versioned fold file with the excluded participants and the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipeline.data.biovid_folds import biovid_subjects
from pipeline.data.fold_files import fold_file_sha256, read_fold_parameters, read_folds
from pipeline.data.prepare import DataSettings, ensure_folds, exclusion_reasons
from pipeline.runs.store.cv_runs import subject_set_tags
from pipeline.utils.config import load_config

FAILED = ["071309_w_21", "082315_w_60"]  # one responder, one non-responder


def _biovid_data(tmp_path: Path, *extra: str) -> DataSettings:
    return DataSettings.from_config(load_config(["data=biovid", f"data.root={tmp_path}",
                                                 f"data.processed_dir={tmp_path / 'processed'}", *extra]))


def test_a_committed_fold_file_stops_and_names_the_usable_set(tmp_path):
    data = _biovid_data(tmp_path)
    with_crops = sorted(set(biovid_subjects("all87")) - set(FAILED))
    with pytest.raises(SystemExit) as stop:
        ensure_folds(data, with_crops)
    message = str(stop.value)
    assert "2 subject(s) of the fold file have no usable videos: 071309_w_21, 082315_w_60" in message
    assert "data.subject_set=all87_usable" in message
    assert f"data.manifest_dir={tmp_path / 'processed'}/manifests" in message
    # the usable set is not written into the committed folder
    with pytest.raises(SystemExit, match="not committed: point data.manifest_dir"):
        ensure_folds(_biovid_data(tmp_path, "data.subject_set=all87_usable"), with_crops)


def test_the_usable_set_writes_its_fold_file_once_with_the_exclusions(tmp_path):
    manifests = tmp_path / "manifests"
    data = _biovid_data(tmp_path, "data.subject_set=responders67_usable", f"data.manifest_dir={manifests}")
    with_crops = sorted(set(biovid_subjects("all87")) - set(FAILED))
    reasons = {"071309_w_21": "all 20 video(s) failed: no face detected in any of the 8 sampled frames (20)"}
    path = ensure_folds(data, with_crops, reasons)
    assert path == manifests / "kfold5_responders67_usable.csv"
    folds = read_folds(path)
    assert set(folds.subject_name) == set(biovid_subjects("responders67")) - {"071309_w_21"}  # 66 participants
    recorded = read_fold_parameters(path)
    assert recorded["excluded_subjects"] == {"071309_w_21": reasons["071309_w_21"]}  # only those of the base set
    assert recorded["n_subjects"] == 66 and recorded["protocol"] == "kfold5"
    committed = Path("data_manifests/biovid/kfold5_responders67.csv")
    assert fold_file_sha256(path) != fold_file_sha256(committed)  # `make compare` never mixes them
    tags = subject_set_tags(path)
    assert tags == {"n_excluded_subjects": "1", "excluded_subjects": "071309_w_21",
                    "excluded_subjects_reasons": f"071309_w_21: {reasons['071309_w_21']}"}
    assert subject_set_tags(committed)["n_excluded_subjects"] == "0"

    # written once: a later run reads it, even when the participant has crops again ...
    before = path.read_bytes()
    assert ensure_folds(data, sorted(biovid_subjects("all87"))) == path and path.read_bytes() == before
    # ... and a participant of the file who loses its crops stops the run, saying how to rewrite the file
    with pytest.raises(SystemExit, match="delete it and its .json sidecar"):
        ensure_folds(data, sorted(set(with_crops) - {"071313_m_41"}))


def test_exclusion_reasons_count_the_failures(tmp_path):
    samples = pd.DataFrame({"subject_name": ["a", "a", "a", "b"]})
    failures = pd.DataFrame({"subject_name": ["a", "a", "a"], "reason": ["no face", "no face", "unreadable"]})
    reasons = exclusion_reasons(["a", "c"], samples, failures)
    assert reasons == {"a": "all 3 video(s) failed: no face (2); unreadable (1)",
                       "c": "no video of this participant is listed in samples.csv and present on disk"}
    assert json.loads(json.dumps(reasons)) == reasons
