"""Fold files: generated folds never leak a subject, corrupted files fail loudly, committed manifests cannot drift."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.biovid_folds import (
    BIOVID_MANIFEST_DIR,
    BIOVID_PROTOCOLS,
    BIOVID_SUBJECTS_CSV,
    SUBJECT_SETS,
    biovid_fold_parameters,
    biovid_manifest_path,
    biovid_subjects,
    main,
)
from pipeline.data.fold_checks import ROLES, FoldError, check_folds
from pipeline.data.fold_files import (
    check_fold_parameters,
    fold_file_sha256,
    fold_parameters,
    fold_subjects,
    make_folds,
    parameters_path,
    protocol_spec,
    read_fold_parameters,
    read_folds,
    subject_strata,
    usable_strata,
    write_folds,
)
from pipeline.data.prepare import DataSettings, ensure_folds
from pipeline.utils.config import load_config
from tests.conftest import tiny_overrides

# The 20 participants without a facial response (public BioVid practice, /work/shared/biovid.md).
NON_RESPONDERS = """082315_w_60 082414_m_64 082909_m_47 083009_w_42 083013_w_47 083109_m_60 083114_w_55 091914_m_46
092009_m_54 092014_m_56 092509_w_51 092714_m_64 100514_w_51 100914_m_39 101114_w_37 101209_w_61 101809_m_59
101916_m_40 111313_m_64 120614_w_61""".split()


# --- make_folds: properties ------------------------------------------------------------------------------------------


@st.composite
def fold_requests(draw):
    n = draw(st.integers(3, 60))
    kind = draw(st.sampled_from(["loso", "kfold", "holdout"]))
    protocol = f"kfold{draw(st.integers(2, min(10, n)))}" if kind == "kfold" else kind
    subjects = [f"{i:06d}_{'wm'[i % 2]}_{20 + i}" for i in range(n)]
    labels = draw(st.none() | st.lists(st.sampled_from(["a/x", "a/y", "b/x", "b/y", "c"]), min_size=n, max_size=n))
    return {
        "subjects": subjects,
        "protocol": protocol,
        "seed": draw(st.integers(0, 2**32 - 1)),
        "val_fraction": draw(st.floats(0.05, 0.6)),
        "test_fraction": draw(st.floats(0.1, 0.5)),
        "strata": None if labels is None else dict(zip(subjects, labels, strict=True)),
    }


@settings(max_examples=50, deadline=None)
@given(request=fold_requests())
def test_make_folds_never_leaks_and_tests_every_subject_once(request):
    subjects, protocol = request["subjects"], request["protocol"]
    kind, k = protocol_spec(protocol)
    n = len(subjects)
    options = {key: request[key] for key in ("seed", "val_fraction", "test_fraction", "strata")}
    if kind == "kfold" and n - math.ceil(n / k) < 2:  # only n=3, k=2: the 2-subject test fold leaves 1 to train on
        with pytest.raises(ValueError, match="need at least 2"):
            make_folds(subjects, protocol, **options)
        return

    folds = make_folds(subjects, protocol, **options)

    assert list(folds.columns) == ["fold", "subject_name", "role"]
    assert set(folds["role"]) <= set(ROLES)
    expected_folds = {"loso": n, "kfold": k, "holdout": 1}[kind]
    assert sorted(folds["fold"].unique()) == list(range(expected_folds))
    for fold, in_fold in folds.groupby("fold"):
        assert sorted(in_fold["subject_name"]) == sorted(subjects), f"fold {fold}: not every subject exactly once"
        roles = fold_subjects(folds, fold)
        non_test = n - len(roles["test"])
        assert roles["train"] and roles["test"]
        assert len(roles["val"]) == min(max(1, round(request["val_fraction"] * non_test)), non_test - 1)
        assert not set(roles["val"]) & set(roles["test"])
    tested = Counter(folds.loc[folds["role"] == "test", "subject_name"])
    if kind in ("loso", "kfold"):
        assert tested == Counter(subjects), "every subject must be test exactly once"
    else:
        assert sum(tested.values()) == min(max(1, round(request["test_fraction"] * n)), n - 2)
    check_folds(folds, subjects=subjects)

    # Deterministic per seed, and independent of the order the subjects are listed in.
    shuffled = list(subjects)
    random.Random(0).shuffle(shuffled)
    pd.testing.assert_frame_equal(make_folds(shuffled, protocol, **options), folds)


def test_rows_are_sorted_by_fold_role_subject():
    folds = make_folds([f"s{i:02d}" for i in range(12)], "kfold3", seed=3)
    role_rank = folds["role"].map({role: rank for rank, role in enumerate(ROLES)})
    keys = list(zip(folds["fold"], role_rank, folds["subject_name"], strict=True))
    assert keys == sorted(keys)


def test_seed_changes_the_folds():
    subjects = [f"s{i:02d}" for i in range(30)]
    reference = make_folds(subjects, "kfold5", seed=0)
    assert any(not make_folds(subjects, "kfold5", seed=seed).equals(reference) for seed in range(1, 4))


def test_holdout_on_87_subjects_is_61_26():
    folds = make_folds(biovid_subjects("all87"), "holdout", seed=0)
    roles = fold_subjects(folds, 0)
    assert len(roles["test"]) == 26
    assert len(roles["train"]) + len(roles["val"]) == 61
    assert len(roles["val"]) == round(0.15 * 61)


@pytest.mark.parametrize(
    ("subjects", "protocol", "options", "message"),
    [
        (["a", "b"], "loso", {}, "at least 3 subjects"),
        (["a", "b", "c", "d"], "kfold5", {}, "at least 5 subjects"),
        (["a", "b", "c"], "kfold2", {}, "need at least 2"),
        (["a", "b", "c", "a"], "loso", {}, "unique"),
        (["a", "", "c"], "loso", {}, "invalid subject name"),
        ("abcdef", "loso", {}, "single string"),
        (["a", "b", "c"], "loso", {"val_fraction": 0.0}, "val_fraction"),
        (["a", "b", "c"], "holdout", {"test_fraction": 1.0}, "test_fraction"),
        (["a", "b", "c"], "loso", {"seed": -1}, "seed"),
        (["a", "b", "c"], "loso", {"strata": {"a": "x", "b": "y"}}, "no label"),
        (["a", "b", "c"], "kfold1", {}, "unknown protocol"),
    ],
)
def test_make_folds_rejects_impossible_requests(subjects, protocol, options, message):
    with pytest.raises(ValueError, match=message):
        make_folds(subjects, protocol, **options)


@pytest.mark.parametrize(
    ("name", "spec"),
    [("loso", ("loso", None)), ("kfold5", ("kfold", 5)), ("kfold10", ("kfold", 10)), ("holdout", ("holdout", None))],
)
def test_protocol_spec(name, spec):
    assert protocol_spec(name) == spec


@pytest.mark.parametrize("name", ["LOSO", "kfold", "kfold0", "kfold1", "kfold05", "kfold-3", "5fold", "", None])
def test_protocol_spec_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="unknown protocol"):
        protocol_spec(name)


# --- strata ----------------------------------------------------------------------------------------------------------


def test_subject_strata_reads_sex_and_age_band():
    strata = subject_strata(["071309_w_21", "071313_m_35", "071614_m_36", "071709_w_50", "082315_w_51"])
    assert strata == {
        "071309_w_21": "w/age<=35",
        "071313_m_35": "m/age<=35",
        "071614_m_36": "m/age36-50",
        "071709_w_50": "w/age36-50",
        "082315_w_51": "w/age>50",
    }


@pytest.mark.parametrize("name", ["071309_x_21", "71309_w_21", "071309_w_", "071309-w-21", "subject01"])
def test_subject_strata_names_a_bad_subject(name):
    with pytest.raises(ValueError, match=name):
        subject_strata(["071309_w_21", name])


def test_kfold5_on_all87_spreads_every_stratum_over_the_test_folds():
    subjects = biovid_subjects("all87")
    strata = subject_strata(subjects)
    folds = make_folds(subjects, "kfold5", seed=0, strata=strata)
    stratum_sizes = Counter(strata.values())
    for fold in range(5):
        tested = fold_subjects(folds, fold)["test"]
        assert {strata[name][0] for name in tested} == {"m", "w"}, f"fold {fold}: test set lacks a sex"
        per_stratum = Counter(strata[name] for name in tested)
        for label, size in stratum_sizes.items():
            assert size // 5 <= per_stratum[label] <= -(-size // 5), f"fold {fold}: stratum {label} unbalanced"


def test_strata_fall_back_to_coarser_then_none_for_small_strata():
    subjects = [f"s{i}" for i in range(6)]
    fine_ok = dict(zip(subjects, ["m/a", "m/a", "m/a", "w/a", "w/a", "w/a"], strict=True))
    coarse_only = dict(zip(subjects, ["m/a", "m/b", "m/a", "w/a", "w/b", "w/a"], strict=True))
    too_small = dict(zip(subjects, ["m/a", "w/b", "w/a", "w/a", "w/b", "w/a"], strict=True))
    assert usable_strata(subjects, fine_ok, min_size=3)[1] == "full"
    assert usable_strata(subjects, coarse_only, min_size=3) == ({s: fine_ok[s][0] for s in subjects}, "coarse")
    assert usable_strata(subjects, too_small, min_size=2)[1] == "none"
    assert usable_strata(subjects, None, min_size=1)[1] == "none"
    for strata in (fine_ok, coarse_only, too_small):
        check_folds(make_folds(subjects, "kfold3", strata=strata), subjects=subjects)


# --- check_folds / read_folds catch corruptions ----------------------------------------------------------------------

SUBJECTS = [f"0{month}0{day}09_{'wm'[day % 2]}_{30 + day}" for month in (7, 8, 9) for day in range(1, 4)]


@pytest.fixture
def kfold_table() -> pd.DataFrame:
    return make_folds(SUBJECTS, "kfold3", seed=1, strata=subject_strata(SUBJECTS))


def _write_raw(table: pd.DataFrame, path: Path) -> Path:
    """Write without checks: the point is to produce broken files."""
    table.to_csv(path, index=False)
    return path


def _row_of(table: pd.DataFrame, fold: int, role: str) -> int:
    """1-based data row of the first subject with `role` in `fold`."""
    return int(((table["fold"] == fold) & (table["role"] == role)).to_numpy().nonzero()[0][0]) + 1


def test_valid_file_round_trips(kfold_table, tmp_path):
    path = tmp_path / "folds.csv"
    write_folds(kfold_table, path)
    pd.testing.assert_frame_equal(read_folds(path, SUBJECTS), kfold_table)


def test_subject_in_train_and_test_of_one_fold_is_a_leak(kfold_table, tmp_path):
    leaky = kfold_table.copy()
    test_row = _row_of(leaky, 0, "test")
    train_row = _row_of(leaky, 0, "train")
    leaked = leaky.loc[test_row - 1, "subject_name"]
    leaky.loc[train_row - 1, "subject_name"] = leaked
    path = _write_raw(leaky, tmp_path / "leaky.csv")
    later = max(test_row, train_row)
    with pytest.raises(FoldError, match="leak") as caught:
        read_folds(path)
    message = str(caught.value)
    assert str(path) in message and f"data row {later} (line {later + 1})" in message
    assert "fold 0" in message and repr(leaked) in message and "train" in message and "test" in message
    with pytest.raises(FoldError, match="leak"):
        check_folds(leaky)


def test_same_subject_twice_in_one_role_is_caught(kfold_table, tmp_path):
    doubled = pd.concat([kfold_table, kfold_table.iloc[[0]]], ignore_index=True)
    with pytest.raises(FoldError, match=f"row {len(doubled)}.*listed twice"):
        read_folds(_write_raw(doubled, tmp_path / "doubled.csv"))


def test_missing_column_names_the_file(kfold_table, tmp_path):
    path = _write_raw(kfold_table.drop(columns="role"), tmp_path / "no_role.csv")
    with pytest.raises(FoldError, match=r"no_role\.csv: missing column\(s\) \['role'\]"):
        read_folds(path)


def test_extra_column_names_the_file(kfold_table, tmp_path):
    path = _write_raw(kfold_table.assign(note="x"), tmp_path / "extra.csv")
    with pytest.raises(FoldError, match=r"extra\.csv: extra column\(s\) \['note'\]"):
        read_folds(path)


def test_unknown_role_names_file_row_fold_and_subject(kfold_table, tmp_path):
    broken = kfold_table.copy()
    broken.loc[4, "role"] = "tset"
    path = _write_raw(broken, tmp_path / "typo.csv")
    with pytest.raises(FoldError) as caught:
        read_folds(path)
    message = str(caught.value)
    assert message.startswith(f"{path}, data row 5 (line 6), fold {broken.loc[4, 'fold']}, ")
    assert repr(broken.loc[4, "subject_name"]) in message and "unknown role 'tset'" in message


def test_non_integer_fold_names_the_row(kfold_table, tmp_path):
    broken = kfold_table.astype({"fold": str})
    broken.loc[2, "fold"] = "one"
    with pytest.raises(FoldError, match=r"data row 3 \(line 4\).*fold 'one' is not a non-negative integer"):
        read_folds(_write_raw(broken, tmp_path / "fold_text.csv"))


def test_short_row_and_empty_file_are_errors(tmp_path):
    short = tmp_path / "short.csv"
    short.write_text("fold,subject_name,role\n0,a,train\n0,b\n")
    with pytest.raises(FoldError, match=r"short\.csv, data row 2 \(line 3\): no value in column 'role'"):
        read_folds(short)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(FoldError, match="empty file"):
        read_folds(empty)


def test_subjects_must_match_the_dataset(kfold_table, tmp_path):
    path = _write_raw(kfold_table, tmp_path / "folds.csv")
    dropped = kfold_table.loc[0, "subject_name"]
    with pytest.raises(FoldError, match=rf"data row 1 \(line 2\), fold 0, subject '{dropped}': not in the dataset"):
        read_folds(path, [name for name in SUBJECTS if name != dropped])
    with pytest.raises(FoldError, match="1 dataset subject.* missing from the fold file.*'999999_w_99'"):
        read_folds(path, [*SUBJECTS, "999999_w_99"])


def test_subject_missing_from_a_fold_is_caught(kfold_table, tmp_path):
    train_row = _row_of(kfold_table, 1, "train")
    removed = kfold_table.loc[train_row - 1, "subject_name"]
    path = _write_raw(kfold_table.drop(index=train_row - 1), tmp_path / "gap.csv")
    with pytest.raises(FoldError, match=f"gap.csv, fold 1, subject '{removed}': missing from this fold"):
        read_folds(path)


def test_fold_without_val_is_caught(kfold_table):
    no_val = kfold_table.copy()
    no_val.loc[(no_val["fold"] == 2) & (no_val["role"] == "val"), "role"] = "train"
    with pytest.raises(FoldError, match="fold 2: no val subjects"):
        check_folds(no_val)


def test_subject_tested_in_two_kfold_folds_is_caught(kfold_table):
    tested_in_fold0 = set(fold_subjects(kfold_table, 0)["test"])
    twice = sorted(tested_in_fold0 & set(fold_subjects(kfold_table, 1)["train"]))[0]
    broken = kfold_table.copy()
    broken.loc[(broken["fold"] == 1) & (broken["subject_name"] == twice), "role"] = "test"
    with pytest.raises(FoldError, match=f"fold 1, subject '{twice}': test in fold 0 too"):
        check_folds(broken)


def test_write_folds_refuses_a_leak_and_keeps_the_old_file(kfold_table, tmp_path):
    path = tmp_path / "folds.csv"
    write_folds(kfold_table, path)
    before = path.read_bytes()
    leaky = pd.concat([kfold_table, kfold_table.iloc[[0]].assign(role="test")], ignore_index=True)
    with pytest.raises(FoldError):
        write_folds(leaky, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folds.csv"], "no temporary file left behind"


def test_fold_subjects_and_sha256(kfold_table, tmp_path):
    roles = fold_subjects(kfold_table, 0)
    assert list(roles) == list(ROLES) and all(names == sorted(names) for names in roles.values())
    assert sorted(sum(roles.values(), [])) == sorted(SUBJECTS)
    with pytest.raises(ValueError, match="fold 7 is not in the fold table"):
        fold_subjects(kfold_table, 7)
    path = tmp_path / "folds.csv"
    write_folds(kfold_table, path)
    digest = fold_file_sha256(path)
    assert len(digest) == 64
    write_folds(make_folds(SUBJECTS, "kfold3", seed=2), path)
    assert fold_file_sha256(path) != digest


# --- fold parameters: recorded beside the file, compared on every read ---------------------------------------------


def test_sidecar_records_the_parameters_and_the_files_hash(kfold_table, tmp_path):
    path = tmp_path / "kfold3_all9.csv"
    write_folds(kfold_table, path, fold_parameters("kfold3", seed=1, val_fraction=0.15, test_fraction=0.3))
    assert parameters_path(path) == tmp_path / "kfold3_all9.json"
    recorded = json.loads(parameters_path(path).read_text())
    # test_fraction does not change a k-fold file, so it is not recorded (nor compared)
    assert recorded == {"protocol": "kfold3", "seed": 1, "val_fraction": 0.15, "n_subjects": 9,
                        "fold_file_sha256": fold_file_sha256(path)}
    assert read_fold_parameters(path) == recorded

    holdout = make_folds(SUBJECTS, "holdout", seed=2, val_fraction=0.2, test_fraction=0.4)
    write_folds(holdout, path, fold_parameters("holdout", seed=2, val_fraction=0.2, test_fraction=0.4))
    assert read_fold_parameters(path)["test_fraction"] == 0.4
    with pytest.raises(ValueError, match="'holdout' needs a test_fraction"):
        fold_parameters("holdout", seed=0, val_fraction=0.15)

    write_folds(kfold_table, path)  # written without parameters: the old record would describe another file
    assert not parameters_path(path).exists()


def test_other_seed_or_val_fraction_is_refused_naming_both_values(kfold_table, tmp_path):
    path = tmp_path / "kfold3_all9.csv"
    write_folds(kfold_table, path, fold_parameters("kfold3", seed=1, val_fraction=0.15))
    check_fold_parameters(path, fold_parameters("kfold3", seed=1, val_fraction=0.15))  # the same: accepted

    with pytest.raises(FoldError) as error:
        check_fold_parameters(path, fold_parameters("kfold3", seed=7, val_fraction=0.2), remedy="Delete it.")
    message = str(error.value)
    assert message.startswith(f"{path} was made with other fold parameters")
    assert str(parameters_path(path)) in message
    assert "seed: file 1, config 7" in message and "val_fraction: file 0.15, config 0.2" in message
    assert "protocol" not in message.split(":", 1)[1] and message.endswith("Delete it.")


def test_a_fold_file_changed_after_its_record_is_refused(kfold_table, tmp_path):
    path = tmp_path / "kfold3_all9.csv"
    write_folds(kfold_table, path, fold_parameters("kfold3", seed=1, val_fraction=0.15))
    path.write_text(path.read_text().replace("\n", "\r\n"))  # same folds, other bytes: as after an editor's save
    with pytest.raises(FoldError, match=f"{path}: SHA-256 [0-9a-f]{{64}} differs from the [0-9a-f]{{64}} recorded"):
        check_fold_parameters(path, fold_parameters("kfold3", seed=1, val_fraction=0.15))


def test_a_fold_file_without_a_record_is_accepted_with_a_warning(kfold_table, tmp_path, caplog):
    path = tmp_path / "kfold3_all9.csv"
    write_folds(kfold_table, path)
    with caplog.at_level("WARNING", logger="pipeline.data.fold_files"):
        check_fold_parameters(path, fold_parameters("kfold3", seed=7, val_fraction=0.2))
    assert f"{path} has no parameter record kfold3_all9.json" in caplog.text and "seed=7" in caplog.text


def data_of(overrides: list[str]) -> DataSettings:
    return DataSettings.from_config(load_config(overrides))


def test_make_data_refuses_a_config_the_fold_file_was_not_made_with(tmp_path):
    """The synthetic twin: generated on first use with the config's parameters, then only read."""
    subjects = biovid_subjects("all87")[:20]
    path = ensure_folds(data_of(tiny_overrides(tmp_path)), subjects)
    assert read_fold_parameters(path)["seed"] == 0
    ensure_folds(data_of(tiny_overrides(tmp_path)), subjects)  # the same config reads it back

    with pytest.raises(SystemExit) as error:
        ensure_folds(data_of(tiny_overrides(tmp_path, "protocol.seed=7", "protocol.val_fraction=0.3")), subjects)
    message = str(error.value)
    assert str(path) in message and "seed: file 0, config 7" in message
    assert "val_fraction: file 0.15, config 0.3" in message
    assert f"delete {path} and kfold5_all.json" in message and "data.manifest_dir" in message


