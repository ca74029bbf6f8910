"""PainDataModule over a tiny frame table of real JPEG crops: splits by subject, task labels, sampling, errors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.data.datamodule import PainDataModule, SubjectRoles, default_num_workers, read_frame_table
from pipeline.data.fold_checks import FoldError
from pipeline.data.tasks import CLASS_NAMES, get_task
from pipeline.utils.atomic_io import atomic_write_csv
from tests.conftest import loader_config

AUGMENT_DIR = Path(__file__).resolve().parents[1] / "configs" / "augment"
SUBJECTS = tuple(f"0{index}0909_w_2{index}" for index in range(1, 7))
FOLDS = {
    0: {"train": SUBJECTS[:3], "val": SUBJECTS[3:4], "test": SUBJECTS[4:]},
    1: {"train": SUBJECTS[3:], "val": SUBJECTS[:1], "test": SUBJECTS[1:3]},
}
FRAME_INDICES = (40, 80)
CROP_HEIGHT, CROP_WIDTH = 40, 48  # not the model's size: the transforms must resize


@dataclass(frozen=True)
class FakeDataConfig:
    input_size: tuple[int, int, int] = (3, 32, 32)
    mean: tuple[float, float, float] = (0.40, 0.45, 0.50)
    std: tuple[float, float, float] = (0.20, 0.25, 0.30)
    interpolation: str = "bicubic"
    crop_pct: float = 0.9


def make_processed(root: Path, videos_per_class: dict[str, int] | None = None, same_image: bool = False) -> Path:
    """A processed folder as preprocessing writes it: crops/<subject>/<sample>/fNNN.jpg and frames.csv."""
    videos_per_class = videos_per_class or {}
    rows, rng = [], np.random.default_rng(0)
    shared = rng.integers(0, 256, (CROP_HEIGHT, CROP_WIDTH, 3), dtype=np.uint8)
    for subject in SUBJECTS:
        for class_id, class_name in enumerate(CLASS_NAMES):
            for video in range(videos_per_class.get(class_name, 2)):
                sample = f"{subject}-{class_name}-{video:03d}"
                for frame_index in FRAME_INDICES:
                    crop_path = Path("crops", subject, sample, f"f{frame_index:03d}.jpg")
                    (root / crop_path).parent.mkdir(parents=True, exist_ok=True)
                    image = shared if same_image else rng.integers(0, 256, shared.shape, dtype=np.uint8)
                    assert cv2.imwrite(str(root / crop_path), image)
                    rows.append(
                        (
                            subject,
                            sample,
                            class_id,
                            class_name,
                            frame_index,
                            frame_index / 25,
                            crop_path.as_posix(),
                            "detected",
                        )
                    )
    columns = [
        "subject_name",
        "sample_name",
        "class_id",
        "class_name",
        "frame_index",
        "time_s",
        "crop_path",
        "detection",
    ]
    pd.DataFrame(rows, columns=columns).to_csv(root / "frames.csv", index=False)
    return root


def write_fold_file(path: Path, folds: dict[int, dict[str, tuple[str, ...]]]) -> Path:
    rows = [
        (fold, subject, role) for fold, roles in folds.items() for role, names in roles.items() for subject in names
    ]
    pd.DataFrame(rows, columns=["fold", "subject_name", "role"]).to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def processed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared, read-only: 6 subjects x 5 classes x 2 videos x 2 frames."""
    return make_processed(tmp_path_factory.mktemp("processed"))


@pytest.fixture(scope="module")
def fold_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fold_file(tmp_path_factory.mktemp("folds") / "kfold2_all6.csv", FOLDS)


def make_datamodule(
    processed_dir: Path, fold_file: Path, fold: int = 0, task: str = "five_class", augment: str = "heavy", **options
) -> PainDataModule:
    seed = options.pop("seed", 0)
    params = OmegaConf.to_container(OmegaConf.load(AUGMENT_DIR / f"{augment}.yaml"))
    loader = loader_config(**{"batch_size": 8, "num_workers": 0, **options})
    datamodule = PainDataModule(processed_dir, SubjectRoles.of_fold(fold_file, fold), get_task(task), FakeDataConfig(),
                                params, loader, seed=seed)
    datamodule.setup("fit")
    return datamodule


