"""The ONNX export's contract is enough to reproduce the model: a runtime that reads only the `.onnx` and its `.json`
(tests/onnx_contract_client.py: json, NumPy, OpenCV, ONNX Runtime) gives the project's network inputs and
probabilities, from the crop stage's crops and from video frames, for trained fold models of the tiny twin (exported
with `run_export(run=...)`, each fold its own model) and for a clip model."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipeline.data.augment import (
    build_eval_transform,
    central_box,
    eval_transform_steps,
    interpolation_flag,
    read_rgb,
)
from pipeline.deployment.export import export_scorer, run_export
from pipeline.deployment.predict import find_scorer
from pipeline.deployment.video_frames import sampled_frames
from pipeline.models.backbone_adapter import DataConfig
from pipeline.models.factory import create_model
from pipeline.models.model_file import model_meta, save_model_file
from pipeline.models.scoring import FrameScorer
from pipeline.models.temporal_heads import ClipNet, HeadConfig, build_temporal_head
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.serving.mlflow_model import WEIGHTS_ARTIFACT, build_scorer
from pipeline.runs.store import tracking
from tests import onnx_contract_client
from tests.conftest import scorer_source
from tests.onnx_contract_client import ContractRuntime, network_input

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAST = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
        "loader.batch_size=8", "trainer.max_epochs=2", "trainer.patience=1", "trainer.folds=[0,1]",
        "augment=light")
INPUT_ATOL = 1e-5  # float32 normalisation: albumentations' lookup table against the contract's formula
PROBABILITY_ATOL = 1e-4  # ONNX Runtime against PyTorch on the same input (the task asks for 0.01)


@pytest.fixture(scope="module")
def folds(tiny_config, tmp_path_factory) -> dict:
    """Two trained fold models of the tiny twin in a store of their own (no registered champion in it)."""
    own = tmp_path_factory.mktemp("onnx_contract")
    cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{own / 'mlflow.db'}",
                      f"mlflow.artifact_root={own / 'mlartifacts'}", f"cv.work_dir={own / 'runs'}",
                      f"reports_dir={own / 'reports'}")
    run_cv(cfg)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    parent = client.search_runs([client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id],
                                f"tags.`{tracking.RUN_KIND_TAG}` = 'cv'")[0]
    runs = {fold: run.info.run_id for fold, run in tracking.finished_fold_runs(client, parent.info.run_id).items()}
    assert sorted(runs) == [0, 1]
    exported = {fold: run_export(cfg, run=run_id, out=str(own / "export")) for fold, run_id in runs.items()}
    return {"cfg": cfg, "runs": runs, "exported": exported, "dir": own}


def stage_crops(cfg, n: int = 40) -> list[Path]:
    """The crop stage's JPEG files, as many as the review compared."""
    crops = sorted(Path(cfg.data.processed_dir, "crops").rglob("*.jpg"))[:n]
    assert len(crops) == n
    return crops


def project_inputs(scorer: FrameScorer, crops_rgb) -> np.ndarray:
    return torch.stack([scorer.transform(image=crop)["image"] for crop in crops_rgb]).numpy()


def twin_frames(cfg, n: int = 8) -> list[np.ndarray]:
    video = sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]
    _, _, frames = next(sampled_frames(video, 5))
    return list(frames[:n])


