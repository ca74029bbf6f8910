"""BioVid Part A ingestion: a valid folder loads; every kind of bad input fails loudly or is skipped and reported."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipeline.data.biovid import NON_RESPONDERS, SAMPLES_COLUMNS, SAMPLES_CSV, BioVidError, load_samples
from pipeline.data.biovid_folds import biovid_subjects


@pytest.fixture()
def biovid_copy(tiny_base: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny synthetic twin's raw folder, safe to damage."""
    root = tmp_path / "PartA"
    shutil.copytree(tiny_base / "raw" / "starting_point", root / "starting_point")
    shutil.copytree(tiny_base / "raw" / "video", root / "video")
    return root


def read_csv(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / SAMPLES_CSV, sep="\t", dtype=str)


def write_csv(root: Path, table: pd.DataFrame) -> None:
    table.to_csv(root / SAMPLES_CSV, sep="\t", index=False)


def test_valid_folder_loads_every_sample(biovid_copy: Path) -> None:
    samples, report = load_samples(biovid_copy)
    listed = read_csv(biovid_copy)
    assert list(samples.columns) == [*SAMPLES_COLUMNS, "video_path"]
    assert len(samples) == len(listed) and report.n_skipped == 0 and not report.unlisted_videos
    assert sorted(samples.class_name.unique()) == ["BL1", "PA1", "PA2", "PA3", "PA4"]
    assert all(Path(p).is_file() for p in samples.video_path)


def test_not_a_biovid_folder(tmp_path: Path) -> None:
    with pytest.raises(BioVidError, match="does not exist"):
        load_samples(tmp_path / "nowhere")
    (tmp_path / "video").mkdir()
    with pytest.raises(BioVidError, match="not a BioVid Part A folder"):
        load_samples(tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.drop(columns="class_name"), "missing: \\['class_name'\\]"),
    (lambda t: t.assign(extra="x"), "unexpected: \\['extra'\\]"),
])
def test_wrong_columns_name_the_file(biovid_copy: Path, change, message: str) -> None:
    write_csv(biovid_copy, change(read_csv(biovid_copy)))
    with pytest.raises(BioVidError, match=message) as error:
        load_samples(biovid_copy)
    assert str(biovid_copy / SAMPLES_CSV) in str(error.value)


def test_comma_separated_file_is_explained(biovid_copy: Path) -> None:
    read_csv(biovid_copy).to_csv(biovid_copy / SAMPLES_CSV, index=False)
    with pytest.raises(BioVidError, match="TAB-separated"):
        load_samples(biovid_copy)


def test_unknown_class_names_file_and_line(biovid_copy: Path) -> None:
    table = read_csv(biovid_copy)
    table.loc[3, "class_name"] = "PA9"
    write_csv(biovid_copy, table)
    with pytest.raises(BioVidError, match=r"samples.csv:5: unknown class 'PA9'"):
        load_samples(biovid_copy)


def test_class_id_must_match_class_name(biovid_copy: Path) -> None:
    table = read_csv(biovid_copy)
    row = table.index[table.class_name == "PA4"][0]
    table.loc[row, "class_id"] = "1"
    write_csv(biovid_copy, table)
    with pytest.raises(BioVidError, match=rf"samples.csv:{row + 2}: class_id 1 does not match class_name PA4"):
        load_samples(biovid_copy)


def test_duplicate_sample_is_an_error(biovid_copy: Path) -> None:
    table = read_csv(biovid_copy)
    write_csv(biovid_copy, pd.concat([table, table.iloc[[0]]]))
    with pytest.raises(BioVidError, match=rf"samples.csv:{len(table) + 2}: sample .* listed twice"):
        load_samples(biovid_copy)


def test_missing_empty_and_unlisted_videos_are_skipped_and_reported(biovid_copy: Path) -> None:
    samples, _ = load_samples(biovid_copy)
    gone, empty = Path(samples.video_path[0]), Path(samples.video_path[1])
    gone.unlink()
    empty.write_bytes(b"")
    stray = biovid_copy / "video" / samples.subject_name[0] / "not-listed.mp4"
    shutil.copy(samples.video_path[2], stray)

    kept, report = load_samples(biovid_copy)
    assert len(kept) == len(samples) - 2
    assert report.missing_videos == [(2, str(gone.resolve()))]
    assert report.empty_videos == [(3, str(empty.resolve()))]
    assert report.unlisted_videos == [str(stray.resolve())]
    text = "\n".join(report.lines())
    assert f"{biovid_copy / SAMPLES_CSV}:2" in text and "not-listed.mp4" in text


def test_no_video_at_all_is_an_error(biovid_copy: Path) -> None:
    shutil.rmtree(biovid_copy / "video")
    (biovid_copy / "video").mkdir()
    with pytest.raises(BioVidError, match="none of the .* listed videos exists"):
        load_samples(biovid_copy)


def test_responders67_drops_the_non_responders(biovid_copy: Path) -> None:
    table = read_csv(biovid_copy)
    first = table.subject_name.iloc[0]
    non_responder = sorted(NON_RESPONDERS)[0]
    video_dir = biovid_copy / "video"
    (video_dir / first).rename(video_dir / non_responder)
    for path in (video_dir / non_responder).iterdir():
        path.rename(path.with_name(path.name.replace(first, non_responder)))
    table["subject_name"] = table.subject_name.str.replace(first, non_responder)
    table["sample_name"] = table.sample_name.str.replace(first, non_responder)
    write_csv(biovid_copy, table)

    everyone, _ = load_samples(biovid_copy, subject_set="all87")
    responders, report = load_samples(biovid_copy, subject_set="responders67")
    assert non_responder in set(everyone.subject_name)
    assert non_responder not in set(responders.subject_name)
    assert report.excluded_subjects == [non_responder]
    with pytest.raises(BioVidError, match="unknown subject set"):
        load_samples(biovid_copy, subject_set="some")


def test_committed_subject_list_agrees_with_the_non_responders() -> None:
    everyone, responders = set(biovid_subjects("all87")), set(biovid_subjects("responders67"))
    assert len(everyone) == 87 and len(responders) == 67
    assert everyone - responders == NON_RESPONDERS
