"""Probes fitted in lockstep (pipeline/models/probe_batch.py) are the in-memory probe's (`probe_training.fit_probe`):
the same selected epoch, head weights and validation score for every fold, seed and degradation, on a replicate of a
small population split as a CV's folds are (`population.ReplicateDataModule`); and what they cannot fit is refused."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.analysis.population import PERSON, Population, ReplicateDataModule, shift_matrix
from pipeline.analysis.resampled_cv import FoldSplit, initial_head
from pipeline.data.datamodule import LoaderConfig
from pipeline.data.embeddings import EmbeddingTable
from pipeline.data.tasks import get_task
from pipeline.models.backbones import PainNet, create_backbone
from pipeline.models.finetune import FrozenOnEmbeddings
from pipeline.models.fold_result import FoldResult
from pipeline.models.lightning_module import OptimConfig, PainLightningModule
from pipeline.models.probe_batch import BatchRecipe, Embeddings, ProbeSpec, check_recipe, fit_probes
from pipeline.models.probe_training import ProbeTraining, WrittenOutSteps, fit_probe
from pipeline.utils.config import load_config

TASK = get_task("bl1_vs_pa4")


def small_population(n_people: int, features: int, seed: int) -> Population:
    """People with 2 BL1 and 2 PA4 videos of 5 crops each, embeddings of `features` dimensions: a person's own
    offset, a pain direction scaled by how much the person shows, and each crop's noise."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(0, 1, features)
    rows, plain = [], []
    for person in range(n_people):
        offset, shows = rng.normal(0, 1, features), rng.uniform(0, 0.6)
        for video, cls in enumerate(("BL1", "BL1", "PA4", "PA4")):
            for frame in range(5):
                rows.append({"subject_name": f"p{person:02d}", "sample_name": f"p{person:02d}-{cls}-{video:03d}",
                             "class_name": cls, "frame_index": frame, "time_s": 2.0 + frame / 2,
                             "crop_path": "none", PERSON: f"0:p{person:02d}"})
                plain.append(offset + (cls == "PA4") * shows * direction + rng.normal(0, 1, features))
    frames = pd.DataFrame(rows)
    frames.index.name = "frame_row"
    values = np.asarray(plain, dtype=np.float32)
    return Population(frames, pd.Series({f"0:p{p:02d}": True for p in range(n_people)}, name="responder"),
                      EmbeddingTable(np.arange(len(frames)), values, np.zeros((0, *values.shape), np.float32)),
                      rng.uniform(0, 1, (len(frames), 4)).astype(np.float32), 0.0)


def fold_table(names: list[str], folds: int, val: int) -> pd.DataFrame:
    """k folds over `names`: each tests its share, validates on the next `val` people, trains on the rest."""
    rows = []
    for fold in range(folds):
        test = names[fold::folds]
        rest = [n for n in names if n not in test]
        held = rest[fold * val % len(rest):][:val]
        rows += [{"fold": fold, "subject_name": n, "role": "test" if n in test else "val" if n in held else "train"}
                 for n in names]
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def replicate() -> dict:
    population = small_population(18, 512, seed=1)
    frames = population.frames.assign(subject_name=population.frames["subject_name"].str.upper(),
                                      sample_name=population.frames["sample_name"].str.upper())
    folds = fold_table(sorted(frames["subject_name"].unique()), 3, 3)
    backbone, _ = create_backbone("resnet10t", pretrained=False, img_size=32)  # its 512 features' head
    cfg = load_config(["model=timm", "model.name=resnet10t", "loader.batch_size=16", "trainer.max_epochs=7",
                       "trainer.patience=3"])
    loader = LoaderConfig.from_config(cfg.loader, num_workers=0)
    return {"population": population, "frames": frames, "folds": folds, "backbone": backbone, "cfg": cfg,
            "loader": loader}


