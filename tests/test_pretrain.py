"""`make pretrain`: a backbone trained on a pool of people outside the CV dataset, written as a weights file that
`model.weights=` (WEIGHTS=) loads strictly, with its provenance; pools that share a person are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline.models.backbones import create_backbone
from pipeline.runs.jobs.pretrain import PretrainError, backbone_state, run_pretrain
from pipeline.utils.config import load_config
from pipeline.utils.digests import file_sha256
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
         "loader.batch_size=8", "pretrain.synthetic.preset=tiny", "pretrain.synthetic.n_subjects=3",
         "pretrain.synthetic.samples_per_class=1")


def pretrain_config(base: Path, tmp: Path, *extra: str):
    return load_config(tiny_overrides(base, *SMALL, f"pretrain.pool_dir={tmp / 'pool'}",
                                      f"pretrain.out_dir={tmp / 'out'}", *extra), groups=("pretrain=default",))


def test_pretrained_weights_load_as_weights_and_say_where_they_come_from(tiny_base: Path, tmp_path: Path) -> None:
    cfg = pretrain_config(tiny_base, tmp_path, "pretrain.epochs=2", "pretrain.target=au")
    path = run_pretrain(cfg, progress=False)
    provenance = json.loads(path.with_suffix(".json").read_text())
    assert provenance["sha256"] == file_sha256(path) and provenance["target"] == "au"
    assert provenance["target_names"] == ["au4", "au6_7", "au9_10", "au43"] and len(provenance["history"]) == 2
    assert all(math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["val_loss"])
               for epoch in provenance["history"])  # both losses of every epoch, held-out people included
    pool = provenance["pool"]
    twin = set(pd.read_csv(tiny_base / "processed" / "frames.csv")["subject_name"])
    assert len(pool["identities"]) == 3 and not set(pool["identities"]) & twin  # nobody of the twin
    # the action units of the resting clips only (on a pain clip they are the pain intensity by another name)
    assert pool["classes"] == ["BL1"] and pool["crops"] == 3 * 1 * 3  # 3 people, 1 BL1 clip, 3 crops each
    assert pool["checked_apart_from"].startswith("synthetic: ") and "by name and look" in pool["checked_apart_from"]
    assert pool["held_out_identities"] and set(pool["held_out_identities"]) < set(pool["identities"])
    assert provenance["started_from"]["weights_source"] == "random"
    # make cv WEIGHTS= reads the identities and finds none of them among the fold file's subjects
    from mlflow import MlflowClient

    from pipeline.runs.orchestration.cross_validation import plan_cv
    from pipeline.runs.orchestration.cv_settings import CvRunSettings

    cfg_cv, uri = cv_config(tiny_base, tmp_path, path)
    plan = plan_cv(CvRunSettings.from_config(cfg_cv), MlflowClient(uri), uri)
    assert MlflowClient(uri).get_run(plan.parent_run_id).data.tags["pretraining_people"] == (
        f"checked: none of the 3 identities in {path.with_suffix('.json').name} is among the {len(twin)} subjects "
        f"of kfold5_all.csv")

    # WEIGHTS= reads it like any other file: strictly, recorded by its SHA-256, the very tensors that were written
    loaded, source = create_backbone("mobilevit_xxs", pretrained=True, weights=path, img_size=32)
    assert (source.kind, source.sha256) == ("file", provenance["sha256"])
    saved = torch.load(path, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in backbone_state(loaded).items())
    torch.manual_seed(cfg.seed)  # what make pretrain started from: the same seed, the same random init
    fresh, _ = create_backbone("mobilevit_xxs", pretrained=False, img_size=32)
    assert any(not torch.equal(saved[k], v) for k, v in backbone_state(fresh).items())  # training moved it

    # identity as the target, over the same (resumed) pool: one class per person, unseen frames held out
    other = run_pretrain(pretrain_config(tiny_base, tmp_path, "pretrain.epochs=1", "pretrain.target=identity"),
                         progress=False)
    about = json.loads(other.with_suffix(".json").read_text())
    assert about["outputs"] == 3 and about["pool"]["held_out_crops"] > 0 and other != path
    assert about["pool"]["classes"] == ["BL1", "PA1", "PA2", "PA3", "PA4"]  # who it is: every clip serves


def test_a_pool_that_shares_a_person_with_the_dataset_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    # the twin's own seed draws the twin's people again: refused before anything is generated
    with pytest.raises(PretrainError, match=r"shares 3 identities with the synthetic dataset.*pretrain.synthetic.seed"):
        run_pretrain(pretrain_config(tiny_base, tmp_path, "pretrain.synthetic.seed=0"), progress=False)
    assert not (tmp_path / "pool").exists() and not (tmp_path / "out").exists()

    # a lab's folder of crops: a CV subject among its identities is refused by name, a missing crop by its row
    frames = pd.read_csv(tiny_base / "processed" / "frames.csv")
    crops = tiny_base / "processed"
    labels = pd.DataFrame({"crop_path": frames["crop_path"][:2], "identity": ["outsider", frames["subject_name"][0]],
                           "au4": [0.1, 0.2]})
    labels.to_csv(tmp_path / "labels.csv", index=False)
    folder = ("pretrain.pool=folder", f"pretrain.folder.crops_dir={crops}",
              f"pretrain.folder.labels_csv={tmp_path / 'labels.csv'}")
    with pytest.raises(PretrainError, match=f"identities {frames['subject_name'][0]} are subjects of the synthetic"):
        run_pretrain(pretrain_config(tiny_base, tmp_path, *folder), progress=False)
    labels.assign(identity=["outsider", "stranger"], crop_path=[labels.crop_path[0], "no/such.jpg"]).to_csv(
        tmp_path / "labels.csv", index=False)
    with pytest.raises(PretrainError, match=r"labels.csv row 3: crop .*no/such.jpg does not exist"):
        run_pretrain(pretrain_config(tiny_base, tmp_path, *folder), progress=False)


def biovid_config(tmp: Path, manifest_dir: Path, *extra: str):
    """`make pretrain DATA=biovid` without BIOVID_ROOT: no frame table, no samples table; the roster is whatever
    `manifest_dir` holds (the committed data_manifests/biovid has BioVid's 87 names)."""
    return load_config(["data=biovid", f"data.processed_dir={tmp / 'biovid'}", f"data.manifest_dir={manifest_dir}",
                        *SMALL, "preprocess.frames_per_video=3", "preprocess.crop_size=64", "preprocess.workers=1",
                        "data.pretrained=false", "trainer.precision=32-true", f"pretrain.pool_dir={tmp / 'pool'}",
                        f"pretrain.out_dir={tmp / 'out'}", *extra], groups=("pretrain=default",))


def twin_folder_pool(base: Path, tmp: Path) -> tuple[str, ...]:
    """A lab's folder pool that is, unknown to it, the twin's own people: its crops under their names."""
    frames = pd.read_csv(base / "processed" / "frames.csv").groupby("subject_name").head(2)
    frames.assign(identity=frames["subject_name"], au4=0.1)[["crop_path", "identity", "au4"]].to_csv(
        tmp / "labels.csv", index=False)
    return ("pretrain.pool=folder", f"pretrain.folder.crops_dir={base / 'processed'}",
            f"pretrain.folder.labels_csv={tmp / 'labels.csv'}")


def cv_config(base: Path, tmp: Path, weights: Path) -> tuple:
    """`make cv WEIGHTS=<weights>` on the tiny twin, in a store of the test's own: the config and its URI."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    return load_config(tiny_overrides(base, SMALL[0], "model.img_size=32", "model.pretrained=true",
                                      f"model.weights={weights}", f"mlflow.tracking_uri={uri}",
                                      f"mlflow.artifact_root={tmp / 'art'}", f"cv.work_dir={tmp / 'runs'}")), uri


def test_a_dataset_whose_participants_cannot_be_read_is_refused(tmp_path: Path, tiny_base: Path) -> None:
    nowhere = tmp_path / "no_manifests"
    for pool in ((), twin_folder_pool(tiny_base, tmp_path)):
        with pytest.raises(PretrainError, match=r"the biovid dataset's participants cannot be read \(no .*frames.csv; "
                                                r".*data.root is not set \(BIOVID_ROOT=\)"):
            run_pretrain(biovid_config(tmp_path, nowhere, *pool), progress=False)
    assert not (tmp_path / "pool").exists() and not (tmp_path / "out").exists()  # refused before anything was made


def test_cv_weights_whose_pool_shares_a_person_with_the_fold_file_are_refused(tiny_base: Path, tmp_path: Path,
                                                                              caplog) -> None:
    """Pretrained under DATA=biovid (checked against BioVid's committed 87 names, from data_manifests/ without
    BIOVID_ROOT) on a pool of the twin's people, the weights pass `make pretrain`; `make cv` on the twin reads their
    provenance before anything trains and refuses them, naming the people and both files. Weights without a
    provenance are used, with a warning and a tag that nothing could be checked."""
    from mlflow import MlflowClient

    from pipeline.runs.orchestration.cross_validation import plan_cv
    from pipeline.runs.orchestration.cv_settings import CvRunSettings
    from pipeline.utils.paths import PROJECT_ROOT

    weights = run_pretrain(biovid_config(tmp_path, PROJECT_ROOT / "data_manifests" / "biovid", "pretrain.epochs=1",
                                         "pretrain.target=au", *twin_folder_pool(tiny_base, tmp_path)),
                           progress=False)
    cfg, uri = cv_config(tiny_base, tmp_path, weights)
    twin = sorted(pd.read_csv(tiny_base / "processed" / "frames.csv")["subject_name"].unique())
    with pytest.raises(SystemExit, match=rf"starting weights {weights} were trained on {len(twin)} of the subjects "
                                         rf"of .*kfold5_all.csv \({twin[0]}, .*{weights.with_suffix('.json')}"):
        plan_cv(CvRunSettings.from_config(cfg), MlflowClient(uri), uri)
    experiment = MlflowClient(uri).get_experiment_by_name(cfg.mlflow.experiment)
    assert experiment is None or not MlflowClient(uri).search_runs([experiment.experiment_id])  # no run was made
    provenance = json.loads(weights.with_suffix(".json").read_text())
    assert provenance["pool"]["checked_apart_from"].startswith("biovid: 87 participants by name")

    weights.with_suffix(".json").unlink()  # the same weights without their provenance: nothing can be checked
    plan = plan_cv(CvRunSettings.from_config(cfg), MlflowClient(uri), uri)
    tag = MlflowClient(uri).get_run(plan.parent_run_id).data.tags["pretraining_people"]
    assert tag == f"unchecked: no provenance file {weights.with_suffix('.json')}"
    assert any("nothing could be checked" in record.getMessage() for record in caplog.records)
