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
from pipeline.models.weights import sha256_of_file
from pipeline.runs.pretrain import PretrainError, backbone_state, run_pretrain
from pipeline.utils.config import load_config
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ("model=mobilevit_xxs", "model.img_size=32", "model.pretrained=false", "loader.num_workers=0",
         "loader.batch_size=8", "pretrain.synthetic.preset=tiny", "pretrain.synthetic.n_subjects=3",
         "pretrain.synthetic.samples_per_class=1")


def pretrain_config(base: Path, tmp: Path, *extra: str):
    return load_config(tiny_overrides(base, *SMALL, f"pretrain.pool_dir={tmp / 'pool'}",
                                      f"pretrain.out_dir={tmp / 'out'}", *extra), groups=("pretrain=default",))


def test_pretrained_weights_load_as_weights_and_say_where_they_come_from(tiny_base: Path, tmp_path: Path) -> None:
    cfg = pretrain_config(tiny_base, tmp_path, "pretrain.epochs=2")
    path = run_pretrain(cfg, progress=False)
    provenance = json.loads(path.with_suffix(".json").read_text())
    assert provenance["sha256"] == sha256_of_file(path) and provenance["target"] == "au"
    assert provenance["target_names"] == ["au4", "au6_7", "au9_10", "au43"] and len(provenance["history"]) == 2
    assert all(math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["val_loss"])
               for epoch in provenance["history"])  # both losses of every epoch, held-out people included
    pool = provenance["pool"]
    twin = set(pd.read_csv(tiny_base / "processed" / "frames.csv")["subject_name"])
    assert len(pool["identities"]) == 3 and not set(pool["identities"]) & twin  # nobody of the twin
    assert pool["held_out_identities"] and set(pool["held_out_identities"]) < set(pool["identities"])
    assert provenance["started_from"]["weights_source"] == "random"

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