def test_biovid_committed_folds_are_checked_and_other_parameters_go_to_another_folder(tmp_path):
    subjects = biovid_subjects("all87")
    biovid = ["data=biovid", "data.root=/nowhere"]
    assert ensure_folds(data_of(biovid), subjects) == biovid_manifest_path("kfold5", "all87")
    with pytest.raises(SystemExit) as error:
        ensure_folds(data_of([*biovid, "protocol.seed=1"]), subjects)
    message = str(error.value)
    assert str(biovid_manifest_path("kfold5", "all87")) in message and "seed: file 0, config 1" in message
    assert "point data.manifest_dir at another folder" in message

    path = ensure_folds(data_of([*biovid, "protocol.seed=1", f"data.manifest_dir={tmp_path}"]), subjects)
    assert path == tmp_path / "kfold5_all87.csv"
    assert read_fold_parameters(path) == {**fold_parameters("kfold5", seed=1, val_fraction=0.15), "n_subjects": 87,
                                          "fold_file_sha256": fold_file_sha256(path)}
    assert path.read_bytes() != biovid_manifest_path("kfold5", "all87").read_bytes()


# --- committed BioVid manifests --------------------------------------------------------------------------------------


def test_biovid_subject_sets():
    all87 = biovid_subjects("all87")
    responders67 = biovid_subjects("responders67")
    assert len(all87) == 87 and len(set(all87)) == 87
    assert sorted(set(all87) - set(responders67)) == sorted(NON_RESPONDERS)
    assert len(responders67) == 67
    with pytest.raises(ValueError, match="unknown subject set 'all86'"):
        biovid_subjects("all86")