def test_batches_have_model_shapes_and_task_labels(processed: Path, fold_file: Path) -> None:
    datamodule = make_datamodule(processed, fold_file, task="bl1_vs_pa2")
    table = pd.read_csv(processed / "frames.csv")
    task = get_task("bl1_vs_pa2")
    loaders = {
        "train": datamodule.train_dataloader(),
        "val": datamodule.val_dataloader(),
        "test": datamodule.test_dataloader(),
    }
    for split, loader in loaders.items():
        seen = []
        for images, labels, rows in loader:
            assert images.dtype == torch.float32 and images.shape[1:] == (3, 32, 32)
            assert labels.dtype == torch.int64 and rows.dtype == torch.int64
            assert len(images) == len(labels) == len(rows) <= loader.batch_size
            # The row index leads back to the frame table, whose class gives the label.
            expected = [task.classes.index(name) for name in table.loc[rows.numpy(), "class_name"]]
            assert labels.tolist() == expected
            seen.extend(rows.tolist())
        assert sorted(seen) == sorted(datamodule.frames(split).index)  # every frame once per epoch
    assert loaders["val"].batch_size == 16  # evaluation batches default to twice the training batch


def test_eval_order_follows_frames_and_is_deterministic(processed: Path, fold_file: Path) -> None:
    datamodule = make_datamodule(processed, fold_file)
    first = [(images, rows) for images, _, rows in datamodule.test_dataloader()]
    second = [(images, rows) for images, _, rows in datamodule.test_dataloader()]
    assert torch.cat([rows for _, rows in first]).tolist() == datamodule.frames("test").index.tolist()
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, second, strict=True))


@pytest.mark.parametrize("fold", [0, 1])
def test_splits_are_disjoint_and_match_the_fold_file(processed: Path, fold_file: Path, fold: int) -> None:
    datamodule = make_datamodule(processed, fold_file, fold=fold)
    subjects = {split: set(datamodule.frames(split)["subject_name"]) for split in ("train", "val", "test")}
    assert subjects == {role: set(names) for role, names in FOLDS[fold].items()}
    assert not (
        subjects["train"] & subjects["val"]
        or subjects["train"] & subjects["test"]
        or subjects["val"] & subjects["test"]
    )


@pytest.mark.parametrize(("task_name", "n_classes"), [("five_class", 5), ("bl1_vs_pa4", 2)])
def test_task_filters_classes_and_labels(processed: Path, fold_file: Path, task_name: str, n_classes: int) -> None:
    datamodule = make_datamodule(processed, fold_file, task=task_name)
    task = get_task(task_name)
    summary = datamodule.split_summary()
    for split, roles in FOLDS[0].items():
        rows = datamodule.frames(split)
        assert set(rows["class_name"]) == set(task.classes)
        assert (rows["label"] == rows["class_name"].map(task.label_map())).all()
        assert rows["label"].dtype == np.int64
        per_class = len(roles) * 2 * len(FRAME_INDICES)  # subjects x videos x frames
        assert len(rows) == n_classes * per_class
        assert summary[split] == {
            "subjects": len(roles),
            "videos": len(roles) * n_classes * 2,
            "frames": len(rows),
            "class_counts": dict.fromkeys(task.classes, per_class),
            "subject_names": sorted(roles),
        }


def test_balanced_sampling_evens_out_an_imbalanced_set(tmp_path: Path, fold_file: Path) -> None:
    processed = make_processed(tmp_path, videos_per_class={"BL1": 4, "PA4": 1})
    pain_share = {}
    for balanced in (False, True):
        datamodule = make_datamodule(processed, fold_file, task="bl1_vs_pa4", balanced_sampling=balanced, seed=3)
        labels = datamodule.frames("train")["label"].to_numpy()
        assert labels.mean() == pytest.approx(0.2)  # PA4 (label 1) is one frame in five
        sampler = datamodule.train_dataloader().sampler
        draws = []
        for epoch in range(20):
            sampler.set_epoch(epoch)
            draws += [index for index, _ in sampler]
        pain_share[balanced] = labels[draws].mean()
        # Keyed by (seed, fold, epoch): a fresh datamodule with the same seed draws epoch 7 the same, unlike epoch 8.
        again = make_datamodule(processed, fold_file, task="bl1_vs_pa4", balanced_sampling=balanced, seed=3)
        again = again.train_dataloader().sampler
        again.set_epoch(7)
        epoch_7 = [index for index, _ in again]
        assert epoch_7 == draws[7 * len(labels): 8 * len(labels)]
        assert list(again) != list(sampler)
    assert pain_share[False] == pytest.approx(0.2)  # plain shuffling keeps the imbalance
    assert 0.42 < pain_share[True] < 0.58  # 600 balanced draws


