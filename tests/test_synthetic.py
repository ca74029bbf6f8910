"""The synthetic twin: BioVid's layout, real mp4 read back by OpenCV, determinism, resuming, detectable faces, pain;
the hard look (pose with pain, per-class detection rates) and the PSPI regions that map into the crops."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest

from pipeline.data.biovid import load_samples
from pipeline.data.crop_geometry import CANONICAL_LANDMARKS
from pipeline.data.face_crops import FRAME_COLUMNS, preprocess, video_to_crop
from pipeline.data.faces import HaarFaceDetector, MTCNNFaceDetector, detection_rate
from pipeline.data.prepare import preprocess_config
from pipeline.data.synthetic import (
    CONFIG_JSON,
    PRESETS,
    REGIONS,
    REGIONS_DIR,
    SAMPLE_TRUTH_CSV,
    SUBJECTS_CSV,
    SyntheticConfig,
    animate,
    generate,
    make_samples,
    make_subjects,
    regions_path,
)
from pipeline.data.tasks import CLASS_NAMES
from pipeline.data.video import read_frames
from pipeline.utils.config import load_config

# small tensors: one torch thread (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = PRESETS["tiny"]
SAMPLES_COLUMNS = ["subject_id", "subject_name", "class_id", "class_name", "sample_id", "sample_name"]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """The tiny twin, written with two worker processes."""
    root = tmp_path_factory.mktemp("synthetic") / "tiny"
    generate(root, TINY, workers=2, progress=False)
    return root


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory) -> Path:
    """The same twin again, written in-process: must come out identical."""
    root = tmp_path_factory.mktemp("synthetic_copy") / "tiny"
    generate(root, TINY, workers=1, progress=False)
    return root


def _samples(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / "starting_point" / "samples.csv", sep="\t")


def _video(root: Path, row) -> Path:
    return root / "video" / row.subject_name / f"{row.sample_name}.mp4"


def test_layout_and_samples_csv(tiny_root):
    assert sorted(p.name for p in tiny_root.iterdir()) == sorted(
        [CONFIG_JSON, REGIONS_DIR, SAMPLE_TRUTH_CSV, SUBJECTS_CSV, "starting_point", "video"]
    )
    assert [p.name for p in (tiny_root / "starting_point").iterdir()] == ["samples.csv"]
    header = (tiny_root / "starting_point" / "samples.csv").read_text().splitlines()[0]
    assert header.split("\t") == SAMPLES_COLUMNS
    samples = _samples(tiny_root)
    assert list(samples.columns) == SAMPLES_COLUMNS
    assert len(samples) == TINY.n_subjects * len(CLASS_NAMES) * TINY.samples_per_class
    assert samples.sample_id.tolist() == list(range(len(samples)))
    assert sorted(samples.class_name.unique()) == list(CLASS_NAMES)
    assert (samples.class_name.map(CLASS_NAMES.index) == samples.class_id).all()
    assert samples.subject_name.nunique() == TINY.n_subjects
    assert samples.groupby("subject_name").subject_id.nunique().eq(1).all()
    assert samples.groupby(["subject_name", "class_name"]).size().eq(TINY.samples_per_class).all()
    for row in samples.itertuples():
        match = re.fullmatch(r"(\d{2})(\d{2})(\d{2})_([wm])_(\d{2})", row.subject_name)
        assert match, row.subject_name
        month, day, _, _, age = (int(g) if g.isdigit() else g for g in match.groups())
        assert 1 <= month <= 12 and 1 <= day <= 31 and 18 <= age <= 65
        assert re.fullmatch(rf"{row.subject_name}-{row.class_name}-\d{{3}}", row.sample_name), row.sample_name
        assert _video(tiny_root, row).is_file()
    numbers = samples.sample_name.str[-3:].astype(int)
    per_subject = len(CLASS_NAMES) * TINY.samples_per_class
    for _, group in numbers.groupby(samples.subject_name):
        assert sorted(group) == list(range(1, per_subject + 1))  # a running number per subject
    # Shuffled like a presentation order, not BL1 first then PA1 ...
    assert not all(sorted(g) == g.tolist() for _, g in numbers.groupby(samples.subject_name))


def test_no_temporary_or_unlisted_files(tiny_root):
    listed = {_video(tiny_root, row) for row in _samples(tiny_root).itertuples()}
    on_disk = {p for p in (tiny_root / "video").rglob("*") if p.is_file()}
    assert on_disk == listed
    assert not [p for p in tiny_root.rglob(".*")]


def test_videos_read_back_with_opencv(tiny_root):
    samples = _samples(tiny_root)
    for row in samples.iloc[:: len(samples) // 5].itertuples():
        capture = cv2.VideoCapture(str(_video(tiny_root, row)))
        assert capture.isOpened()
        assert capture.get(cv2.CAP_PROP_FPS) == pytest.approx(25.0)
        frames = []
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(frame)
        capture.release()
        assert len(frames) == TINY.n_frames == 138
        assert frames[0].shape == (TINY.height, TINY.width, 3)


def test_ground_truth_tables(tiny_root):
    subjects = pd.read_csv(tiny_root / SUBJECTS_CSV)
    samples = _samples(tiny_root)
    assert sorted(subjects.subject_name) == sorted(samples.subject_name.unique())
    assert (~subjects.responder).sum() == round(TINY.n_subjects * TINY.non_responder_fraction)
    assert subjects.expressiveness[~subjects.responder].max() < subjects.expressiveness[subjects.responder].min()
    truth = pd.read_csv(tiny_root / SAMPLE_TRUTH_CSV)
    assert truth.sample_name.tolist() == samples.sample_name.tolist()
    assert (truth.intensity[truth.class_name == "BL1"] == 0).all()
    assert json.loads((tiny_root / CONFIG_JSON).read_text())["seed"] == TINY.seed


def _first_frame(path: Path) -> np.ndarray:
    return read_frames(path, [0])[0]


def test_same_seed_gives_identical_data(tiny_root, tiny_copy):
    assert (tiny_root / "starting_point" / "samples.csv").read_bytes() == (
        tiny_copy / "starting_point" / "samples.csv"
    ).read_bytes()
    assert (tiny_root / SUBJECTS_CSV).read_bytes() == (tiny_copy / SUBJECTS_CSV).read_bytes()
    for row in _samples(tiny_root).iloc[[0, 17, -1]].itertuples():
        a, b = read_frames(_video(tiny_root, row), [0, 100]), read_frames(_video(tiny_copy, row), [0, 100])
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[100], b[100])


def test_another_seed_gives_other_data(tiny_root, tmp_path):
    other = dataclasses.replace(TINY, seed=1, n_subjects=1, samples_per_class=1)
    table = generate(tmp_path / "other", other, workers=1, progress=False)
    assert not set(table.subject_name) & set(_samples(tiny_root).subject_name)
    first_other = _first_frame(_video(tmp_path / "other", next(table.itertuples())))
    first_tiny = _first_frame(_video(tiny_root, next(_samples(tiny_root).itertuples())))
    assert np.abs(first_other.astype(int) - first_tiny).mean() > 5


def test_resume_rewrites_nothing_and_fills_gaps(tiny_copy):
    files = sorted(p for p in tiny_copy.rglob("*") if p.is_file())
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    table = generate(tiny_copy, TINY, workers=2, progress=False)
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes
    pd.testing.assert_frame_equal(table, _samples(tiny_copy))

    # A video lost (and a temp file left by a killed run) is written again, identical, and nothing else is touched.
    row = next(table.iloc[3:].itertuples())
    video = _video(tiny_copy, row)
    before = read_frames(video, [0, 60])
    video.unlink()
    stale = video.parent / f".{video.stem}.killed.mp4"
    stale.write_bytes(b"half a video")
    generate(tiny_copy, TINY, workers=1, progress=False)
    after = read_frames(video, [0, 60])
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[60], after[60])
    assert not stale.exists()
    assert {p: p.stat().st_mtime_ns for p in files if p != video} == {p: t for p, t in mtimes.items() if p != video}


def test_resuming_with_another_config_refuses(tiny_root):
    with pytest.raises(ValueError, match=CONFIG_JSON):
        generate(tiny_root, dataclasses.replace(TINY, seed=7), workers=1, progress=False)


def test_refuses_to_write_into_a_folder_that_is_not_a_synthetic_twin(tmp_path):
    (tmp_path / "starting_point").mkdir()
    (tmp_path / "starting_point" / "samples.csv").write_text("subject_id\tsubject_name\n")
    with pytest.raises(ValueError, match="not a synthetic twin"):
        generate(tmp_path, TINY, workers=1, progress=False)
    assert not (tmp_path / "video").exists()


def test_haar_finds_the_faces(tiny_root):
    samples = _samples(tiny_root)
    result = detection_rate(
        [_video(tiny_root, row) for row in samples.itertuples()], HaarFaceDetector(), frames_per_video=8, start_s=2.0
    )
    assert result["n_frames"] == 8 * len(samples)
    assert result["overall"] >= 0.95
    per_class = (
        samples.assign(rate=[result["per_video"][str(_video(tiny_root, row))] for row in samples.itertuples()])
        .groupby("class_name")
        .rate.mean()
    )
    assert (per_class >= 0.9).all(), per_class


def _aligned_difference(reference: np.ndarray, other: np.ndarray, box, reach: int = 3) -> float:
    """Mean absolute difference over the face box, at the best shift of `other` within +-reach pixels.

    Two clips of one person differ by a pixel or two of head position, which at this size moves every edge; the
    best shift takes that out, so what remains is what the face itself does.
    """
    x, y, w, h = box
    face = reference[y : y + h, x : x + w].astype(np.float32)
    return min(
        float(np.abs(other[y + dy : y + dy + h, x + dx : x + dx + w].astype(np.float32) - face).mean())
        for dy in range(-reach, reach + 1)
        for dx in range(-reach, reach + 1)
    )


def test_pain_visibly_changes_the_face(tiny_root):
    """At the response peak, a responder's PA4 face differs from their BL1 face more than two BL1 faces differ."""
    detector = HaarFaceDetector()
    truth = pd.read_csv(tiny_root / SAMPLE_TRUTH_CSV)
    responders = pd.read_csv(tiny_root / SUBJECTS_CSV).query("responder").subject_name
    assert len(responders) >= 3
    pain_differences, baseline_differences = [], []
    for subject in responders:
        own = truth[truth.subject_name == subject]
        strongest = own[own.class_name == "PA4"].sort_values("intensity").iloc[-1]
        baseline_a, baseline_b = own[own.class_name == "BL1"].sample_name.iloc[:2]
        peak = round(strongest.peak_s * TINY.fps)
        frames = {
            name: read_frames(tiny_root / "video" / subject / f"{name}.mp4", [peak])[peak]
            for name in (baseline_a, baseline_b, strongest.sample_name)
        }
        box = detector.detect(frames[baseline_a])
        assert box is not None, (baseline_a, peak)
        smooth = {name: cv2.GaussianBlur(frame, (0, 0), 1.0) for name, frame in frames.items()}  # sensor noise
        pain_differences.append(_aligned_difference(smooth[baseline_a], smooth[strongest.sample_name], box))
        baseline_differences.append(_aligned_difference(smooth[baseline_a], smooth[baseline_b], box))
    assert np.mean(pain_differences) > 1.2 * np.mean(baseline_differences), (pain_differences, baseline_differences)


