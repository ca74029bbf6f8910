"""A fold run's records gathered and written at once (`RunRecord`), on a real sqlite store."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from pipeline.runs.store.run_record import MAX_ENTRIES, MAX_METRICS, MAX_PARAMS, MAX_TAGS, RunRecord, batches


def test_batches_stay_within_mlflows_limits_and_keep_every_entry() -> None:
    params, tags, metrics = list(range(150)), list(range(120)), list(range(1500))
    sent = list(batches(params, tags, metrics))
    assert len(sent) == 2  # 100 + 100 + 800, then 50 + 20 + 700
    for batch in sent:
        assert len(batch["params"]) <= MAX_PARAMS and len(batch["tags"]) <= MAX_TAGS
        assert len(batch["metrics"]) <= MAX_METRICS
        assert sum(map(len, batch.values())) <= MAX_ENTRIES
    assert [p for batch in sent for p in batch["params"]] == params
    assert [t for batch in sent for t in batch["tags"]] == tags
    assert [m for batch in sent for m in batch["metrics"]] == metrics


def test_what_a_run_gathered_is_written_by_flush_and_only_then(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("record", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(experiment)
    record = RunRecord(client, run.info.run_id, run.info.artifact_uri)
    record.log_params({f"p{i}": i for i in range(150)})
    record.log_params({"p0": "other"})  # a parameter keeps its first value (MLflow refuses to change one)
    record.set_tags({"kind": "first"})
    record.set_tags({"kind": "last"})  # a tag its last
    for epoch in range(600):
        record.log_metrics({"train/loss": 1 / (epoch + 1), "val/auroc": epoch / 600}, step=epoch)
    assert client.get_run(run.info.run_id).data.params == {}  # nothing written before flush

    assert record.flush() == 2  # 1350 entries: two log-batch requests, not 1,350 calls
    data = client.get_run(run.info.run_id).data
    assert data.params == {f"p{i}": str(i) for i in range(150)}
    assert data.tags["kind"] == "last"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(e, 1 / (e + 1)) for e in range(600)]
    assert record.flush() == 0  # forgotten once written

    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "table.csv").write_text("a,b\n1,2\n")
    record.log_artifacts(tmp_path / "files", "tables")  # straight to the run's artifact store
    assert [f.path for f in client.list_artifacts(run.info.run_id, "tables")] == ["tables/table.csv"]