def test_shuffle_is_seeded(processed: Path, fold_file: Path) -> None:
    def order(seed: int) -> list[int]:
        loader = make_datamodule(processed, fold_file, augment="none", seed=seed).train_dataloader()
        return torch.cat([rows for _, _, rows in loader]).tolist()

    assert order(1) == order(1)
    assert order(1) != order(2)


def epoch_batches(loader, epoch: int) -> list:
    loader.sampler.set_epoch(epoch)  # what Lightning does before every training epoch
    return [(images, rows) for images, _, rows in loader]


def test_an_epoch_draws_the_same_whatever_ran_before_and_however_many_workers(processed: Path,
                                                                           fold_file: Path) -> None:
    """Epoch 2 straight away (a fold resumed from its epoch-1 checkpoint), in two persistent workers, equals epoch 2
    after epochs 0 and 1 in the main process: the same crops in the same order with the same augmentations, to the
    bit. As in a resumed fit, the first epoch comes from the restored DataModule state, not from set_epoch: Lightning
    iterates that epoch's loader (and workers prefetch from it) before it calls set_epoch."""
    straight = make_datamodule(processed, fold_file, seed=5).train_dataloader()
    epochs = [epoch_batches(straight, epoch) for epoch in range(3)]
    resumed_module = make_datamodule(processed, fold_file, seed=5, num_workers=2)
    resumed_module.load_state_dict({"next_epoch": 2})
    resumed = resumed_module.train_dataloader()
    assert resumed.persistent_workers
    again = [(images, rows) for images, _, rows in resumed]
    assert resumed.sampler.drawn_epoch == 2
    assert len(again) == len(epochs[2])
    for (images, rows), (images_again, rows_again) in zip(epochs[2], again, strict=True):
        assert torch.equal(rows, rows_again) and torch.equal(images, images_again)
    assert not torch.equal(epochs[1][0][1], epochs[2][0][1])  # each epoch has an order of its own


def test_workers_draw_their_own_augmentations(tmp_path: Path, fold_file: Path) -> None:
    # All crops are the same picture: copies of one random stream in two workers would yield identical tensors.
    processed = make_processed(tmp_path, same_image=True)
    datamodule = make_datamodule(processed, fold_file, batch_size=1, num_workers=2, prefetch_factor=1)
    iterator = iter(datamodule.train_dataloader())
    first_worker, second_worker = next(iterator)[0], next(iterator)[0]
    assert not torch.equal(first_worker, second_worker)
    del iterator


def test_loader_options_follow_worker_count(processed: Path, fold_file: Path) -> None:
    assert 1 <= default_num_workers() <= 8
    loader = make_datamodule(processed, fold_file, num_workers=0, persistent_workers=True).train_dataloader()
    assert loader.num_workers == 0 and not loader.persistent_workers and loader.prefetch_factor is None
    assert loader.pin_memory == torch.cuda.is_available()


