"""Personalisation protocols applied where they are trained: a frozen backbone's cached embeddings under a frame head
(`pipeline.data.embeddings.EmbeddingDataModule`). A baseline split never serves (nor tests) a reference video, each
crop is served minus its own person's reference mean, computed from that person's rows of the split; subject-normalised
statistics come from the person's own rows; a CV records what each split lost; a path that does not apply a protocol
is refused. A personalised CV's final model scores a person against their own recordings (`make predict
REFERENCE=`), says what to give without them, and is neither served nor exported."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipeline.data.datamodule import ROLES, SubjectRoles
from pipeline.data.embeddings import EmbeddingDataModule, EmbeddingTable
from pipeline.data.personalise import PersonaliseConfig
from pipeline.data.tasks import NO_PAIN, get_task
from pipeline.deployment.export import run_export
from pipeline.deployment.final_model import run_final
from pipeline.deployment.predict import find_scorer, run_predict
from pipeline.deployment.reference import attach_reference, video_embeddings
from pipeline.deployment.serving import guarded_app, limits_of
from pipeline.deployment.video_frames import PredictError, sampled_frames
from pipeline.models.head_training import embedded_clips
from pipeline.models.scoring import FrameScorer
from pipeline.models.temporal_heads import ClipNet
from pipeline.runs.jobs.sealing import VIDEO_PREDICTIONS
from pipeline.runs.jobs.two_stage import split_embeddings
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.serving.mlflow_model import encode_image, synthetic_frames
from pipeline.runs.store import cv_runs, tracking
from pipeline.utils.paths import resolve_path
from tests.conftest import loader_config, scorer_source
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
    data = EmbeddingDataModule(resolve_path(cfg.data.processed_dir),
                               SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                               get_task("bl1_vs_pa4"), DataConfig(), {}, loader_config(batch_size=4, num_workers=0),
                               seed=0,
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
    parent = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(cfg))
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
    from_images = (*FROZEN, "personalise=subject_normalised", "cache.embeddings=false")
    with pytest.raises(ValueError, match=r"a backbone trained on images \(model.finetune\) does not apply it yet"):
        run_cv(tiny_config(*from_images))
    trained = ("model=mobilevit_xxs", "model.finetune=full", "personalise=subject_normalised")
    with pytest.raises(ValueError, match=r"personalise=subject_normalised .* does not apply it yet"):
        run_cv(tiny_config(*trained))


def test_a_two_stage_heads_clips_are_made_of_the_personalised_embeddings_without_references(tiny_config) -> None:
    """A temporal head's second stage reads each split's crops as the frame head does: a baseline's reference crops
    out of the split, every other crop minus its person's reference mean."""
    cfg = tiny_config()
    table = embedding_table(resolve_path(cfg.data.processed_dir))
    data = datamodule(cfg, table, PersonaliseConfig("baseline", k=1, seed=0))
    plain = datamodule(cfg, table, PersonaliseConfig("none"))
    assert split_embeddings(plain, "test", table) is table  # a plain fold's clips are the frame model's embeddings
    for role in ROLES:
        rows, reference = data.frames(role), data.references[role]
        clips = embedded_clips(rows, split_embeddings(data, role, table), 3, Path("test.npz"))
        taken = {row for video in clips.videos["rows"] for row in video}
        assert taken <= set(rows.index) and not taken & set(reference.index)
        means = {person: table.plain[group.index.to_numpy()].mean(axis=0)
                 for person, group in reference.groupby("subject_name")}
        first = np.asarray(clips.videos["rows"].iloc[0])
        person = rows.loc[first[0], "subject_name"]
        np.testing.assert_allclose(clips.embeddings[0].numpy(), table.plain[first] - means[person], atol=1e-5)


