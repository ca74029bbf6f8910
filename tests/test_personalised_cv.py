"""Personalisation protocols applied where they are trained: a frozen backbone's cached embeddings under a frame head
(`pipeline.data.embeddings.EmbeddingDataModule`). A baseline split never serves (nor tests) a reference video, each
crop is served minus its own person's reference mean, computed from that person's rows of the split; subject-normalised
statistics come from the person's own rows; a CV records what each split lost; a path that does not apply a protocol
is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.data.datamodule import ROLES
from pipeline.data.embeddings import EmbeddingDataModule, EmbeddingTable
from pipeline.data.personalise import PersonaliseConfig
from pipeline.data.prepare import fold_file_path
from pipeline.data.tasks import NO_PAIN, get_task
from pipeline.runs.jobs.fold_job import VIDEO_PREDICTIONS
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.paths import resolve_path
from tests.conftest import loader_config
from tests.test_embedding_cache import FROZEN

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DIMENSIONS = 6


class DataConfig:
    input_size, mean, std, interpolation, crop_pct = (3, 32, 32), (0.5,) * 3, (0.25,) * 3, "bicubic", 1.0


def embedding_table(processed: Path, seed: int = 0, views: int = 2) -> EmbeddingTable:
    """Embeddings of every frame-table row: a large offset per person, noise per crop (and per view)."""
    frames = pd.read_csv(processed / "frames.csv", dtype={"subject_name": str}, keep_default_na=False)
    rng = np.random.default_rng(seed)
    people = {person: rng.normal(0, 10, DIMENSIONS) for person in sorted(frames["subject_name"].unique())}
    offsets = np.stack([people[person] for person in frames["subject_name"]])
    plain = (offsets + rng.normal(0, 1, (len(frames), DIMENSIONS))).astype(np.float32)
    return EmbeddingTable(np.arange(len(frames), dtype=np.int64), plain,
                          (plain[None] + rng.normal(0, 0.1, (views, *plain.shape))).astype(np.float32))


def datamodule(cfg, table: EmbeddingTable, protocol: PersonaliseConfig) -> EmbeddingDataModule:
    data = EmbeddingDataModule(resolve_path(cfg.data.processed_dir), fold_file_path(cfg), 0, get_task("bl1_vs_pa4"),
                               DataConfig(), {}, loader_config(batch_size=4, num_workers=0), seed=0,
                               embeddings=table, source=Path("test.npz"), personalise=protocol)
    data.setup()
    return data


def served(data: EmbeddingDataModule, role: str) -> tuple[np.ndarray, np.ndarray]:
    dataset = data.dataset(role)
    return dataset.plain.numpy(), (dataset.views.numpy() if dataset.views is not None else None)


def test_a_baseline_split_serves_no_reference_and_each_crop_minus_its_own_persons_reference(tiny_config) -> None:
    cfg = tiny_config()
    table = embedding_table(resolve_path(cfg.data.processed_dir))
    plain = datamodule(cfg, table, PersonaliseConfig("none"))
    data = datamodule(cfg, table, PersonaliseConfig("baseline", k=1, seed=0))
    metrics = data.protocol_metrics()
    for role in ROLES:
        reference, rows = data.references[role], data.frames(role)
        videos = set(map(tuple, reference[["subject_name", "sample_name"]].to_numpy()))
        assert videos and not videos & set(map(tuple, rows[["subject_name", "sample_name"]].to_numpy()))
        assert (reference["class_name"] == NO_PAIN).all()
        assert reference.groupby("subject_name")["sample_name"].nunique().eq(1).all()  # k = 1 video a person
        assert set(reference["subject_name"]) == set(plain.frames(role)["subject_name"])  # every person has one
        assert len(rows) + len(reference) == len(plain.frames(role))  # nothing else left the split
        assert metrics[f"personalise/{role}_reference_videos"] == len(videos)
        assert metrics[f"personalise/{role}_videos"] == len(rows[["subject_name", "sample_name"]].drop_duplicates())
        # each crop (and each augmented view of a training crop) minus its person's reference mean of plain crops
        means = {person: table.plain[group.index.to_numpy()].mean(axis=0)
                 for person, group in reference.groupby("subject_name")}
        expected = np.stack([means[person] for person in rows["subject_name"]])
        got_plain, got_views = served(data, role)
        np.testing.assert_allclose(got_plain, table.plain[rows.index.to_numpy()] - expected, atol=1e-5)
        if role == "train":
            np.testing.assert_allclose(got_views, table.views[:, rows.index.to_numpy()] - expected, atol=1e-5)
        else:
            assert got_views is None  # validation and test are served the plain crop only
    # what the run's artifacts record: which videos were each split's references
    summary = data.split_summary()
    assert all(len(summary[role]["reference_videos"]) == metrics[f"personalise/{role}_reference_videos"]
               for role in ROLES)
    assert "reference_videos" not in plain.split_summary()["test"] and plain.protocol_metrics() == {}


def test_subject_normalised_statistics_of_a_person_come_from_their_own_rows_of_the_split(tiny_config) -> None:
    cfg = tiny_config()
    table = embedding_table(resolve_path(cfg.data.processed_dir))
    protocol = PersonaliseConfig("subject_normalised")
    data = datamodule(cfg, table, protocol)
    for role in ROLES:
        rows, (got, _) = data.frames(role), served(data, role)
        for person in rows["subject_name"].unique():
            mine = got[(rows["subject_name"] == person).to_numpy()]
            np.testing.assert_allclose(mine.mean(axis=0), 0, atol=1e-4)
            np.testing.assert_allclose(mine.std(axis=0), 1, atol=1e-4)
    # the other people's embeddings changed: a person's served embeddings stay as they were, the others' do not
    rows = data.frames("train")
    person = rows["subject_name"].iloc[0]
    changed = embedding_table(resolve_path(cfg.data.processed_dir))
    frames = pd.read_csv(resolve_path(cfg.data.processed_dir) / "frames.csv", dtype={"subject_name": str})
    others = (frames["subject_name"] != person).to_numpy()
    changed.plain[others] += np.random.default_rng(1).normal(0, 1, changed.plain[others].shape).astype(np.float32)
    again = datamodule(cfg, changed, protocol)
    mine = (rows["subject_name"] == person).to_numpy()
    assert mine.any() and (~mine).any()
    np.testing.assert_allclose(served(again, "train")[0][mine], served(data, "train")[0][mine], atol=1e-5)
    assert not np.allclose(served(again, "train")[0][~mine], served(data, "train")[0][~mine])


@pytest.fixture(scope="module")
def baseline_cv(tiny_config, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("personalised")
    store = (f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"mlflow.artifact_root={work / 'art'}",
             f"cv.work_dir={work / 'runs'}")
    cfg = tiny_config(*FROZEN, *store, "personalise=baseline", "personalise.k=1")
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = cv_runs.finished_cv(client, cfg)
    return {"cfg": cfg, "client": client, "parent": parent,
            "folds": tracking.fold_runs(client, parent.info.run_id)}


def test_a_baseline_cv_tests_no_reference_video_and_records_what_it_cost(baseline_cv) -> None:
    client, parent, fold = baseline_cv["client"], baseline_cv["parent"], baseline_cv["folds"][0]
    assert parent.data.tags[tracking.PERSONALISE_TAG] == "baseline_k1"
    splits = json.loads(Path(client.download_artifacts(fold.info.run_id, "splits.json")).read_text())
    references = set(splits["test"]["reference_videos"])
    assert references and len(references) == fold.data.metrics["personalise/test_reference_videos"]
    videos = pd.read_csv(client.download_artifacts(fold.info.run_id, VIDEO_PREDICTIONS),
                         dtype={"subject_name": str, "sample_name": str})
    tested = set(videos["subject_name"] + "/" + videos["sample_name"])
    assert tested and not tested & references
    assert len(tested) == fold.data.metrics["personalise/test_videos"]
    assert np.isfinite(fold.data.metrics["test/video_auroc"])


def test_a_path_that_does_not_apply_a_protocol_refuses_it(tiny_config) -> None:
    frozen_temporal = (*FROZEN, "personalise=subject_normalised", "model.head.name=gru", "model.head.mode=two_stage")
    with pytest.raises(ValueError, match=r"personalise=subject_normalised .* a temporal head \(model.head\) does "
                                         r"not apply it yet"):
        run_cv(tiny_config(*frozen_temporal))
    from_images = (*FROZEN, "personalise=subject_normalised", "cache.embeddings=false")
    with pytest.raises(ValueError, match=r"a backbone trained on images \(model.finetune\) does not apply it yet"):
        run_cv(tiny_config(*from_images))