def test_pain_response_grows_with_class_and_lags_the_onset():
    config = PRESETS["default"]
    subjects = make_subjects(config)
    samples = make_samples(config, subjects)
    mean_intensity = pd.Series(
        {c: np.mean([s.intensity for s in samples if s.class_id == c]) for c in range(len(CLASS_NAMES))}
    )
    assert mean_intensity[0] == 0 and mean_intensity.is_monotonic_increasing and mean_intensity.is_unique
    responder = next(s for s in subjects if s.responder)
    strong = max(
        (s for s in samples if s.subject_id == responder.subject_id and s.class_id == 4), key=lambda s: s.intensity
    )
    action_units, pose = animate(config, responder, strong, np.random.default_rng(0))
    assert action_units.shape == (config.n_frames, 4) and pose.shape == (config.n_frames, 5)
    assert (pose[:, 4] == 0).all()  # no yaw in the classic look
    brow_lowering = action_units[:, 0]
    early, peak = brow_lowering[: round(1.5 * config.fps)], brow_lowering[round(strong.peak_s * config.fps)]
    assert early.max() < 0.25 < peak
    assert np.argmax(brow_lowering) > round(strong.onset_s * config.fps)


def test_presets_and_config_checks():
    full = PRESETS["full"]
    assert (full.n_subjects, full.samples_per_class, full.width, full.height) == (87, 20, 1388, 1038)
    assert set(PRESETS) >= {"tiny", "default", "full"}
    with pytest.raises(ValueError, match="even"):
        SyntheticConfig(n_subjects=2, samples_per_class=1, width=161, height=120)
    with pytest.raises(ValueError, match="class_intensity"):
        SyntheticConfig(n_subjects=2, samples_per_class=1, width=160, height=120, class_intensity=(0.0, 1.0))