def test_a_personalised_two_stage_cv_keeps_a_clip_model_that_scores_against_the_reference(tiny_config,
                                                                                          tmp_path: Path) -> None:
    cfg = tiny_config(*FROZEN, "personalise=baseline", "personalise.k=1", "model.head.name=gru",
                      "model.head.mode=two_stage", "model.head.hidden=8", "model.head.epochs=2", "loader.clip_frames=3",
                      "cv.log_models=true", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                      f"mlflow.artifact_root={tmp_path / 'art'}", f"cv.work_dir={tmp_path / 'runs'}")
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = cv_runs.finished_cv(client, cv_runs.CvConfig.from_config(cfg))
    assert parent.data.tags[tracking.PERSONALISE_TAG] == "baseline_k1"
    fold = tracking.fold_runs(client, parent.info.run_id)[0]
    splits = json.loads(Path(client.download_artifacts(fold.info.run_id, "splits.json")).read_text())
    videos = pd.read_csv(client.download_artifacts(fold.info.run_id, VIDEO_PREDICTIONS),
                         dtype={"subject_name": str, "sample_name": str})
    tested = set(videos["subject_name"] + "/" + videos["sample_name"])
    assert tested and not tested & set(splits["test"]["reference_videos"])
    scorer, _ = find_scorer(scorer_source(cfg), run=fold.info.run_id)
    assert isinstance(scorer.net, ClipNet) and scorer.personalise.label == "baseline_k1"
    person = sorted(Path(cfg.data.root, "video").iterdir())[0]
    reference = tmp_path / "rest"
    reference.mkdir()
    (reference / "rest.mp4").symlink_to(sorted(person.glob(f"*-{NO_PAIN}-*.mp4"))[0])
    frames = list(next(sampled_frames(sorted(person.glob("*-PA4-*.mp4"))[0], 5.0))[2][:6])
    with pytest.raises(ValueError, match=r"personalised \(baseline_k1"):
        scorer.score(frames)
    attach_reference(scorer, str(reference), 5.0)
    table = scorer.score(frames)
    found = table[table["face_found"].astype(bool)]
    assert len(found) >= 4
    # the window's embeddings are the crops' features minus the reference mean: the last window by hand
    follower = scorer.follower()
    faces = [follower.step(face) for face in scorer.find_faces(frames)]
    crops = [scorer.crop(frame, face) for frame, face in zip(frames, faces, strict=True) if face is not None]
    features = torch.as_tensor(scorer.embeddings(crops) - scorer.reference.mean, dtype=torch.float32)
    window = follower.window
    for feature in features:
        clip = window.add(feature, None)
    with torch.inference_mode():
        last = scorer.net.forward_embeddings(torch.stack(clip)[None]).softmax(dim=1).numpy()[0]
    np.testing.assert_allclose(found[[f"prob_{name}" for name in scorer.class_names]].to_numpy()[-1], last,
                               atol=1e-5)


