"""The fine-tuning recipe: discriminative learning rates that the scheduler really applies, group by group."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch

from pipeline.data.datamodule import PainDataModule, SubjectRoles
from pipeline.data.frame_dataset import FrameDataset
from pipeline.data.tasks import get_task
from pipeline.models.callbacks import FreezeBackbone, ResumableEarlyStopping
from pipeline.models.factory import create_model
from pipeline.models.lightning_module import OptimConfig, PainLightningModule, parameter_groups, warmup_cosine
from pipeline.utils.paths import resolve_path
from tests.conftest import loader_config

OPTIM = OptimConfig(head_lr=1e-2, backbone_lr=1e-3, layer_decay=0.5, weight_decay=0.05, warmup_epochs=1,
                    freeze_backbone_epochs=0)


class RecordLearningRates(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[list[float]] = []
        self.frozen: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append([group["lr"] for group in trainer.optimizers[0].param_groups])
        self.frozen.append(not any(p.requires_grad for p in pl_module.model.backbone.parameters()))


def test_warmup_cosine_shape() -> None:
    assert warmup_cosine(0, 4, 20) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20) == pytest.approx(0.5)
    assert warmup_cosine(20, 4, 20) == pytest.approx(0.0)


def test_groups_get_layer_decayed_rates_and_no_decay_for_norms() -> None:
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, img_size=32)
    groups = parameter_groups(net, OPTIM)
    lr_of = {g["name"].removesuffix(".no_decay"): g["lr"] for g in groups}
    assert lr_of["head"] == OPTIM.head_lr
    backbone_names = [name for name, _ in net.backbone.parameter_groups()]
    assert lr_of[backbone_names[-1]] == pytest.approx(OPTIM.backbone_lr)
    assert lr_of[backbone_names[0]] == pytest.approx(OPTIM.backbone_lr * 0.5 ** (len(backbone_names) - 1))
    assert all(p.ndim <= 1 for g in groups if g["name"].endswith("no_decay") for p in g["params"])
    assert all(g["weight_decay"] == 0 for g in groups if g["name"].endswith("no_decay"))
    n_params = sum(len(g["params"]) for g in groups)
    assert n_params == len(list(net.parameters()))


def test_scheduler_applies_each_groups_own_rate(tiny_config) -> None:
    """Train for real with Lightning and read the optimizer's per-group LRs at every step."""
    cfg = tiny_config()
    task = get_task("bl1_vs_pa4")
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, img_size=32)
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                task,
                                net.backbone.data_config, {}, loader_config(batch_size=4, num_workers=0), cfg.seed)
    module = PainLightningModule(net, task.classes, OPTIM, aggregation="mean", topk=3)
    recorder = RecordLearningRates()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[recorder, FreezeBackbone(1)])
    trainer.fit(module, datamodule=datamodule)

    base = [g["lr"] for g in parameter_groups(net, OPTIM)]
    steps_per_epoch = len(recorder.steps) // 3
    total = steps_per_epoch * 3
    for step, lrs in enumerate(recorder.steps):
        multiplier = warmup_cosine(step, steps_per_epoch, total)
        assert lrs == pytest.approx([b * multiplier for b in base], rel=1e-6), f"step {step}"
    # the ratios between groups hold throughout: the head stays 10x the top block, the stem far lower
    last = recorder.steps[-1]
    assert last[-1] / last[-3] == pytest.approx(OPTIM.head_lr / OPTIM.backbone_lr)
    assert not math.isclose(last[0], last[-1])
    # frozen-backbone warm-up: the first epoch trains only the head
    assert recorder.frozen[:steps_per_epoch] == [True] * steps_per_epoch
    assert not any(recorder.frozen[steps_per_epoch:])


def test_frozen_backbone_does_not_move(tiny_config) -> None:
    cfg = tiny_config()
    task = get_task("bl1_vs_pa4")
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, img_size=32)
    before = {k: v.clone() for k, v in net.backbone.state_dict().items()}
    head_before = net.head.weight.clone()
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                task,
                                net.backbone.data_config, {}, loader_config(batch_size=4, num_workers=0), cfg.seed)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[FreezeBackbone(1)])
    trainer.fit(PainLightningModule(net, task.classes, OPTIM, aggregation="mean", topk=3), datamodule=datamodule)
    assert all(torch.equal(before[k], v) for k, v in net.backbone.state_dict().items())
    assert not torch.equal(head_before, net.head.weight)