def test_a_twin_written_before_difficulty_existed_is_resumed(tmp_path):
    small = dataclasses.replace(TINY, n_subjects=1, samples_per_class=1)
    generate(tmp_path, small, workers=1, progress=False)
    config = json.loads((tmp_path / CONFIG_JSON).read_text())
    del config["difficulty"]  # as written before the hard look existed
    (tmp_path / CONFIG_JSON).write_text(json.dumps(config))
    video = next((tmp_path / "video").rglob("*.mp4"))
    before = video.stat().st_mtime_ns
    generate(tmp_path, small, workers=1, progress=False)
    assert video.stat().st_mtime_ns == before
    with pytest.raises(ValueError, match=f"{CONFIG_JSON}.*difficulty: 'classic' -> 'hard'.*make clean-data"):
        generate(tmp_path, dataclasses.replace(small, difficulty="hard"), workers=1, progress=False)
    with pytest.raises(ValueError, match="difficulty"):
        dataclasses.replace(small, difficulty="harder")


# --- the hard look --------------------------------------------------------------------------------------------------
HARD = SyntheticConfig(n_subjects=3, samples_per_class=1, width=320, height=240, difficulty="hard")


@pytest.fixture(scope="module")
def hard_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic_hard") / "hard"
    generate(root, HARD, workers=2, progress=False)
    return root