def test_subjects_csv_must_agree_with_the_one_non_responder_list(tmp_path):
    table = pd.read_csv(BIOVID_SUBJECTS_CSV, dtype=str)
    responder = table.index[table.facial_responder == "1"][0]
    table.loc[responder, "facial_responder"] = "0"
    table.to_csv(tmp_path / "subjects.csv", index=False)
    name = table.subject_name[responder]
    with pytest.raises(ValueError, match=f"subject '{name}': facial_responder 0 disagrees with .*NON_RESPONDERS"):
        biovid_subjects("responders67", tmp_path / "subjects.csv")


@pytest.mark.parametrize("subject_set", SUBJECT_SETS)
@pytest.mark.parametrize("protocol", BIOVID_PROTOCOLS)
def test_committed_manifest_loads_and_matches_regeneration(protocol, subject_set, tmp_path):
    subjects = biovid_subjects(subject_set)
    committed_path = biovid_manifest_path(protocol, subject_set)
    committed = read_folds(committed_path, subjects)
    regenerated = make_folds(subjects, protocol, seed=0, strata=subject_strata(subjects))
    pd.testing.assert_frame_equal(committed, regenerated)
    write_folds(regenerated, tmp_path / committed_path.name)
    assert (tmp_path / committed_path.name).read_bytes() == committed_path.read_bytes(), "byte drift"