class RecordGradientNorms(pl.Callback):
    """Gradient norm before clipping (Lightning's hook) and after it (what the optimizer step really sees)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []
        self.fused: list[bool] = []

    @staticmethod
    def _norm(optimizer: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        self.fused.append(bool(optimizer.defaults.get("fused")))
        # Lightning runs forward and backward inside optimizer.step(closure): the gradients the update used are read
        # after the step (it leaves them as they were; zero_grad comes before the next backward)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after.append(self._norm(opt)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before.append(self._norm(optimizer))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fused_adamw_still_clips_gradients(tiny_config, precision: str) -> None:
    """AdamW is fused on the CPU (a third of a ViT-B step otherwise); Lightning's AMP plugin refuses to clip a fused
    optimizer, so the module clips itself: the step must see the clipped norm, in fp32 and in bf16 autocast."""
    cfg = tiny_config()
    task = get_task("bl1_vs_pa4")
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, img_size=32)
    datamodule = PainDataModule(resolve_path(cfg.data.processed_dir),
                                SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                task,
                                net.backbone.data_config, {}, loader_config(batch_size=4, num_workers=0), cfg.seed)
    recorder = RecordGradientNorms()
    clip = 1e-3
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, accelerator="cpu", logger=False, precision=precision,
                         gradient_clip_val=clip, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(PainLightningModule(net, task.classes, OPTIM, aggregation="mean", topk=3), datamodule=datamodule)
    assert recorder.fused == [True]
    assert len(recorder.before) == len(recorder.after) == 3
    assert min(recorder.before) > 10 * clip  # clipping had work to do
    assert max(recorder.after) == pytest.approx(clip, rel=1e-3)


class OneClassValidation(PainDataModule):
    """The fold's data with a validation split that holds no-pain videos only: its AUROC is undefined. (Cut after
    the split: a participant with one class of a binary task is left out of it before, as unusable.)"""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        validation = self._splits["val"]
        self._splits["val"] = validation[validation["class_name"] == "BL1"]
        self._datasets["val"] = FrameDataset(self._splits["val"], self.processed_dir, self.eval_transform)


def one_class_fit(cfg, monitor: str) -> tuple[PainLightningModule, pl.Trainer]:
    task = get_task("bl1_vs_pa4")
    net, _ = create_model("vit_tiny_patch16_224", n_classes=2, img_size=32)
    datamodule = OneClassValidation(resolve_path(cfg.data.processed_dir),
                                    SubjectRoles.of_fold(resolve_path(cfg.fold_file), 0),
                                    task, net.backbone.data_config, {}, loader_config(batch_size=8, num_workers=0),
                                    cfg.seed)
    module = PainLightningModule(net, task.classes, OPTIM, aggregation="mean", topk=3, monitor=monitor)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=datamodule)
    return module, trainer


def test_an_undefined_metric_stays_nan_and_is_named(tiny_config, caplog) -> None:
    """AUROC over one class is undefined: it is logged as NaN (never as 0) with a warning naming the split."""
    with caplog.at_level("WARNING", logger="pipeline.models.lightning_module"):
        _, trainer = one_class_fit(tiny_config(), monitor="val/loss")
    assert math.isnan(float(trainer.callback_metrics["val/video_auroc"]))
    assert math.isfinite(float(trainer.callback_metrics["val/loss"]))
    assert float(trainer.callback_metrics["val/video_accuracy"]) >= 0  # defined metrics stay as they are
    warning = next(r.getMessage() for r in caplog.records if "undefined" in r.getMessage())
    assert warning.startswith("val split") and "val/video_auroc" in warning and "'BL1'" in warning


def test_an_undefined_monitored_metric_stops_with_what_to_do(tiny_config) -> None:
    with pytest.raises(ValueError, match=r"val/video_auroc is undefined.*trainer.monitor=val/loss"):
        one_class_fit(tiny_config(), monitor="val/video_auroc")


class ConstantScore(pl.LightningModule):
    """A one-weight model whose validation score never changes: early stopping with patience 1 stops after epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return (self.weight - batch[0]).pow(2).sum()

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val/score", 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 1), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=2)


@pytest.mark.parametrize(("early_stopping", "epochs_after_resume"),
                         [(ResumableEarlyStopping, 2), (pl.callbacks.EarlyStopping, 3)])
def test_early_stopping_decision_survives_a_resume(tmp_path, early_stopping, epochs_after_resume: int) -> None:
    def trainer() -> pl.Trainer:
        last = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="last", monitor=None, save_top_k=1,
                                            enable_version_counter=False)
        return pl.Trainer(max_epochs=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[early_stopping(monitor="val/score", mode="max", patience=1), last],
                          num_sanity_val_steps=0, default_root_dir=tmp_path)

    straight = trainer()
    straight.fit(ConstantScore())
    assert straight.current_epoch == 2  # epochs 0 and 1 ran; epoch 1 decided to stop, then wrote last.ckpt
    resumed = trainer()
    resumed.fit(ConstantScore(), ckpt_path=str(tmp_path / "last.ckpt"))
    # ours stops where the straight run stopped; Lightning's own trains one more epoch
    assert resumed.current_epoch == epochs_after_resume