def _regions(root: Path, row) -> pd.DataFrame:
    return pd.read_csv(regions_path(root, row.subject_name, row.sample_name))


def test_hard_faces_vary_in_size_and_move_with_pain(hard_root):
    subjects = pd.read_csv(hard_root / SUBJECTS_CSV)
    face_height = 2 * subjects.face_scale * subjects.face_aspect  # forehead to chin, as a share of the frame height
    assert face_height.between(0.15, 0.35).all() and face_height.max() - face_height.min() > 0.03
    assert (subjects.clutter > 0).all()
    for row in _samples(hard_root).itertuples():  # the recorded pose stays in range
        regions = _regions(hard_root, row)
        assert len(regions) == HARD.n_frames
        assert regions.roll_deg.abs().max() <= 20 and regions.yaw_deg.abs().max() <= 25
    # Over the default-size roster: from rest to the response's peak, the head turns far more in PA4 than in BL1.
    config = dataclasses.replace(PRESETS["default"], difficulty="hard")
    roster = make_subjects(config)
    turns = {0: [], 4: []}
    for sample in make_samples(config, roster):
        if sample.class_id in turns and roster[sample.subject_id].responder:
            _, pose = animate(config, roster[sample.subject_id], sample, np.random.default_rng(0))
            peak = round(sample.peak_s * config.fps)
            turns[sample.class_id].append(np.degrees(np.abs(pose[peak, [2, 4]] - pose[:25, [2, 4]].mean(0))).sum())
    assert np.mean(turns[4]) > np.mean(turns[0]) + 8, (np.mean(turns[4]), np.mean(turns[0]))


def test_mtcnn_finds_the_hard_faces_in_every_class(hard_root):
    samples = _samples(hard_root)
    detector = MTCNNFaceDetector(device="cpu")
    rates = {}
    for class_name, group in samples.groupby("class_name"):
        videos = [_video(hard_root, row) for row in group.itertuples()]
        rates[class_name] = detection_rate(videos, detector, frames_per_video=4)["overall"]
    assert min(rates.values()) >= 0.95, rates
    assert max(rates["BL1"] - rate for rate in rates.values()) <= 0.05, rates  # pain frames not lost more often


def test_regions_map_onto_the_right_place_of_the_crop(hard_root, tmp_path):
    """The generator's eye and brow regions, mapped through each crop's recorded transform, land where the aligned
    crop puts the eyes (found by MTCNN from the pixels) and above them."""
    config = dataclasses.replace(preprocess_config(load_config().preprocess), detector="mtcnn", align=True,
                                 frames_per_video=3, crop_size=96)
    samples, _ = load_samples(hard_root)
    samples = samples[samples.class_name.isin(["BL1", "PA4"])]
    result = preprocess(samples, tmp_path, config, workers=1, progress=False, device="cpu")
    assert result.failures.empty and list(result.frames.columns) == list(FRAME_COLUMNS)
    eye_line = (CANONICAL_LANDMARKS[:2].mean(0) + 0.2) / 1.4 * 96
    for row in result.frames.itertuples(index=False):
        regions = _regions(hard_root, row).set_index("frame_index").loc[row.frame_index]
        centre = {name: [(regions[f"{name}_x0"] + regions[f"{name}_x1"]) / 2,
                         (regions[f"{name}_y0"] + regions[f"{name}_y1"]) / 2] for name in REGIONS}
        in_crop = {name: video_to_crop(row._asdict(), np.array([point]))[0] for name, point in centre.items()}
        assert np.hypot(*(in_crop["eyes"] - eye_line)) < 0.1 * 96, (row.sample_name, in_crop["eyes"], eye_line)
        assert in_crop["brows"][1] < in_crop["eyes"][1] - 0.05 * 96
        assert in_crop["nose_lip"][1] > in_crop["eyes"][1] + 0.1 * 96