def test_the_contract_alone_gives_each_runs_inputs_and_probabilities_on_the_crop_stages_crops(folds) -> None:
    cfg = folds["cfg"]
    crops = stage_crops(cfg)
    probabilities = {}
    for fold, run_id in folds["runs"].items():
        path = folds["exported"][fold]
        runtime = ContractRuntime(path.with_suffix(".json"))
        scorer, _ = find_scorer(scorer_source(cfg), run=run_id)
        # the export is of the run asked for (this store has no champion to fall back on), deciding at its threshold
        assert runtime.contract["source"].startswith(f"run {run_id} ")
        assert runtime.contract["threshold"] == pytest.approx(scorer.threshold) and scorer.threshold != 0.5
        theirs_in = np.stack([runtime.network_input(runtime.read_crop(p)) for p in crops])
        ours_in = project_inputs(scorer, [read_rgb(p) for p in crops])
        assert theirs_in.shape == ours_in.shape == (40, 3, 32, 32) and theirs_in.dtype == np.float32
        np.testing.assert_allclose(theirs_in, ours_in, rtol=0, atol=INPUT_ATOL)
        ours = scorer.probabilities([read_rgb(p) for p in crops])
        theirs = runtime.pain_probabilities([runtime.read_crop(p) for p in crops])
        np.testing.assert_allclose(theirs, ours, rtol=0, atol=PROBABILITY_ATOL)
        assert (runtime.decisions(theirs) == (ours >= scorer.threshold)).all()
        assert np.ptp(ours) > 10 * PROBABILITY_ATOL  # the trained model's answer depends on the crop
        probabilities[fold] = ours
    # two folds, two models: an export that ignored `run` could not match both
    assert np.abs(probabilities[0] - probabilities[1]).max() > 10 * PROBABILITY_ATOL


def test_the_contract_alone_crops_video_frames_as_predict_does(folds) -> None:
    """From a video frame: the project's detector gives the five landmarks (the contract names the detector, its
    settings and weights); the alignment, warp, JPEG round trip and transform come from the contract alone."""
    cfg = folds["cfg"]
    runtime = ContractRuntime(folds["exported"][0].with_suffix(".json"))
    scorer, _ = find_scorer(scorer_source(cfg), run=folds["runs"][0])
    frames = twin_frames(cfg)
    table = scorer.score(frames)
    follower = scorer.follower()
    faces = [follower.step(found) for found in scorer.find_faces(frames)]
    with_face = [i for i, face in enumerate(faces) if face is not None]
    assert len(with_face) >= 6 and table.face_found.iloc[with_face].all()
    crops = []
    for i in with_face:
        landmarks = np.stack([faces[i][5:10], faces[i][10:15]], axis=1)
        crop = runtime.aligned_crop(frames[i], landmarks)
        np.testing.assert_array_equal(crop, scorer.crop(frames[i], faces[i]))  # the same pixels, to the bit
        crops.append(crop)
    theirs = runtime.pain_probabilities(crops)
    ours = table.pain_probability.iloc[with_face].to_numpy(dtype=float)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=PROBABILITY_ATOL)
    assert list(runtime.decisions(theirs)) == list(table.pain.iloc[with_face])


def test_the_contract_alone_makes_square_crops_as_predict_does(folds, tmp_path) -> None:
    """A model trained on square crops (no landmarks): the box rounding, margin, border and resize from the contract;
    boxes inside the frame, over its edges, smaller and larger than the crop."""
    cfg = folds["cfg"]
    aligned, _ = find_scorer(scorer_source(cfg), run=folds["runs"][0])
    settings = dataclasses.replace(aligned.settings, detector="haar", align=False)
    scorer = FrameScorer(aligned.net, aligned.meta, settings, aggregation=aligned.aggregation, topk=aligned.topk,
                         threshold=aligned.threshold)
    runtime = ContractRuntime(export_scorer(scorer, "square", tmp_path).with_suffix(".json"))
    assert runtime.contract["face_crop"]["crop"]["method"] == "square"
    frame = twin_frames(cfg, 1)[0]
    height, width = frame.shape[:2]
    boxes = [(20.4, 10.6, 60.5, 52.5), (-8.0, -5.2, 30.0, 33.7), (width - 25.5, height - 30.0, width + 4.0, height),
             (10.0, 12.0, 10.0 + 0.5 * settings.crop_size, 12.0 + 0.4 * settings.crop_size),
             (1.0, 2.0, width - 1.5, height - 3.0)]
    for box in boxes:
        face = np.array([*box, 1.0, *([np.nan] * 10)])
        np.testing.assert_array_equal(runtime.square_crop(frame, box), scorer.crop(frame, face))