def test_missing_or_corrupt_crop_names_the_file(tmp_path: Path, fold_file: Path) -> None:
    processed = make_processed(tmp_path)
    datamodule = make_datamodule(processed, fold_file, augment="none")
    first = datamodule.frames("val").iloc[0]
    (processed / first["crop_path"]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{first['crop_path']} \(missing\), frame-table row {first.name}"):
        list(datamodule.val_dataloader())
    second = datamodule.frames("test").iloc[3]
    (processed / second["crop_path"]).write_bytes(b"not a jpeg")
    with pytest.raises(FileNotFoundError, match=rf"{second['crop_path']} \(unreadable\), frame-table row"):
        list(datamodule.test_dataloader())


def test_leaking_fold_file_fails_on_setup(processed: Path, tmp_path: Path) -> None:
    leaking = {0: {**FOLDS[0], "test": (*FOLDS[0]["test"], SUBJECTS[0])}}  # SUBJECTS[0] is also in train
    fold_file = write_fold_file(tmp_path / "leak.csv", leaking)
    with pytest.raises(FoldError, match=f"leak.*{SUBJECTS[0]}|{SUBJECTS[0]}.*leak"):
        make_datamodule(processed, fold_file)


def test_fold_subject_without_frames_is_named(processed: Path, tmp_path: Path) -> None:
    folds = {0: {**FOLDS[0], "train": (*FOLDS[0]["train"], "123456_m_99")}}
    with pytest.raises(ValueError, match="123456_m_99"):
        make_datamodule(processed, write_fold_file(tmp_path / "extra.csv", folds))


def test_fold_file_over_a_subset_of_subjects(processed: Path, tmp_path: Path) -> None:
    # Like BioVid's 67-responder folds over a frame table of all 87: frames of unlisted subjects are left out.
    subset = {0: {"train": SUBJECTS[:2], "val": SUBJECTS[2:3], "test": SUBJECTS[3:4]}}
    datamodule = make_datamodule(processed, write_fold_file(tmp_path / "subset.csv", subset))
    used = set().union(*(set(datamodule.frames(split)["subject_name"]) for split in ("train", "val", "test")))
    assert used == set(SUBJECTS[:4])


def test_role_without_task_frames_is_an_error(tmp_path: Path, fold_file: Path) -> None:
    processed = make_processed(tmp_path)
    table = pd.read_csv(processed / "frames.csv")
    test_subjects = FOLDS[0]["test"]
    keep = ~(table["subject_name"].isin(test_subjects) & table["class_name"].isin(["BL1", "PA4"]))
    table[keep].to_csv(processed / "frames.csv", index=False)
    with pytest.raises(ValueError, match="role 'test' has no frames of task bl1_vs_pa4"):
        make_datamodule(processed, fold_file, task="bl1_vs_pa4")
    # the five-class task still has their PA1-PA3 videos; a binary task keeps none of a subject with one of its classes
    make_datamodule(processed, fold_file, task="five_class")


def test_from_s_keeps_only_later_crops_of_every_video(processed: Path, fold_file: Path) -> None:
    every = make_datamodule(processed, fold_file)
    late = make_datamodule(processed, fold_file, from_s=2.0)  # crops at 1.6 s and 3.2 s: only the second stays
    for split in ("train", "val", "test"):
        frames = late.frames(split)
        assert set(frames["frame_index"]) == {FRAME_INDICES[1]}
        assert (frames["time_s"] >= 2.0).all()
        assert set(frames["sample_name"]) == set(every.frames(split)["sample_name"])  # no video lost


def test_from_s_past_every_crop_names_the_frame_table(processed: Path, fold_file: Path) -> None:
    with pytest.raises(ValueError, match=r"frames\.csv: .*no crop at or after loader\.from_s=3\.5"):
        make_datamodule(processed, fold_file, from_s=3.5)
    with pytest.raises(ValueError, match="from_s must be >= 0"):
        make_datamodule(processed, fold_file, from_s=-1.0)


def test_a_participant_with_one_class_of_a_binary_task_is_left_out_of_it(tmp_path: Path, fold_file: Path) -> None:
    processed = make_processed(tmp_path)
    table = pd.read_csv(processed / "frames.csv")
    lonely = FOLDS[0]["train"][0]  # keeps its BL1 videos but none of PA4
    table[~((table["subject_name"] == lonely) & (table["class_name"] == "PA4"))].to_csv(
        processed / "frames.csv", index=False)
    binary = make_datamodule(processed, fold_file, task="bl1_vs_pa4")
    assert set(binary.frames("train")["subject_name"]) == set(FOLDS[0]["train"]) - {lonely}
    five = make_datamodule(processed, fold_file, task="five_class")  # it still has four of the five classes
    assert lonely in set(five.frames("train")["subject_name"])


def test_the_frame_table_is_parsed_once_a_file_and_read_again_when_rewritten(tmp_path: Path) -> None:
    """A worker setting up many folds parses frames.csv once: each caller gets its own copy; a rewritten file (an
    atomic write: another inode, size or time) is parsed again, and its errors are still named."""
    frames_csv = make_processed(tmp_path) / "frames.csv"
    first = read_frame_table(frames_csv)
    first.loc[first.index[0], "class_name"] = "changed by a caller"
    second = read_frame_table(frames_csv)
    assert second["class_name"].iloc[0] != "changed by a caller" and len(second) == len(first)
    fewer = pd.read_csv(frames_csv).iloc[1:]
    atomic_write_csv(frames_csv, fewer)
    assert len(read_frame_table(frames_csv)) == len(first) - 1
    broken = fewer.assign(class_name=["PA9"] + list(fewer["class_name"].iloc[1:]))
    atomic_write_csv(frames_csv, broken)
    with pytest.raises(ValueError, match=r"frames.csv, frame-table row 0 \(0-based\): unknown class_name 'PA9'"):
        read_frame_table(frames_csv)