# --- the BioVid-scale twin and its planted effects -------------------------------------------------------------------
def test_the_biovid_scale_twin_has_part_as_people_and_its_fold_files_apply():
    """DATA=synthetic87: Part A's 87 names and 20 non-responders, so BioVid's committed kfold5 file (87 people, at
    least 10 inner validation subjects a fold) is the twin's own."""
    from pipeline.data.biovid import NON_RESPONDERS
    from pipeline.data.biovid_folds import biovid_subjects
    from pipeline.data.fold_files import read_folds
    from pipeline.data.prepare import synthetic_config

    cfg = load_config(["data=synthetic87"])
    config = synthetic_config(cfg.data.synthetic)
    subjects = make_subjects(config)
    assert [s.subject_name for s in subjects] == biovid_subjects("all87")
    assert {s.subject_name for s in subjects if not s.responder} == NON_RESPONDERS
    assert len(make_samples(config, subjects)) == 87 * 5 * config.samples_per_class
    folds = read_folds(Path(cfg.fold_file))
    assert folds.subject_name.nunique() == 87
    assert folds[folds.role == "val"].groupby("fold").size().min() >= 10
    with pytest.raises(ValueError, match="87 people"):
        dataclasses.replace(config, n_subjects=20)


def _effect_twin(effect: str, **changes) -> tuple[SyntheticConfig, list, list]:
    from pipeline.data.synthetic.settings import with_effect

    config = dataclasses.replace(with_effect(PRESETS["biovid87"], effect), samples_per_class=3, **changes)
    subjects = make_subjects(config)
    return config, subjects, make_samples(config, subjects)


def _action_units(config, subject, sample) -> np.ndarray:
    from pipeline.data.synthetic.settings import VIDEO_STREAM, seeded_rng

    rng = seeded_rng(config.seed, VIDEO_STREAM, subject.subject_id, sample.number, 1)
    return animate(config, subject, sample, rng)[0]


def test_the_temporal_cue_is_the_same_burst_in_every_class_only_its_timing_differs():
    """The temporal twin: every video shows one burst of the planted peak; a responder's pain video has it within
    the stimulus-locked window, every other video anywhere in the rest window. A single frame cannot tell the classes
    apart (the brow lowering a video reaches is the same in both), its timing can."""
    config, subjects, samples = _effect_twin("temporal")
    by_id = {s.subject_id: s for s in subjects}
    peaks, starts = {"BL1": [], "PA4": []}, {"locked": [], "rest": []}
    for sample in samples:
        if CLASS_NAMES[sample.class_id] not in ("BL1", "PA4"):
            continue
        subject = by_id[sample.subject_id]
        units = _action_units(config, subject, sample)
        t = np.arange(config.n_frames) / config.fps
        inside = (t >= sample.burst_start_s) & (t <= sample.burst_start_s + config.burst_s)
        # the burst, seen through the person's AU4 weight, reaches the planted peak (fidgeting adds at most 0.15)
        peak = units[inside, 0].max() / subject.au_weights[0]
        assert config.burst_amplitude - 0.02 <= peak <= config.burst_amplitude + 0.15 / subject.au_weights[0]
        peaks[CLASS_NAMES[sample.class_id]].append(peak)
        starts["locked" if sample.burst_locked else "rest"].append(sample.burst_start_s)
        assert not sample.burst_locked or (sample.class_id > 0 and subject.responder)
    low, high = config.burst_pain_window_s
    assert starts["locked"] and all(low <= s <= high for s in starts["locked"])
    assert np.ptp(starts["rest"]) > 2.0  # spread over the rest window
    assert abs(np.mean(peaks["BL1"]) - np.mean(peaks["PA4"])) < 0.02  # the same burst in both classes
    assert all(s.intensity == 0 for s in samples)  # and no other pain response