def test_a_clip_models_contract_gives_its_window_probabilities(tiny_config, tmp_path) -> None:
    """A clip model (a tiny random MobileViT and transformer head, kept and loaded as `make final` keeps one): each
    crop scored with a clip of T crops ending with it, spaced as its training clips were, from the contract alone."""
    cfg = tiny_config()
    torch.manual_seed(0)
    frame_net, source = create_model("mobilevit_xxs", n_classes=2, pretrained=False, img_size=32)
    head = {"name": "transformer", "mode": "two_stage", "hidden": 16, "layers": 1, "attention_heads": 4,
            "dropout": 0.0, "max_frames": 8, "epochs": 1, "patience": 1}
    net = ClipNet(frame_net.backbone,
                  build_temporal_head(HeadConfig.from_model_file(head), frame_net.backbone.num_features, 2))
    meta = model_meta(net, model_name="mobilevit_xxs", img_size=32, class_names=["BL1", "PA4"], task="bl1_vs_pa4",
                      loader={"crop_fraction": 0.8, "clip_frames": 3, "clip_spacing_s": 0.42},
                      weights=tracking.weights_tags(source), head=head)
    path = save_model_file(net, meta, tmp_path / "model.pt")
    crop = {"crop_size": int(cfg.preprocess.crop_size), "margin": float(cfg.preprocess.margin)}
    scorer = build_scorer({WEIGHTS_ARTIFACT: str(path)},
                          {"threshold": 0.5, "aggregation": "mean", "topk": 3, "crop": crop})
    runtime = ContractRuntime(export_scorer(scorer, "clip", tmp_path).with_suffix(".json"))
    assert runtime.contract["layout"] == "NTCHW" and runtime.contract["clip_frames"] == 3
    assert runtime.contract["transform"][0]["step"] == "central_crop"
    frames = twin_frames(cfg)
    times = [0.2 * i for i in range(len(frames))]  # 5 frames a second: a window skips crops
    table = scorer.score(frames, times_s=times)
    assert runtime.contract["clip_spacing_s"] == 0.42
    follower = scorer.follower()
    faces = [follower.step(found) for found in scorer.find_faces(frames)]
    with_face = [i for i, face in enumerate(faces) if face is not None]
    assert len(with_face) >= 6
    crops = [runtime.aligned_crop(frames[i], np.stack([faces[i][5:10], faces[i][10:15]], axis=1)) for i in with_face]
    theirs = runtime.window_pain_probabilities(crops, [times[i] for i in with_face])
    np.testing.assert_allclose(theirs, table.pain_probability.iloc[with_face].to_numpy(dtype=float), rtol=0,
                               atol=PROBABILITY_ATOL)
    assert list(runtime.decisions(theirs)) == list(table.pain.iloc[with_face])


