"""`make table` on the tiny twin: five tasks run (one fold, one epoch each), written beside the published rows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.analysis.benchmark_table import TASKS, describe_subject_set, read_literature, run_table
from tests.conftest import tiny_overrides
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
    assert table["task"].tolist() == list(TASKS)
    assert list(table.columns[1:]) == [f"mobilevit_xxs: {m}" for m in
                                       ("accuracy", "balanced accuracy", "AUROC within subject")]
    assert all("[" in text and "(incomplete)" in text for text in table["mobilevit_xxs: accuracy"])  # one fold only

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
    assert "20 who showed no facial response" in describe_subject_set("responders67")
    assert "face crops" in describe_subject_set("all87_usable")


def test_a_literature_row_of_another_width_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "literature.csv"
    path.write_text("task,method,protocol,subjects,input,accuracy,source,source_kind\n"
                    "bl1_vs_pa4,m,LOSO,87,video,70,a paper,secondary, unchecked\n")
    with pytest.raises(ValueError, match="line 2: 9 fields where the header has 8"):
        read_literature(path)
