"""Using a trained model, end to end on the tiny twin in one store: cv -> final -> promote -> predict -> serve."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipeline.deployment.final_model import read_split, run_final
from pipeline.deployment.predict import run_predict
from pipeline.deployment.video_frames import sampled_frames
from pipeline.evaluation.thresholds import choose_threshold
from pipeline.runs.orchestration.cross_validation import run_cv
from pipeline.runs.serving.mlflow_model import encode_image
from pipeline.runs.store.registry import CANDIDATE, CHAMPION, registered_name, run_promote
from pipeline.utils.accelerator import training_device
from pipeline.utils.paths import PROJECT_ROOT
from pipeline.utils.processes import stop_process_group
from tests.conftest import scorer_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAST = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
        "loader.batch_size=8", "trainer.max_epochs=2", "trainer.patience=1", "trainer.folds=[0,1]",
        "augment=light")


@pytest.fixture(scope="module")
def chain(tiny_config, tmp_path_factory) -> dict:
    """A CV, its final model and that model promoted, in a store of this module's own."""
    own = tmp_path_factory.mktemp("use_model")
    cfg = tiny_config(*FAST, f"mlflow.tracking_uri=sqlite:///{own / 'mlflow.db'}",
                      f"mlflow.artifact_root={own / 'mlartifacts'}", f"cv.work_dir={own / 'runs'}",
                      f"reports_dir={own / 'reports'}", "final.ensemble=true",
                      "trainer.precision=auto")  # each fold resolves it on its device (float32 for MobileViT on CPUs)
    run_cv(cfg)
    final = run_final(cfg)
    run_promote(cfg, version=final["version"])
    return {"cfg": cfg, "final": final, "client": MlflowClient(cfg.mlflow.tracking_uri), "dir": own}


def twin_video(cfg) -> Path:
    return sorted(Path(cfg.data.root, "video").rglob("*PA4*.mp4"))[0]