def in_memory_probe(replicate: dict, fold: int, seed: int, plain: np.ndarray, written_out: bool | None = None,
                    **loss: object) -> tuple[PainLightningModule, float, int]:
    """The in-memory probe of one fold and seed on these embeddings, from the head `initial_head` draws (`loss`: the
    module's label_smoothing or class_weights; `written_out`: the fit's steps, `probe_training.training_steps`)."""
    module, fitted = probe_fit(replicate, fold, seed, plain, written_out, **loss)
    return module, fitted.best_score, fitted.best_epoch


def probe_fit(replicate: dict, fold: int, seed: int, plain: np.ndarray, written_out: bool | None = None,
              **loss: object) -> tuple[PainLightningModule, FoldResult]:
    """`in_memory_probe`'s module and its whole fit."""
    cfg, population = replicate["cfg"], replicate["population"]
    table = EmbeddingTable(population.embeddings.rows, plain, population.embeddings.views)
    datamodule = ReplicateDataModule(replicate["frames"], replicate["folds"], fold, TASK,
                                     replicate["backbone"].data_config, replicate["loader"], seed, table)
    datamodule.setup()
    net = PainNet(replicate["backbone"], 2)
    weight, bias = initial_head(seed, 512, 2)
    net.head.load_state_dict({"weight": weight, "bias": bias})
    strategy = FrozenOnEmbeddings()
    strategy.prepare(net)
    module = PainLightningModule(net, TASK.classes, OptimConfig(**OmegaConf.to_container(cfg.model.optim)),
                                 aggregation=cfg.trainer.aggregation, topk=cfg.trainer.topk, decoding=cfg.eval.decoding,
                                 monitor=cfg.trainer.monitor, finetune=strategy, **loss)
    fitted = fit_probe(module, datamodule, ProbeTraining(cfg.trainer.max_epochs, cfg.trainer.patience,
                                                         cfg.trainer.monitor, cfg.trainer.monitor_mode,
                                                         cfg.trainer.gradient_clip_val), written_out=written_out)
    return module, fitted


