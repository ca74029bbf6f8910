"""`make aug-preview`: a PNG grid of training-augmented crops at the input size and normalisation of `cfg.model`, the
way the model sees them."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from pipeline.data.augment import build_train_transform, save_augmentation_preview
from pipeline.data.prepare import DataSettings, prepare_data, processed_frames
from pipeline.models.backbones import create_backbone
from pipeline.utils.paths import resolve_path


def run_aug_preview(cfg: DictConfig) -> None:
    """Write a PNG grid of training-augmented crops, as the model of `cfg.model` would see them."""
    data = DataSettings.from_config(cfg)
    frames = processed_frames(data)
    if frames is None:
        frames = prepare_data(data)[0].frames
    backbone, _ = create_backbone(cfg.model.name, pretrained=False, img_size=cfg.model.img_size)
    transform = build_train_transform(backbone.data_config, OmegaConf.to_container(cfg.augment),
                                      cfg.loader.crop_fraction)
    picks = frames.groupby("class_name", group_keys=False).apply(lambda g: g.sample(min(len(g), 2), random_state=0))
    paths = [resolve_path(cfg.data.processed_dir) / p for p in picks.crop_path]
    out = resolve_path(cfg.reports_dir) / f"aug_preview_{cfg.data.name}_{cfg.model.name}.png"
    save_augmentation_preview(paths, transform, backbone.data_config, out, n=4 * len(paths), seed=cfg.seed)
    print(f"augmentation preview: {out}")