def grey_video(path: Path, frames: int = 30) -> Path:
    """A plain-colour clip: no face anywhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25, (160, 120))
    for _ in range(frames):
        writer.write(np.full((120, 160, 3), 110, np.uint8))
    writer.release()
    return path


def test_final_model_is_registered_with_its_source_and_threshold(chain) -> None:
    cfg, client, final = chain["cfg"], chain["client"], chain["final"]
    name = registered_name("mobilevit_xxs", "bl1_vs_pa4")
    assert str(client.get_model_version_by_alias(name, CANDIDATE).version) == final["version"]
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == final["version"]
    run = client.get_run(final["run_id"])
    parent_id = run.data.tags["painvit.source_cv_run"]
    parent = client.get_run(parent_id)
    assert parent.data.tags["painvit.run_kind"] == "cv" and parent.info.status == "FINISHED"
    for r in (run, parent):
        for key in ("mlflow.user", "mlflow.source.name", "mlflow.source.type", "mlflow.note.content"):
            assert r.data.tags.get(key), key
        # the datasets hold names and labels, never frames
        schema = json.loads(r.inputs.dataset_inputs[0].dataset.schema)["mlflow_colspec"]
        columns = {column["name"] for column in schema}
        assert {"subject_name", "sample_name", "label"} <= columns and not columns & {"crop_path", "image"}
    assert "| fold 0 |" in parent.data.tags["mlflow.note.content"]
    # every subject is used: the split covers the fold file's subjects, val held out for stopping and threshold
    split = read_split(Path(client.download_artifacts(run.info.run_id, "final_split.csv")))
    folds = pd.read_csv(cfg.fold_file)
    assert set(split.subject_name) == set(folds.subject_name) and (split.role == "val").sum() >= 1
    videos = pd.read_csv(client.download_artifacts(run.info.run_id, "predictions_val_videos.csv"))
    assert set(videos.subject_name) == set(split.subject_name[split.role == "val"])
    expected = choose_threshold((videos.label == 1).astype(int), videos.prob_PA4, cfg.eval.threshold,
                                n_subjects=videos.subject_name.nunique()).threshold
    assert run.data.metrics["threshold"] == pytest.approx(expected)
    # a second `make final` with the same settings trains nothing: it names the finished run
    assert run_final(cfg)["run_id"] == final["run_id"]
    # the fold models are MLflow models too (the UI's Models tab), each in its fold run
    folds_logged = client.search_logged_models([run.info.experiment_id], filter_string="tags.`painvit.kind` = 'fold'")
    assert len(folds_logged) == 2
    fold_runs = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    for fold_run in fold_runs:
        schema = json.loads(fold_run.inputs.dataset_inputs[0].dataset.schema)["mlflow_colspec"]
        assert {c["name"] for c in schema} == {"subject_name", "sample_name", "class_name", "label", "role"}


def test_predict_writes_a_timeline_for_a_video_and_a_folder_with_a_faceless_clip(chain, capsys) -> None:
    cfg, own = chain["cfg"], chain["dir"]
    video = twin_video(cfg)
    summary = run_predict(cfg, video=str(video), out=str(own / "one"))
    table = pd.read_csv(own / "one" / f"{video.name}.csv")
    assert list(table.columns) == ["time_s", "frame", "face_found", "pain_probability", "pain"]
    assert len(table) == 28  # 5.5 s at 5 frames per second
    # the hard twin's PA4 clip rolls the head and shuts the eyes: MTCNN may lose a frame or two, never most
    assert table.face_found.mean() >= 0.8
    assert table.pain_probability[table.face_found].between(0, 1).all()
    assert table.pain_probability[~table.face_found].isna().all() and table.pain[~table.face_found].isna().all()
    assert np.allclose(np.diff(table.time_s), 0.2)
    threshold = chain["final"]["threshold"]
    assert summary.decision[0] == ("pain" if table.pain_probability.dropna().mean() >= threshold else "no pain")
    assert cv2.imread(str(own / "one" / f"{video.name}.png")) is not None

    folder = own / "clips"
    grey_video(folder / "grey.mp4")
    (folder / "face.mp4").write_bytes(video.read_bytes())
    capsys.readouterr()
    summary = run_predict(cfg, video=str(folder), out=str(own / "many"))
    out = capsys.readouterr().out
    assert out.startswith("device: ")  # the device it runs on, said first (predict.device=cpu here)
    assert "no face found in any of the 6 sampled frames: no score" in out
    listed = pd.read_csv(own / "many" / "videos.csv")
    assert len(listed) == 2 and len(summary) == 2
    grey = listed.set_index(listed.video.map(lambda v: Path(v).name)).loc["grey.mp4"]
    assert grey.decision == "no face" and np.isnan(grey.pain_score) and grey.frames_with_face == 0
    grey_frames = pd.read_csv(own / "many" / "grey.mp4.csv")
    assert not grey_frames.face_found.any() and grey_frames.pain_probability.isna().all()
    assert (own / "many" / "grey.mp4.png").is_file() and (own / "many" / "face.mp4.png").is_file()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_served_model_answers_as_predict_does(chain) -> None:
    cfg, own = chain["cfg"], chain["dir"]
    video = twin_video(cfg)
    run_predict(cfg, video=str(video), out=str(own / "serve"))
    expected = pd.read_csv(own / "serve" / f"{video.name}.csv").head(6)
    _, _, frames = next(sampled_frames(video, 5))
    request = {"dataframe_split": {"columns": ["image"], "data": [[encode_image(f)] for f in frames[:6]]}}

    port = free_port()
    # the server starts `uvicorn` from PATH: the environment's own, as `make serve` does
    env = {**os.environ, "MLFLOW_TRACKING_URI": cfg.mlflow.tracking_uri,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).with_name("mlflow")), "models", "serve", "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port), "-m",
               f"models:/{registered_name('mobilevit_xxs', 'bl1_vs_pa4')}@{CHAMPION}"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the scoring server did not answer /ping within 180 s"
            time.sleep(1)
        body = json.dumps(request).encode()
        post = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                      {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=120) as answer:
            served = pd.DataFrame(json.loads(answer.read())["predictions"])
    finally:
        stop_process_group(server)
    assert list(served.frame) == list(range(6))
    assert list(served.face_found) == list(expected.face_found)
    # float32 noise only: predict scored the whole video in batches of 32, the server these 6 frames as one batch,
    # and oneDNN picks its kernels by batch shape (up to 2e-5 apart on an Intel Xeon with AMX; the ONNX parity bound)
    np.testing.assert_allclose(served.pain_probability.astype(float), expected.pain_probability, atol=1e-4)
    assert list(served.pain) == list(expected.pain)


def test_export_writes_the_champion_as_onnx_with_its_input_contract(chain) -> None:
    from pipeline.deployment.export import run_export

    path = run_export(chain["cfg"], out=str(chain["dir"] / "export"))
    contract = json.loads(path.with_suffix(".json").read_text())
    assert contract["threshold"] == pytest.approx(chain["final"]["threshold"])
    assert contract["input_size"] == [3, 32, 32] and contract["max_abs_difference_to_pytorch"] < 1e-4


def test_fold_ensemble_averages_the_fold_models(chain) -> None:
    from pipeline.deployment.predict import find_scorer

    cfg, client = chain["cfg"], chain["client"]
    run = client.get_run(chain["final"]["run_id"])
    parent_id = run.data.tags["painvit.source_cv_run"]
    name = f"{registered_name('mobilevit_xxs', 'bl1_vs_pa4')}-folds"
    assert str(client.get_model_version_by_alias(name, CANDIDATE).version) == run.data.tags["painvit.ensemble_version"]
    _, _, frames = next(sampled_frames(twin_video(cfg), 5))
    ensemble, _ = find_scorer(scorer_source(cfg), model_uri=f"models:/{name}@{CANDIDATE}")
    assert len(ensemble.ensemble) == 1  # two folds: one network plus one more
    together = ensemble.score(frames[:4])
    fold_runs = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    alone = [find_scorer(scorer_source(cfg), run=r.info.run_id)[0].score(frames[:4]) for r in fold_runs]
    assert len(alone) == 2 and together.face_found.all()
    np.testing.assert_allclose(together.pain_probability, np.mean([a.pain_probability for a in alone], axis=0),
                               atol=1e-6)


def test_run_and_the_fold_model_decide_alike_at_the_folds_own_threshold(chain) -> None:
    """`make predict RUN=<fold run>` and the fold's MLflow model: the same threshold and the same decisions, and the
    fold resolved `trainer.precision=auto` on the device it trained on."""
    import mlflow

    from pipeline.deployment.predict import find_scorer
    from pipeline.models.backbone_adapter import family_traits
    from pipeline.models.backbones import model_family
    from pipeline.runs.serving.mlflow_model import encode_image, logged_model_uri
    from pipeline.utils.devices import precision_for

    cfg, client = chain["cfg"], chain["client"]
    parent_id = client.get_run(chain["final"]["run_id"]).data.tags["painvit.source_cv_run"]
    assert client.get_run(parent_id).data.tags["precision_asked"] == "auto"
    fold_run = client.search_runs([client.get_run(parent_id).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent_id}'")[0]
    resolved = precision_for("auto", training_device(cfg.trainer.accelerator).kind,
                             family_traits(model_family(cfg.model.name, cfg.model.img_size)))
    assert fold_run.data.tags["precision"] == resolved == client.get_run(parent_id).data.tags["precision"]
    threshold = fold_run.data.metrics["test/threshold"]
    assert threshold != 0.5
    scorer, _ = find_scorer(scorer_source(cfg), run=fold_run.info.run_id)
    assert scorer.threshold == pytest.approx(threshold)
    _, _, frames = next(sampled_frames(twin_video(cfg), 5))
    ours = scorer.score(frames[:6])
    served = mlflow.pyfunc.load_model(logged_model_uri(client, fold_run.info.run_id)).predict(
        pd.DataFrame({"image": [encode_image(f) for f in frames[:6]]}))
    assert list(served.pain) == list(ours.pain)
    np.testing.assert_allclose(served.pain_probability.astype(float), ours.pain_probability, atol=1e-6)


def test_requirement_mismatches_name_what_the_environment_lacks(tmp_path: Path) -> None:
    """The load-time check `find_scorer` makes in place of MLflow's (which costs two seconds of every predict):
    pins this environment meets pass (a local build label such as +cu130 included), others are named."""
    from importlib import metadata

    from pipeline.runs.serving.mlflow_model import model_root, requirement_mismatches

    (tmp_path / "MLmodel").write_text("flavors: {}\n")
    (tmp_path / "artifacts").mkdir()
    torch_version = metadata.version("torch")  # e.g. 2.14.1+cu130
    (tmp_path / "requirements.txt").write_text(
        f"numpy=={metadata.version('numpy')}\ntorch=={torch_version.split('+')[0]}\n# a comment\n-r other.txt\n"
        "numpy==0.0.1\nno-such-package-anywhere==1.0\n")
    assert model_root(tmp_path / "artifacts" / "model.pt") == tmp_path
    assert requirement_mismatches(tmp_path) == [
        f"numpy==0.0.1 (installed: {metadata.version('numpy')})", "no-such-package-anywhere==1.0 (not installed)"]
    assert requirement_mismatches(None) == [] and requirement_mismatches(tmp_path / "artifacts") == []