@pytest.mark.parametrize(("crop_size", "fraction", "input_size", "interpolation"), [
    (64, 1.0, 32, "bicubic"),  # a shrink: INTER_AREA, whatever the backbone's interpolation
    (224, 1.0, 112, "bicubic"),  # the review's MobileViT-S at 112 px
    (64, 1.0, 112, "bicubic"),  # a growth: the backbone's own INTER_CUBIC
    (100, 0.8, 64, "bilinear"),  # (1 - 0.8) / 2 * 100 is 9.999...: 9 pixels off each end, not 10
    (224, 0.85, 224, "bicubic"),  # 16.8 -> 16; then 192 -> 224 grows
    (224, 0.9, 112, "bilinear"),
])
def test_the_contracts_transform_steps_give_the_evaluation_transforms_input(crop_size: int, fraction: float,
                                                                            input_size: int,
                                                                            interpolation: str) -> None:
    config = DataConfig(input_size=(3, input_size, input_size), mean=(0.485, 0.456, 0.406),
                        std=(0.229, 0.224, 0.225), interpolation=interpolation, crop_pct=0.9)
    steps = json.loads(json.dumps(eval_transform_steps(config, fraction, (crop_size, crop_size))))  # as the file holds
    image = np.random.default_rng(crop_size).integers(0, 256, (crop_size, crop_size, 3), dtype=np.uint8)
    image = cv2.GaussianBlur(image, (0, 0), 1.5)  # a face crop is smooth; noise would make every flag look alike
    expected = build_eval_transform(config, fraction)(image=image)["image"].numpy()
    np.testing.assert_allclose(network_input({"transform": steps}, image), expected, rtol=0, atol=INPUT_ATOL)
    resize = [step for step in steps if step["step"] == "resize"]
    if resize:
        side = resize[0]["from_hw"][0]
        assert resize[0]["interpolation"] == ("INTER_AREA" if side > input_size else
                                              {"bicubic": "INTER_CUBIC", "bilinear": "INTER_LINEAR"}[interpolation])
        # the flag matters: the backbone's own interpolation instead gives another input
        other = "INTER_CUBIC" if resize[0]["interpolation"] != "INTER_CUBIC" else "INTER_AREA"
        wrong = [{**step, "interpolation": other} if step["step"] == "resize" else step for step in steps]
        assert np.abs(network_input({"transform": wrong}, image) - expected).max() > 100 * INPUT_ATOL


@pytest.mark.parametrize("side", [17, 64, 100, 112, 224, 225, 641])
@pytest.mark.parametrize("fraction", [0.95, 0.9, 0.875, 0.85, 0.8, 0.7, 0.5, 0.33, 0.1])
def test_the_central_box_is_the_crop_albumentations_cropandpad_made(side: int, fraction: float) -> None:
    """The rule trained models were trained with (albumentations' CropAndPad by a negative percent) is kept."""
    image = np.arange(side * (side + 7) * 3, dtype=np.uint32).reshape(side, side + 7, 3)
    before = A.CropAndPad(percent=-(1 - fraction) / 2, keep_size=False, p=1.0)(image=image)["image"]
    x0, y0, x1, y1 = central_box(side, side + 7, fraction)
    np.testing.assert_array_equal(image[y0:y1, x0:x1], before)


def test_the_central_box_truncates_the_float_product() -> None:
    assert central_box(100, 100, 0.8) == (9, 9, 91, 91)  # (1 - 0.8) / 2 * 100 = 9.999...: an 82 px view, not 80
    assert central_box(224, 224, 0.85) == (16, 16, 208, 208)  # 16.8
    assert central_box(224, 224, 1.0) == (0, 0, 224, 224)


def test_the_input_resize_is_the_resize_albumentations_made() -> None:
    """INTER_AREA on a shrink of either side, the backbone's flag otherwise, masks nearest: as `A.Resize(...,
    area_for_downscale="image")` resized before."""
    rng = np.random.default_rng(0)
    for source_hw, target in (((64, 64), 32), ((64, 64), 112), ((100, 140), 112), ((112, 112), 112)):
        config = DataConfig((3, target, target), (0.5,) * 3, (0.5,) * 3, "bicubic", 0.9)
        image = rng.integers(0, 256, (*source_hw, 3), dtype=np.uint8)
        mask = rng.integers(0, 2, source_hw, dtype=np.uint8)
        before = A.Resize(target, target, interpolation=interpolation_flag(config), area_for_downscale="image")(
            image=image, mask=mask)
        after = build_eval_transform(config)(image=image, mask=mask)
        expected = A.Normalize(mean=(0.5,) * 3, std=(0.5,) * 3, max_pixel_value=255.0)(image=before["image"])["image"]
        np.testing.assert_array_equal(after["image"].numpy(), expected.transpose(2, 0, 1))
        np.testing.assert_array_equal(np.asarray(after["mask"]), before["mask"])


def test_the_contract_client_uses_json_numpy_opencv_and_onnx_runtime_alone() -> None:
    tree = ast.parse(Path(onnx_contract_client.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "json", "numpy", "cv2", "onnxruntime"}, imported