@pytest.mark.parametrize("subject_set", SUBJECT_SETS)
@pytest.mark.parametrize("protocol", BIOVID_PROTOCOLS)
def test_committed_sidecar_matches_its_fold_file(protocol, subject_set):
    path = biovid_manifest_path(protocol, subject_set)
    recorded = json.loads(parameters_path(path).read_text())
    assert recorded["fold_file_sha256"] == fold_file_sha256(path)
    assert recorded == {**biovid_fold_parameters(protocol), "n_subjects": len(biovid_subjects(subject_set)),
                        "fold_file_sha256": fold_file_sha256(path)}
    assert {"protocol": protocol, "seed": 0, "val_fraction": 0.15}.items() <= recorded.items()
    assert ("test_fraction" in recorded) == (protocol == "holdout")


def test_cli_writes_the_committed_files_and_checks(tmp_path, capsys):
    assert main(["write-biovid", "--out-dir", str(tmp_path)]) == 0
    for subject_set in SUBJECT_SETS:
        for protocol in BIOVID_PROTOCOLS:
            written = biovid_manifest_path(protocol, subject_set, tmp_path)
            assert written.read_bytes() == biovid_manifest_path(protocol, subject_set).read_bytes()
            committed_sidecar = parameters_path(biovid_manifest_path(protocol, subject_set))
            assert parameters_path(written).read_bytes() == committed_sidecar.read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        path.name for path in BIOVID_MANIFEST_DIR.iterdir() if path.name != "subjects.csv"
    )
    capsys.readouterr()

    good = [str(biovid_manifest_path(protocol, "all87")) for protocol in BIOVID_PROTOCOLS]
    assert main(["check", *good, "--subject-set", "all87"]) == 0
    assert capsys.readouterr().out.count("ok ") == len(BIOVID_PROTOCOLS)

    broken = tmp_path / "broken.csv"
    broken.write_text("fold,subject_name,role\n0,a,train\n0,b,val\n0,c,exam\n")
    assert main(["check", good[0], str(broken)]) == 1
    assert f"{broken}, data row 3 (line 4), fold 0, subject 'c': unknown role 'exam'" in capsys.readouterr().err