def test_the_lockstep_probes_are_the_in_memory_probes(replicate) -> None:
    """Three folds, two seeds, plain and degraded embeddings (noise 0.8 of each dimension's spread): twelve probes
    fitted at once select the epoch, keep the weights and reach the validation AUROC the in-memory probe does, one
    by one; a probe reading degraded embeddings is the in-memory probe of those embeddings."""
    cfg, population = replicate["cfg"], replicate["population"]
    plain = torch.from_numpy(population.embeddings.plain)
    noise = (torch.randn(plain.shape, generator=torch.Generator().manual_seed(5)) * plain.std(dim=0)).half()
    embeddings = Embeddings(plain, noise)  # the shift a probe adds at its scale: here a noise draw
    splits = [FoldSplit.of(ReplicateDataModule(replicate["frames"], replicate["folds"], fold, TASK,
                                               replicate["backbone"].data_config, replicate["loader"], 0,
                                               population.embeddings)) for fold in range(3)]
    cases = [(split, seed, level) for level in (0.0, 0.8) for seed in (3, 4) for split in splits]
    specs = [ProbeSpec(split.train, split.train_labels, split.val, split.val_codes,
                       split.val_videos["label"].to_numpy(), seed, split.fold, *initial_head(seed, 512, 2),
                       level) for split, seed, level in cases]
    recipe = BatchRecipe(cfg.loader.batch_size, cfg.trainer.max_epochs, cfg.trainer.patience, cfg.model.optim.head_lr,
                         cfg.model.optim.weight_decay, cfg.model.optim.warmup_epochs, cfg.trainer.gradient_clip_val)
    fit = fit_probes(embeddings, specs, recipe)
    assert len(set(fit.epochs.tolist())) > 1  # the probes stopped at different epochs: lockstep lets each go
    for index, (split, seed, level) in enumerate(cases):
        degraded = (plain + level * noise.float()).numpy()
        module, score, epoch = in_memory_probe(replicate, split.fold, seed, degraded)
        assert (fit.best_epoch[index], fit.epochs[index] >= epoch) == (epoch, True), (split.fold, seed, level)
        assert fit.best_score[index] == pytest.approx(score, abs=1e-6)
        torch.testing.assert_close(fit.weight[index], module.model.head.weight.detach(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(fit.bias[index], module.model.head.bias.detach(), atol=2e-5, rtol=1e-4)


def test_what_the_lockstep_probes_do_not_reproduce_is_refused() -> None:
    check_recipe("val/video_auroc", "mean", 0, False, 0.0, None)
    with pytest.raises(ValueError, match=r"not trainer.monitor='val/loss', cache.views=2"):
        check_recipe("val/loss", "mean", 2, False, 0.0, None)


def test_copy_bs_shift_is_the_crops_action_units_projected_or_a_noise_draw() -> None:
    """`action_units`: every crop's shift is a linear function of its four action units (standardised over the
    population), the same projection for all crops, repeatable from its seed; `noise` is not; another knob is refused
    by name."""
    population = small_population(6, 32, seed=2)
    units = population.action_units.astype(np.float64)
    standard = np.column_stack([(units - units.mean(axis=0)) / units.std(axis=0, ddof=1), np.ones(len(units))])
    for knob, in_span in (("action_units", True), ("noise", False)):
        shift = shift_matrix(population, knob, seed=3).float().numpy()
        assert shift.shape == population.embeddings.plain.shape
        torch.testing.assert_close(shift_matrix(population, knob, seed=3).float().numpy(), shift)
        fitted = standard @ np.linalg.lstsq(standard, shift, rcond=None)[0]
        residual = np.abs(shift - fitted).max() / np.abs(shift).max()
        assert (residual < 1e-2) == in_span, (knob, residual)  # float16 keeps about three digits
    with pytest.raises(ValueError, match="knob='pixels': expected noise or action_units"):
        shift_matrix(population, "pixels", seed=3)


@pytest.mark.parametrize("fold, seed, smoothing", [(0, 3, 0.0), (1, 4, 0.0), (2, 3, 0.1)])
def test_the_written_out_steps_are_torchs_steps(replicate, fold, seed, smoothing) -> None:
    """The in-memory probe's written-out steps (`head_steps`: the default probe's) and its steps through autograd,
    torch's AdamW and the scheduler fit the same probe: every epoch's loss, accuracy, validation score and learning
    rate, the best epoch and the kept head."""
    plain = replicate["population"].embeddings.plain
    fits = {written: probe_fit(replicate, fold, seed, plain, written, label_smoothing=smoothing)
            for written in (True, False)}
    (written_module, written), (torch_module, through_torch) = fits[True], fits[False]
    assert WrittenOutSteps.fits(written_module) and written.epochs_trained >= 3
    assert (written.best_epoch, written.epochs_trained) == (through_torch.best_epoch, through_torch.epochs_trained)
    for ours, theirs in zip(written.history, through_torch.history, strict=True):
        assert ours.keys() == theirs.keys()
        for name, value in theirs.items():
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    torch.testing.assert_close(written_module.model.head.state_dict(), torch_module.model.head.state_dict(),
                               atol=1e-6, rtol=0)


def test_a_head_the_written_out_steps_cannot_fit_goes_through_torch(replicate) -> None:
    """Class weights change the loss's gradient: such a probe steps through autograd, and asking for the written-out
    steps anyway is refused."""
    plain = replicate["population"].embeddings.plain
    module, _ = probe_fit(replicate, 0, 3, plain, class_weights=[1.0, 2.0])
    assert not WrittenOutSteps.fits(module)
    with pytest.raises(ValueError, match="the written-out steps fit a plain linear softmax head alone"):
        probe_fit(replicate, 0, 3, plain, True, class_weights=[1.0, 2.0])