def test_the_person_baseline_is_the_persons_resting_face_in_every_video():
    """The baseline twin: each person's resting brow lowering and orbit tightening, drawn once per person, sits in
    every frame of every video of theirs; everything else is drawn as without it."""
    config, subjects, samples = _effect_twin("baseline")
    plain, plain_subjects, _ = _effect_twin("baseline", resting_au_sd=0.0)
    offsets = np.array([s.resting_au for s in subjects])
    assert (offsets > 0).all() and 0.1 < offsets.std() < 0.4
    for sample in samples[::40]:
        with_offset = _action_units(config, subjects[sample.subject_id], sample)
        without = _action_units(plain, plain_subjects[sample.subject_id], sample)
        expected = np.clip(without[:, :2] + offsets[sample.subject_id], 0, 1)
        assert np.allclose(with_offset[:, :2], expected, atol=1e-12)
        assert np.array_equal(with_offset[:, 2:], without[:, 2:])


def test_the_response_share_is_the_share_of_a_responders_clips_that_show_one_and_the_rest_show_none():
    """The calibrated twin's knob (`response_probability`, per class): a responder's clip of class k shows the
    response in about that share of clips and nothing at all in the others, whose temporal-cue burst is not locked to
    the stimulus either; the draws of every other clip stay as without it."""
    from pipeline.data.synthetic.settings import with_effect

    shares = (0.0, 0.1, 0.3, 0.5, 0.9)
    config = dataclasses.replace(with_effect(PRESETS["biovid87"], "all"), samples_per_class=10,
                                 response_probability=shares)
    subjects = make_subjects(config)
    samples = make_samples(config, subjects)
    plain = make_samples(dataclasses.replace(config, response_probability=None), subjects)
    responders = {s.subject_id for s in subjects if s.responder}
    for class_id in range(1, 5):
        mine = [s for s in samples if s.class_id == class_id and s.subject_id in responders]
        shown = np.array([s.intensity > 0 for s in mine])
        assert abs(shown.mean() - shares[class_id]) < 0.06, (class_id, shown.mean())
        assert all(s.burst_locked == (s.intensity > 0) for s in mine)
    for sample, before in zip(samples, plain, strict=True):  # a shown response is the same draw as before
        assert sample.onset_s == before.onset_s and sample.peak_s == before.peak_s
        if sample.intensity > 0 and before.intensity > 0 and before.burst_locked:
            assert sample.intensity == before.intensity
    with pytest.raises(ValueError, match="one share in"):
        dataclasses.replace(config, response_probability=(0.5,) * 4)


def test_a_twin_without_planted_effects_records_its_config_as_before():
    """A twin written before the effects existed keeps its synthetic_config.json byte for byte, so its crops stay
    valid; a twin with an effect records every planted size."""
    from pipeline.data.synthetic.dataset import recorded_settings
    from pipeline.data.synthetic.settings import EFFECT_SETTINGS, with_effect

    assert not set(recorded_settings(PRESETS["default"])) & set(EFFECT_SETTINGS)
    recorded = recorded_settings(with_effect(PRESETS["biovid87"], "temporal"))
    assert recorded["burst_amplitude"] == 0.6 and recorded["effect"] == "temporal"
    assert recorded["class_intensity"] == [0.0] * 5 and recorded["roster"] == "biovid"
    with pytest.raises(ValueError, match="unknown synthetic effect"):
        with_effect(PRESETS["default"], "loud")


def test_truth_crops_put_the_landmarks_where_mtcnn_finds_them(tmp_path):
    """Truth crops place the five landmarks from the generator's geometry; on the same frames MTCNN, a real detector,
    finds them within a few pixels, so a truth crop is framed as an MTCNN-aligned crop is."""
    from pipeline.data.synthetic.truth_crops import sampled_frames

    config, subjects, samples = _effect_twin("all")
    detector = MTCNNFaceDetector()
    errors, sizes = [], []
    for sample in samples[:: len(samples) // 12]:
        for _, frame, landmarks in sampled_frames(config, subjects[sample.subject_id], sample, np.array([60, 120])):
            face = detector.detect_faces([frame])[0]
            if face is None:
                continue
            errors.append(np.linalg.norm(face.landmarks - landmarks, axis=1).mean())
            sizes.append(np.linalg.norm(landmarks[0] - landmarks[1]))
    assert len(errors) >= 18
    assert np.median(np.array(errors) / np.array(sizes)) < 0.2  # within a fifth of the eye distance