@pytest.fixture(scope="module")
def personal_final(baseline_cv, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The baseline CV's final model (kept, registered), and one twin person's videos: two resting ones as their
    reference folder, a PA4 one to score."""
    cfg = baseline_cv["cfg"]
    final = run_final(cfg)
    person = sorted(Path(cfg.data.root, "video").iterdir())[0]
    videos = sorted(person.glob("*.mp4"))
    reference = tmp_path_factory.mktemp("reference")
    for video in [v for v in videos if f"-{NO_PAIN}-" in v.name][:2]:
        (reference / video.name).symlink_to(video)
    return {"cfg": cfg, "final": final, "reference": reference,
            "pain": next(v for v in videos if "-PA4-" in v.name)}


def test_a_personalised_final_model_scores_a_person_against_their_reference_and_only_with_one(
        personal_final, tmp_path: Path) -> None:
    cfg, uri, reference = personal_final["cfg"], personal_final["final"]["model_uri"], personal_final["reference"]
    pain = str(personal_final["pain"])
    scorer, _ = find_scorer(scorer_source(cfg), uri)
    assert scorer.personalise == PersonaliseConfig("baseline", k=1, seed=int(cfg.personalise.seed))
    with pytest.raises(SystemExit, match=r"personalised \(baseline_k1, the person's resting \(BL1\) recordings.*"
                                         r"REFERENCE=<folder of the person's recordings>"):
        run_predict(cfg, video=pain, model_uri=uri, out=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="personalised"):  # a scorer never scores without its person
        scorer.class_probabilities([np.zeros((32, 32, 3), np.uint8)])
    summary = run_predict(cfg, video=pain, model_uri=uri, out=str(tmp_path / "out"), reference=str(reference))
    frames = pd.read_csv(tmp_path / "out" / f"{Path(pain).name}.csv")
    assert summary is not None and frames["face_found"].any()

    # each crop is scored as head(features - the mean of the reference videos' features), at predict's frame rate
    said = attach_reference(scorer, str(reference), float(cfg.predict.fps))
    assert said and "2 recordings" in said
    fps = float(cfg.predict.fps)
    rest = np.concatenate([video_embeddings(scorer, path, fps) for path in sorted(reference.iterdir())])
    np.testing.assert_allclose(scorer.reference.mean, rest.mean(axis=0), rtol=1e-5, atol=1e-6)
    chunk = next(sampled_frames(Path(pain), float(cfg.predict.fps)))[2]
    follower = scorer.follower()
    faces = [follower.step(found) for found in scorer.find_faces(chunk)]
    crops = [scorer.crop(frame, face) for frame, face in zip(chunk, faces, strict=True) if face is not None]
    with torch.inference_mode():
        logits = scorer.net.head(torch.as_tensor(scorer.embeddings(crops) - rest.mean(axis=0), dtype=torch.float32))
    np.testing.assert_allclose(scorer.class_probabilities(crops), logits.softmax(dim=1).numpy(), atol=1e-5)
    np.testing.assert_allclose(frames.loc[frames["face_found"], "pain_probability"].to_numpy()[:len(crops)],
                               scorer.probabilities(crops), atol=1e-5)  # what predict wrote
    # another person's reference moves the scores: the reference is used, not decoration
    other = Path(cfg.data.root, "video").iterdir()
    stranger = sorted(sorted(other)[1].glob(f"*-{NO_PAIN}-*.mp4"))[0]
    np.save(tmp_path / "stranger.npy", video_embeddings(scorer, stranger, float(cfg.predict.fps)))
    (tmp_path / "stranger_only").mkdir()
    (tmp_path / "stranger.npy").rename(tmp_path / "stranger_only" / "stranger.npy")
    attach_reference(scorer, str(tmp_path / "stranger_only"), float(cfg.predict.fps))
    assert not np.allclose(scorer.class_probabilities(crops), logits.softmax(dim=1).numpy(), atol=1e-4)


def test_a_personalised_model_is_not_served_or_exported_and_a_plain_one_takes_no_reference(
        personal_final, tmp_path: Path) -> None:
    cfg, uri, reference = personal_final["cfg"], personal_final["final"]["model_uri"], personal_final["reference"]
    with pytest.raises(SystemExit, match=r"export: .*personalised \(baseline_k1\).*make predict REFERENCE="):
        run_export(cfg, model_uri=uri, out=str(tmp_path / "export"))
    local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "model"))
    with pytest.raises(SystemExit, match=r"serve: .*personalised \(baseline_k1\).*scoring request"):
        guarded_app(local, limits_of(cfg.serve))
    served = mlflow.pyfunc.load_model(local)  # as `mlflow models serve` loads it: every request is told why
    with pytest.raises(MlflowException, match=r"personalised \(baseline_k1\)"):
        served.predict(pd.DataFrame({"image": [encode_image(frame) for frame in synthetic_frames(1)]}))
    scorer, _ = find_scorer(scorer_source(cfg), uri)
    meta = {key: value for key, value in scorer.meta.items() if key != "personalise"}
    plain = FrameScorer(scorer.net, meta, scorer.settings, aggregation=scorer.aggregation, topk=scorer.topk)
    with pytest.raises(PredictError, match=r"REFERENCE=.*not personalised \(personalise=none\)"):
        attach_reference(plain, str(reference), 5.0)
    assert attach_reference(plain, None, 5.0) is None
    with pytest.raises(PredictError, match=r"reference folder .* holds no recordings"):
        attach_reference(scorer, str(tmp_path), 5.0)
