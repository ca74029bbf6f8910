"""`make table` on the tiny twin: five tasks run (one fold, one epoch each), written beside the published rows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.analysis.results_table import (
    LABELS,
    LITERATURE_COLUMNS,
    TASKS,
    build_report,
    describe_subject_set,
    project_row,
    read_literature,
    run_table,
)
from tests.conftest import make_finished_cv, tiny_overrides
from tests.test_cv import FAST


def test_table_has_five_task_rows_and_the_published_ones_apart(tiny_base: Path, tmp_path: Path, capsys) -> None:
    settings = [o for o in FAST if not o.startswith(("model=", "trainer.folds", "trainer.max_epochs"))]
    overrides = tiny_overrides(tiny_base, *settings, "trainer.folds=[0]", "trainer.max_epochs=1",
                               f"mlflow.tracking_uri=sqlite:///{tmp_path / 'table.db'}", f"cv.work_dir={tmp_path}/runs",
                               f"reports_dir={tmp_path}/reports")
    from pipeline.utils.config import load_config

    result = run_table(load_config(overrides), overrides=overrides, models="mobilevit_xxs")
    out = capsys.readouterr().out
    assert "used subject set all: every participant of the synthetic twin" in out

    table = result["table"]
    assert table["task"].tolist() == ["BL1 vs PA1", "BL1 vs PA2", "BL1 vs PA3", "BL1 vs PA4", "five classes"]
    assert list(table.columns[1:]) == ["protocol", *(f"mobilevit_xxs: {m}" for m in LABELS.values())]
    assert set(table["protocol"]) == {"none"}  # a plain CV's protocol
    for column in ("accuracy at threshold", "argmax accuracy"):  # one fold only
        assert all("[" in text and "(incomplete)" in text for text in table[f"mobilevit_xxs: {column}"])
    # the default kfold5 twin: nothing published is comparable, and what was tested is stated
    assert "no published result is comparable with this run (synthetic, 5-fold (subject-grouped)" in out
    assert result["comparable"].empty and result["shape"].empty
    assert (result["facts"]["subjects tested"].astype(int) > 0).all()
    assert (result["facts"]["training subjects per fold"] != "-").all()

    long = pd.read_csv(result["paths"]["csv"], keep_default_na=False)
    ours, published = long[long.source == "this project"], long[long.source == "published"]
    assert sorted(ours.task) == sorted(TASKS) and (ours.model == "mobilevit_xxs").all()
    assert len(published) == len(read_literature()) and set(published.task) <= set(TASKS)
    assert (ours.accuracy.astype(float).between(0, 100)).all()
    markdown = result["paths"]["markdown"].read_text()
    assert markdown.index("this project") < markdown.index("Published results") < markdown.index("Werner")
    assert result["paths"]["png"].read_bytes()[:4] == b"\x89PNG"

    client = MlflowClient(f"sqlite:///{tmp_path / 'table.db'}")
    run = client.get_run(result["run_id"])
    assert run.data.tags["painvit.run_kind"] == "table" and run.data.params["tasks"] == ",".join(TASKS)
    # a second table finds the five finished cross-validations instead of training them again
    again = run_table(load_config(overrides), overrides=overrides, models="mobilevit_xxs", tasks="bl1_vs_pa4")
    assert "already finished" in capsys.readouterr().out
    assert again["rows"].parent_run_id.tolist() == result["rows"].query("task == 'bl1_vs_pa4'").parent_run_id.tolist()


def test_the_67_set_says_where_it_comes_from() -> None:
    assert "20 who showed no facial response" in describe_subject_set("responders67", "biovid")
    assert "face crops" in describe_subject_set("all87_usable", "biovid")
    # the BioVid-scale twin's sets carry BioVid's names, not its people
    assert describe_subject_set("all87", "synthetic87").startswith("synthetic people under the subject names of")


def test_a_literature_row_of_another_width_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "literature.csv"
    path.write_text(",".join(LITERATURE_COLUMNS) + "\n"
                    "bl1_vs_pa4,m,A,2020,V,loso,87,video,video,70,secondary, unchecked,extra\n")
    with pytest.raises(ValueError, match="line 2: 13 fields where the header has 12"):
        read_literature(path)


def report_for(store: dict, protocol: str, dataset: str = "synthetic", subject_set: str = "all",
               subjects_tested: int | None = None) -> dict:
    """`make table`'s tables from the finished CVs of one protocol in the conftest store (no training), as if run on
    `dataset` with `subject_set` and, when given, `subjects_tested` subjects tested by every CV."""
    client = store["client"]
    tasks = ["bl1_vs_pa4", "five_class"]
    rows = pd.DataFrame([project_row("mobilevit_xxs", task, client.get_run(store["runs"][(protocol, task)]))
                         for task in tasks])
    if subjects_tested is not None:
        rows["subjects_tested"] = subjects_tested
    return build_report(rows, ["mobilevit_xxs"], tasks, dataset, protocol, subject_set)


LOSO_87_VIDEO = {"Werner et al.", "Gkikas & Tsiknakis", "Gkikas et al.", "Zhi & Wan"}


def test_kfold5_has_no_comparable_published_row_and_a_twins_loso_none_either(finished_cv_store) -> None:
    # the 20-person twin under LOSO (its subject set `all` once stood for Part A's 87): nothing is comparable
    loso = report_for(finished_cv_store, "loso")
    assert loso["comparable"].empty
    kfold = report_for(finished_cv_store, "kfold5")
    assert kfold["comparable"].empty and kfold["shape"].empty
    assert any(note.startswith("no published result is comparable with this run (synthetic, 5-fold (subject-grouped)")
               for note in kfold["notes"])
    literature = read_literature()
    assert len(kfold["other"]) == literature.task.isin(["bl1_vs_pa4", "five_class"]).sum()  # every row of its tasks

    # the LOSO papers have the twin's protocol shape, listed apart with the reason
    shape = loso["shape"]
    assert set(shape.authors) == LOSO_87_VIDEO and (shape.protocol == "loso").all()
    assert "not BioVid" in loso["reason"] and any("NOT comparable" in note for note in loso["notes"])
    # video + physiology, an unconfirmed protocol and a participant-mixed split stay apart
    assert (shape.modality == "video").all() and "video+ECG" in set(loso["other"].modality)
    assert {"unknown", "participant-mixed"} <= set(loso["other"].protocol)
    assert "papers that train a LOSO fold on all 86" in loso["notes"][0]

    ours, facts = loso["ours"], loso["facts"]
    assert ours["task"].tolist() == ["BL1 vs PA4", "five classes"]
    assert ours["mobilevit_xxs: accuracy at threshold"][0] == "80.0 [70.0, 88.0]"
    assert ours["mobilevit_xxs: argmax accuracy"][0] == "75.0 [65.0, 85.0]"
    assert ours["mobilevit_xxs: macro-F1"].tolist() == ["", "40.0"]
    assert facts[["subjects tested", "videos tested", "training subjects per fold"]].iloc[0].tolist() == [
        "20", "240", "16"]
    assert facts["unusable subjects"].tolist() == ["0", "1: 020101_m_30"]
    assert kfold["facts"]["skipped folds"].tolist() == ["none", "4"]
    assert kfold["facts"]["training subjects per fold"][0] == "12-13"


def test_only_a_biovid_run_of_the_papers_tested_subjects_is_comparable(finished_cv_store) -> None:
    # the BioVid-scale twin, BioVid's 87 names and subject set all87, 87 tested: a twin is never comparable
    twin87 = report_for(finished_cv_store, "loso", "synthetic87", "all87", subjects_tested=87)
    assert twin87["comparable"].empty
    assert set(twin87["shape"].authors) == LOSO_87_VIDEO
    assert "synthetic87 dataset, not BioVid" in twin87["reason"]

    # BioVid, 87 subjects tested under LOSO: the LOSO 87 video-only papers are comparable
    biovid = report_for(finished_cv_store, "loso", "biovid", "all87", subjects_tested=87)
    assert set(biovid["comparable"].authors) == LOSO_87_VIDEO and biovid["shape"].empty
    assert (biovid["comparable"].subjects == "87").all() and (biovid["comparable"].modality == "video").all()

    # BioVid, but face detection lost two subjects: 85 tested is not the papers' 87
    fewer = report_for(finished_cv_store, "loso", "biovid", "all87_usable", subjects_tested=85)
    assert fewer["comparable"].empty and set(fewer["shape"].authors) == LOSO_87_VIDEO
    assert "BL1 vs PA4: 85 tested, the papers 87" in fewer["reason"]


def test_a_literature_row_without_citation_or_with_a_range_is_an_error(tmp_path: Path) -> None:
    header = ",".join(LITERATURE_COLUMNS)
    path = tmp_path / "literature.csv"
    path.write_text(header + "\nbl1_vs_pa4,CNN,,,,holdout,87,video,frame,71,primary,\n")
    with pytest.raises(ValueError, match="line 2: no authors, year, venue"):
        read_literature(path)
    path.write_text(header + "\nfive_class,works,Someone,2020,a venue,loso,87,video,video,30-39,secondary,\n")
    with pytest.raises(ValueError, match="line 2: accuracy '30-39' is not one number"):
        read_literature(path)


def test_a_personalised_row_says_its_protocol_and_videos_and_is_never_set_beside_published_rows(
        finished_cv_store) -> None:
    """BioVid, 87 subjects tested under LOSO, but a baseline_k2 protocol: no paper's row is comparable; the table
    names the protocol with the videos it tested, and a plain run's rows read `none`."""
    client = finished_cv_store["client"]
    experiment_id = finished_cv_store["experiment_id"]
    tasks = ["bl1_vs_pa4", "five_class"]
    pooled = {"pooled/video_accuracy_at_threshold": 0.9, "data/subjects_tested": 87, "data/videos_tested": 3306}
    personal = {task: make_finished_cv(client, experiment_id, "mobilevit_xxs", task, "loso", pooled,
                                       personalise="baseline_k2") for task in tasks}
    rows = pd.DataFrame([project_row("mobilevit_xxs", task, client.get_run(personal[task])) for task in tasks])
    report = build_report(rows, ["mobilevit_xxs"], tasks, "biovid", "loso", "all87")
    assert report["comparable"].empty and set(report["shape"].authors) == LOSO_87_VIDEO
    assert "personalised (baseline_k2)" in report["reason"]
    assert any(note.startswith("personalised protocol (baseline_k2)") for note in report["notes"])
    assert report["ours"]["protocol"].tolist() == ["baseline_k2, 3306 videos tested"] * 2
    assert report["facts"]["protocol"].tolist() == ["baseline_k2"] * 2
    # the same numbers from a plain CV: the papers of its shape are comparable, its protocol `none`
    plain = report_for(finished_cv_store, "loso", "biovid", "all87", subjects_tested=87)
    assert set(plain["comparable"].authors) == LOSO_87_VIDEO
    assert plain["ours"]["protocol"].tolist() == ["none", "none"]
