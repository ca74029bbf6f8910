"""Personalisation protocols (pipeline/data/personalise.py): a baseline reference never stays among the rows tested,
the selection reads no label but the BL1 mask (refuses label columns; non-BL1 labels permuted change nothing), each
person's reference is drawn from that person's rows alone, a person with fewer than k BL1 videos is named,
subject-normalised statistics of a person come from that person only, and the REFERENCE= helper reads a folder of
resting recordings or says what is missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.data.personalise import (
    PersonaliseConfig,
    ReferenceStatistics,
    label_free_rows,
    reference_means,
    reference_statistics,
    relative_to_reference,
    select_baseline,
    shown_protocol,
    subject_normalise,
    unbalanced_test,
)
from pipeline.data.tasks import CLASS_NAMES
from pipeline.evaluation.statistics import common_videos
from pipeline.utils.config import load_config

CROPS = 3


def frame_table(n_subjects: int = 4, videos_per_class: int = 4, seed: int = 0) -> pd.DataFrame:
    """A frame table in the project's layout: every person's videos of every class, CROPS crops each."""
    rng = np.random.default_rng(seed)
    rows = []
    for subject in range(n_subjects):
        for class_id, class_name in enumerate(CLASS_NAMES):
            for video in range(videos_per_class):
                sample = f"s{subject}-{class_name}-{video:02d}"
                rows += [{"subject_name": f"p{subject}", "sample_name": sample, "class_id": class_id,
                          "class_name": class_name, "frame_index": crop, "crop_path": f"crops/{sample}/{crop}.jpg"}
                         for crop in range(CROPS)]
    return pd.DataFrame(rows).sample(frac=1.0, random_state=int(rng.integers(1000))).reset_index(drop=True)


def test_a_baseline_reference_is_never_among_the_rows_left_to_test_and_takes_whole_bl1_videos() -> None:
    frames = frame_table()
    rows, is_bl1 = label_free_rows(frames)
    split = select_baseline(rows, is_bl1, k=2, seed=0)
    reference = set(map(tuple, split.reference[["subject_name", "sample_name"]].to_numpy()))
    remaining = set(map(tuple, split.remaining[["subject_name", "sample_name"]].to_numpy()))
    assert reference and not reference & remaining
    assert len(split.reference) + len(split.remaining) == len(frames)
    assert split.reference.groupby(["subject_name", "sample_name"]).size().eq(CROPS).all()  # every crop of a video
    assert (frames.loc[split.reference.index, "class_name"] == "BL1").all()
    assert split.reference.groupby("subject_name")["sample_name"].nunique().eq(2).all()
    lost = split.videos_lost.set_index("subject_name")
    assert lost["n_reference_videos"].eq(2).all() and lost["n_remaining_videos"].eq(5 * 4 - 2).all()
    again = select_baseline(rows, is_bl1, k=2, seed=0)
    assert again.reference.index.equals(split.reference.index)  # deterministic from the seed
    other = select_baseline(rows, is_bl1, k=2, seed=1)
    assert not other.reference.index.sort_values().equals(split.reference.index.sort_values())


def test_the_selection_reads_no_label_but_the_bl1_mask() -> None:
    frames = frame_table(seed=1)
    with pytest.raises(ValueError, match=r"carry the label columns \['class_name', 'class_id'\]"):
        select_baseline(frames, frames["class_name"].eq("BL1"), k=1, seed=0)
    rows, is_bl1 = label_free_rows(frames)
    assert not set(rows.columns) & {"class_name", "class_id", "label"}
    split = select_baseline(rows, is_bl1, k=1, seed=0)
    # the pain labels permuted among the non-BL1 videos (PA1 <-> PA4, ...): the selection cannot tell
    shuffled = frames.copy()
    pain = shuffled["class_name"] != "BL1"
    shuffled.loc[pain, "class_name"] = shuffled.loc[pain, "class_name"].map(
        {"PA1": "PA4", "PA2": "PA3", "PA3": "PA1", "PA4": "PA2"})
    rows2, is_bl1_2 = label_free_rows(shuffled)
    assert select_baseline(rows2, is_bl1_2, k=1, seed=0).reference.index.equals(split.reference.index)


def test_a_larger_k_keeps_the_smaller_ks_references() -> None:
    rows, is_bl1 = label_free_rows(frame_table())
    chosen = {k: set(map(tuple, select_baseline(rows, is_bl1, k=k, seed=3).reference[["subject_name", "sample_name"]]
                         .drop_duplicates().to_numpy())) for k in (1, 2, 4)}
    assert chosen[1] < chosen[2] < chosen[4]  # CVs of several k share every video none of them took


def test_each_persons_reference_comes_from_their_own_rows_alone() -> None:
    frames = frame_table(n_subjects=5, seed=2)
    rows, is_bl1 = label_free_rows(frames)
    full = select_baseline(rows, is_bl1, k=2, seed=0).reference
    # the training subjects alone (a fold's train rows): their references are the ones they get among everyone
    train = rows["subject_name"].isin(["p0", "p2", "p3"]).to_numpy()
    alone = select_baseline(rows[train], is_bl1[train], k=2, seed=0).reference
    assert set(alone["subject_name"]) == {"p0", "p2", "p3"}
    assert alone.index.sort_values().equals(full[full["subject_name"].isin(["p0", "p2", "p3"])].index.sort_values())


def test_a_person_with_fewer_bl1_videos_than_k_is_an_error_naming_them_and_their_count() -> None:
    frames = frame_table(n_subjects=3, videos_per_class=3, seed=3)
    lost = frames["sample_name"].isin(["s1-BL1-00", "s1-BL1-01"])  # p1 kept one BL1 video
    rows, is_bl1 = label_free_rows(frames[~lost])
    with pytest.raises(ValueError, match=r"fewer BL1 videos than k \(their count in brackets\): p1 \(1\);"):
        select_baseline(rows, is_bl1, k=2, seed=0)
    assert len(select_baseline(rows, is_bl1, k=1, seed=0).videos_lost) == 3
    mixed = is_bl1.copy()
    mixed[np.flatnonzero(is_bl1)[0]] = False
    with pytest.raises(ValueError, match="the BL1 mask differs between crops of one video"):
        select_baseline(rows, mixed, k=1, seed=0)


def test_subject_normalised_statistics_of_a_person_come_from_that_person_only() -> None:
    rng = np.random.default_rng(4)
    subjects = np.repeat(["a", "b", "c"], [6, 9, 4])
    features = rng.normal(size=(len(subjects), 5)) + np.repeat([[0.0], [5.0], [-3.0]], [6, 9, 4], axis=0)
    normalised = subject_normalise(subjects, features)
    for subject in "abc":
        mine = normalised[subjects == subject]
        np.testing.assert_allclose(mine.mean(axis=0), 0.0, atol=1e-12)
        np.testing.assert_allclose(mine.std(axis=0), 1.0)
    changed = features.copy()
    changed[subjects == "b"] = rng.normal(size=(9, 5)) * 40 + 7  # another person's rows changed entirely
    np.testing.assert_array_equal(subject_normalise(subjects, changed)[subjects != "b"], normalised[subjects != "b"])
    constant = np.column_stack([features[:, 0], np.full(len(subjects), 2.0)])
    np.testing.assert_array_equal(subject_normalise(subjects, constant)[:, 1], 0.0)  # centred, not divided by 0


def test_features_relative_to_the_reference_subtract_the_persons_reference_mean() -> None:
    reference = reference_means(np.array(["a", "a", "b"]), np.array([[1.0, 2.0], [3.0, 4.0], [10.0, 10.0]]))
    got = relative_to_reference(np.array(["b", "a"]), np.array([[11.0, 12.0], [2.0, 3.0]]), reference)
    np.testing.assert_allclose(got, [[1.0, 2.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="no baseline reference for c"):
        relative_to_reference(np.array(["c"]), np.zeros((1, 2)), reference)


def test_the_reference_helper_reads_a_folder_of_resting_recordings_or_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no reference: .*REFERENCE=<folder of the person's recordings>"):
        reference_statistics(None)
    with pytest.raises(ValueError, match="does not exist"):
        reference_statistics(tmp_path / "absent")
    with pytest.raises(ValueError, match="holds no recordings"):
        reference_statistics(tmp_path)
    rng = np.random.default_rng(5)
    first, second = rng.normal(size=(4, 3)), rng.normal(size=(2, 3))
    np.save(tmp_path / "rest1.npy", first)
    np.save(tmp_path / "rest2.npy", second)
    stats = reference_statistics(tmp_path)
    np.testing.assert_allclose(stats.mean, np.concatenate([first, second]).mean(axis=0))
    assert (stats.n_recordings, stats.n_rows) == (2, 6)
    np.testing.assert_allclose(stats.relative(first), first - stats.mean)
    (tmp_path / "rest3.mp4").write_bytes(b"not read here")
    with pytest.raises(ValueError, match=r"rest3.mp4 are not embeddings \(.npy\)"):
        reference_statistics(tmp_path)
    with_video = reference_statistics(tmp_path, embed=lambda path: np.ones((3, 3)))
    assert (with_video.n_recordings, with_video.n_rows) == (3, 9)


def test_a_reference_shows_new_features_as_each_protocol_showed_its_training_crops() -> None:
    rng = np.random.default_rng(8)
    rows = np.column_stack([rng.normal(3.0, 2.0, 50), rng.normal(-1.0, 0.5, 50), np.full(50, 7.0)])
    subjects = np.array(["p"] * 50)
    stats = ReferenceStatistics(rows.mean(axis=0), rows.std(axis=0), 1, len(rows), Path("rest"))
    # the reference's own rows come out as a cross-validation serves that person's rows
    np.testing.assert_allclose(stats.applied(rows, PersonaliseConfig("subject_normalised")),
                               subject_normalise(subjects, rows), atol=1e-9)
    baseline = PersonaliseConfig("baseline", k=1, seed=0)
    np.testing.assert_allclose(stats.applied(rows[:3], baseline),
                               relative_to_reference(subjects[:3], rows[:3], {"p": rows.mean(axis=0)}))
    with pytest.raises(ValueError, match="a plain model takes no reference"):
        stats.applied(rows, PersonaliseConfig("none"))
    assert PersonaliseConfig("none").meta() == {}
    assert PersonaliseConfig.from_config(baseline.meta()["personalise"]) == baseline


def test_the_personalise_group_composes_each_protocol_and_none_is_the_default() -> None:
    assert PersonaliseConfig.from_config(load_config().get("personalise")).label == "none"
    assert "personalise" not in load_config()  # none adds no key: a default run's settings are as they were
    cfg = load_config(["personalise=baseline", "personalise.k=2"])
    assert PersonaliseConfig.from_config(cfg.personalise).label == "baseline_k2"
    assert PersonaliseConfig.from_config(load_config(["personalise=subject_normalised"]).personalise).label == \
        "subject_normalised_transductive"  # it reads every test video of the person: named so everywhere
    unbalanced = load_config(["personalise=subject_normalised", "personalise.test_pain_share=0.2"]).personalise
    assert PersonaliseConfig.from_config(unbalanced).label == "subject_normalised_transductive_test1to4"
    assert shown_protocol("subject_normalised") == "subject_normalised_transductive"  # a CV tagged before
    assert shown_protocol("subject_normalised_transductive") == "subject_normalised_transductive"
    assert shown_protocol("baseline_k2") == "baseline_k2"
    with pytest.raises(ValueError, match=r"personalise.test_pain_share=1.5: expected a share in \(0, 1\)"):
        PersonaliseConfig.from_config({"mode": "subject_normalised", "test_pain_share": 1.5})
    with pytest.raises(ValueError, match="personalise=baseline needs personalise.k >= 1"):
        PersonaliseConfig.from_config(load_config(["personalise=baseline", "personalise.k=0"]).personalise)


def test_a_baseline_cv_and_a_plain_one_are_paired_on_the_videos_both_tested() -> None:
    frames = frame_table(n_subjects=3, seed=6)
    videos = frames.drop_duplicates(["subject_name", "sample_name"]).drop(columns=["frame_index", "crop_path"])
    rows, is_bl1 = label_free_rows(videos)
    split = select_baseline(rows, is_bl1, k=2, seed=0)
    plain = videos.assign(label=videos["class_id"].gt(0).astype(int))
    personalised = plain.loc[split.remaining.index]  # its references were not tested
    paired, record = common_videos({"plain": plain, "baseline_k2": personalised})

    def keys(table: pd.DataFrame) -> set[tuple[str, str]]:
        return set(map(tuple, table[["subject_name", "sample_name"]].to_numpy()))

    assert keys(paired["plain"]) == keys(paired["baseline_k2"]) == keys(personalised)
    references = set(map(tuple, split.reference[["subject_name", "sample_name"]].to_numpy()))
    assert references and not references & keys(paired["plain"])  # the references are left out of both
    assert record.set_index("cv").to_dict("index") == {
        "plain": {"n_videos": 60, "n_common_videos": 54, "n_dropped_videos": 6},
        "baseline_k2": {"n_videos": 54, "n_common_videos": 54, "n_dropped_videos": 0}}


def test_an_unbalanced_test_keeps_every_no_pain_video_and_one_pain_video_to_four() -> None:
    """Each person's videos of a binary task, subsampled to one pain video per four no-pain videos: whole videos
    (every crop), drawn per person from (seed, person), at least one pain video."""
    frames = frame_table(n_subjects=4, videos_per_class=8, seed=3)
    task = frames[frames["class_name"].isin(["BL1", "PA2"])]
    kept = unbalanced_test(task, (task["class_name"] != "BL1").to_numpy(), 0.2, seed=0)
    videos = kept.drop_duplicates(["subject_name", "sample_name"])
    counts = videos.groupby(["subject_name", "class_name"]).size().unstack()
    assert counts["BL1"].eq(8).all() and counts["PA2"].eq(2).all()  # 8 no-pain: 2 pain (one to four)
    assert kept.groupby(["subject_name", "sample_name"]).size().eq(CROPS).all()  # every crop of a kept video
    again = unbalanced_test(task, (task["class_name"] != "BL1").to_numpy(), 0.2, seed=0)
    assert again.index.equals(kept.index)
    other = unbalanced_test(task, (task["class_name"] != "BL1").to_numpy(), 0.2, seed=1)
    assert not other.index.equals(kept.index)
    few = unbalanced_test(task, (task["class_name"] != "BL1").to_numpy(), 0.05, seed=0)
    assert few.drop_duplicates(["subject_name", "sample_name"]).groupby("subject_name")["class_name"].apply(
        lambda names: (names == "PA2").sum()).eq(1).all()  # at least one pain video a person
