"""`make inspect`: where the kept fold models of a cross-validation look, on each fold's test videos only.

For every fold with a kept model (`model/model.pt` on its FINISHED child run):

- maps on every test crop: attention rollout (ViT backbones; `pipeline.analysis.attention`) and Grad-CAM (every
  backbone; `pipeline.analysis.gradcam`), averaged per video (`pipeline.analysis.fold_maps`);
- a grid image of test videos (pain and no-pain, predicted right and wrong): a crop, then each method's overlay
  (`pipeline.analysis.inspection_plots`);
- the region score of each method (`pipeline.analysis.regions`): the share of map mass inside the action-unit regions
  over the regions' share of the area, where the dataset records those regions (the synthetic twin);
- for ViT backbones, the ViT paper's inspections: patch-embedding filters (principal components as RGB patches),
  cosine similarity of the position embeddings, and the mean attention distance of every head in every layer.

Numbers go to the fold's child run (`inspect/...` metrics, CSV tables) and their mean and spread over folds to the
parent run. Pictures are written under `reports/inspect/`; they are logged to MLflow only for the synthetic twin. On
BioVid (participants' faces, biometric data under a data-use agreement) no image and no map leaves the user's disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.entities import Metric, Run
from omegaconf import DictConfig, OmegaConf

from pipeline.analysis.fold_maps import PREFIX, FoldInspection, RegionMasks, inspect_fold
from pipeline.analysis.inspection_plots import write_fold_outputs
from pipeline.data.datamodule import LoaderConfig, PainDataModule, SubjectRoles
from pipeline.data.fold_files import fold_file_sha256
from pipeline.data.prepare import is_twin
from pipeline.data.tasks import get_task
from pipeline.evaluation.metrics import summarize_folds
from pipeline.models.backbones import PainNet
from pipeline.models.factory import create_model
from pipeline.models.model_file import load_model_file
from pipeline.runs.store import cv_runs, tracking
from pipeline.runs.store.cv_runs import CvNotFound
from pipeline.utils.atomic_io import atomic_write_csv
from pipeline.utils.paths import resolve_path


class InspectionError(RuntimeError):
    """The cross-validation cannot be inspected (no such run, no kept models, other folds)."""


@dataclass(frozen=True)
class InspectSettings:
    """What `make inspect` reads of its config, read once by `run_inspect`: the CV to find and the store it is in,
    the dataset (whether its faces are drawn: a twin's), the fold file and crops, how crops are loaded (a kept
    model's own crop window replaces the group's), the seed of an untrained baseline, where pictures go."""

    cv: cv_runs.CvConfig
    tracking_uri: str
    dataset: str
    twin: bool
    fold_file: Path
    processed_dir: Path
    loader: dict  # the `loader` group, resolved
    seed: int
    reports_dir: Path


@dataclass
class Inspecting:
    """What every fold of one inspection shares: its settings, the store, the CV's parent run, trained models or the
    untrained baseline, the region masks, whether pictures may go to MLflow, and where they are written."""

    settings: InspectSettings
    client: MlflowClient
    uri: str
    parent: Run
    untrained: bool
    regions: RegionMasks | None
    images_allowed: bool
    out_root: Path

    @property
    def kind(self) -> str:
        return "untrained" if self.untrained else "trained"

    @property
    def prefix(self) -> str:
        """Where the numbers go on the runs: `inspect/`, or `inspect/untrained/` for the baseline."""
        return f"{PREFIX}/untrained/" if self.untrained else f"{PREFIX}/"


def inspect_cv(settings: InspectSettings, run_id: str | None = None, untrained: bool = False,
               regions: RegionMasks | None = None, no_regions_reason: str = "no region masks were given") -> dict:
    """Inspect every fold of a cross-validation (see the module docstring); returns the parent's summary and paths."""
    uri = settings.tracking_uri
    client = MlflowClient(uri)
    parent, children = inspected_cv(client, settings, run_id)
    parent_id, tags = parent.info.run_id, parent.data.tags
    dataset = tags.get(tracking.DATASET_TAG, settings.dataset)
    # face images go to MLflow only for a twin's drawn faces; recordings of people (BioVid) stay on disk
    images_allowed = dataset == settings.dataset and settings.twin
    out_root = (settings.reports_dir / "inspect" /
                f"{tags.get(tracking.MODEL_TAG)}_{dataset}_{tags.get(tracking.PROTOCOL_TAG)}_"
                f"{tags.get(tracking.TASK_TAG)}_{parent_id[:8]}"
                f"{'_untrained' if untrained else ''}")
    job = Inspecting(settings, client, uri, parent, untrained, regions, images_allowed, out_root)
    print(f"inspecting {parent.info.run_name!r} (parent run {parent_id}), {len(children)} fold(s), {job.kind} models")
    if images_allowed:
        print(f"pictures: {out_root} and the fold runs in MLflow (synthetic faces)")
    else:
        print(f"{dataset} faces are participants' biometric data: pictures and maps are written to {out_root} on "
              f"this disk only; MLflow gets numbers only")
    if regions is None:
        print(f"region score: not computed ({no_regions_reason})")
    inspections = [inspect_kept_model(job, fold, child) for fold, child in sorted(children.items())]
    summary = log_parent(client, parent_id, inspections, job.prefix, images_allowed, out_root)
    table = pd.DataFrame([{"fold": i.fold, "run_id": i.run_id, **i.metrics} for i in inspections])
    atomic_write_csv(out_root / "summary.csv", table)
    for line in summary_lines(inspections):
        print(line)
    print(f"written: {out_root}")
    return {"parent_run_id": parent_id, "summary": summary, "out_dir": out_root, "folds": inspections,
            "images_in_mlflow": images_allowed}


def inspected_cv(client: MlflowClient, settings: InspectSettings, run_id: str | None) -> tuple[Run, dict[int, Run]]:
    """The CV to inspect (`cv_runs.source_cv`) and its finished fold runs; an error when its fold file is not the
    config's (the test subjects could not be recovered), when it has no finished fold, or when it trained clip
    models (maps are of single crops)."""
    try:
        parent = cv_runs.source_cv(client, settings.cv, run_id)
    except CvNotFound as error:
        raise InspectionError(str(error)) from None
    parent_id, tags = parent.info.run_id, parent.data.tags
    fold_file = settings.fold_file
    if not fold_file.is_file() or fold_file_sha256(fold_file) != tags.get(tracking.FOLD_FILE_TAG):
        raise InspectionError(f"the fold file {fold_file} is not the one cross-validation {parent_id} ran on "
                              f"(SHA-256 {tags.get(tracking.FOLD_FILE_TAG)}); its test subjects cannot be recovered")
    children = tracking.finished_fold_runs(client, parent_id)
    if not children:
        raise InspectionError(f"cross-validation {parent_id} has no finished fold runs")
    if tags.get(tracking.HEAD_TAG, "linear") not in ("", "linear"):  # maps and region scores are of single crops
        raise InspectionError(f"cross-validation {parent_id} trained clip models ({tags[tracking.HEAD_TAG]}): make "
                              f"inspect draws "
                              f"attention and Grad-CAM maps of frame models only; inspect the frame model's CV of "
                              f"the same backbone (model.head.name=linear)")
    return parent, children


def inspect_kept_model(job: Inspecting, fold: int, child: Run) -> FoldInspection:
    """One fold: its kept model (or an untrained one like it) on the fold's test crops, with the model's own crop
    window; the pictures and tables written, the numbers logged on the fold run."""
    settings, params = job.settings, job.parent.data.params
    try:
        net, meta = load_model_file(child.info.run_id, tracking_uri=job.uri)
    except Exception as error:  # a CV run with cv.log_models=false keeps no model
        raise InspectionError(f"fold {fold}: no kept model in child run {child.info.run_id} ({error}); "
                              f"cross-validations run with cv.log_models=false cannot be inspected") from error
    if job.untrained:
        net = untrained_like(meta, seed=settings.seed + fold)
    net = net.to("cuda" if torch.cuda.is_available() else "cpu")
    loader = meta.get("loader", {})
    # the kept model's own crop window and crops per clip, in this process, one batch size throughout
    loading = LoaderConfig.from_config(
        settings.loader, eval_batch_size=int(settings.loader["batch_size"]), num_workers=0,
        frames_per_video=loader.get("frames_per_video"), crop_fraction=loader.get("crop_fraction") or 1.0,
        from_s=loader.get("from_s"))
    roles = SubjectRoles.of_fold(settings.fold_file, fold)
    datamodule = PainDataModule(settings.processed_dir, roles, get_task(meta["task"]), net.backbone.data_config, {},
                                loading, settings.seed)
    datamodule.setup()
    started = time.perf_counter()
    inspection = inspect_fold(net, datamodule, meta["class_names"], fold, child.info.run_id, job.regions,
                              crop_fraction=loader.get("crop_fraction") or 1.0,
                              aggregation=params["trainer.aggregation"], topk=int(params["trainer.topk"]))
    title = (f"{job.parent.data.tags.get(tracking.MODEL_TAG)} fold {fold} ({job.kind}), {len(inspection.videos)} "
             f"test videos; Grad-CAM at {inspection.cam_layer}")
    outputs = write_fold_outputs(inspection, net, job.out_root / f"fold_{fold}", title)
    log_fold(job.client, inspection, outputs, job.images_allowed, job.prefix)
    print(f"fold {fold}: {len(inspection.videos)} test videos, {int(inspection.videos['n_crops'].sum())} crops, "
          f"{time.perf_counter() - started:.0f} s | " + fold_line(inspection, job.regions is not None))
    return inspection


def untrained_like(meta: dict, seed: int) -> PainNet:
    """A randomly initialised network of the kept model's backbone, size and classes: the baseline."""
    torch.manual_seed(seed)
    net, _ = create_model(meta["model_name"], n_classes=len(meta["class_names"]), pretrained=False,
                          img_size=meta["img_size"])
    return net.eval()


def log_fold(client: MlflowClient, inspection: FoldInspection, outputs: dict[str, list[Path]], images_allowed: bool,
             prefix: str) -> None:
    now = int(time.time() * 1000)
    metrics = [Metric(key.replace(f"{PREFIX}/", prefix, 1), value, now, 0)
               for key, value in inspection.metrics.items()]
    client.log_batch(inspection.run_id, metrics=metrics)
    artifact_dir = prefix.rstrip("/")
    for path in outputs["numbers"] + (outputs["images"] if images_allowed else []):
        client.log_artifact(inspection.run_id, str(path), artifact_dir)


def log_parent(client: MlflowClient, parent_id: str, inspections: list[FoldInspection], prefix: str,
               images_allowed: bool, out_root: Path) -> dict[str, float]:
    """Mean and spread over folds of every fold number, onto the parent run; returns them."""
    summary = summarize_folds([{key.replace(f"{PREFIX}/", prefix, 1): value
                                for key, value in inspection.metrics.items()} for inspection in inspections])
    summary = {key: value for key, value in summary.items() if np.isfinite(value)}
    now = int(time.time() * 1000)
    client.log_batch(parent_id, metrics=[Metric(key, value, now, 0) for key, value in summary.items()])
    client.set_tag(parent_id, tracking.INSPECT_IMAGES_TAG,
                   "mlflow and disk" if images_allowed else f"disk only ({out_root})")
    return summary


def fold_line(inspection: FoldInspection, with_regions: bool) -> str:
    parts = []
    for method in inspection.methods:
        score = inspection.metrics.get(f"{PREFIX}/{method}/region_score")
        if score is not None:
            parts.append(f"{method}: region score {score:.2f}")
        else:
            parts.append(f"{method}: no region score (every map empty)" if with_regions else f"{method}: maps written")
    if inspection.attention_distance is not None:
        parts.append("attention distance by layer " + " ".join(f"{np.mean(h):.0f}" for h in
                                                                inspection.attention_distance) + " px")
    return "; ".join(parts)


def summary_lines(inspections: list[FoldInspection]) -> list[str]:
    """Each method's region score over folds, with how many folds have one."""
    lines = []
    for method in inspections[0].methods:
        scores = [i.metrics.get(f"{PREFIX}/{method}/region_score", np.nan) for i in inspections]
        known = np.array([score for score in scores if np.isfinite(score)])
        if len(known):
            spread = known.std(ddof=1) if len(known) > 1 else 0.0
            lines.append(f"{method}: region score {known.mean():.2f} +- {spread:.2f} over {len(known)} of "
                         f"{len(scores)} folds (1.0 = a map that ignores the face's pain regions)")
    return lines


def run_inspect(cfg: DictConfig, run: str | None = None, untrained: str | None = None) -> dict:
    """`make inspect MODEL=... [RUN=<parent run id>] [UNTRAINED=1]`."""
    from pipeline.analysis.regions import action_unit_masks

    regions, why = action_unit_masks(resolve_path(cfg.data.root) if cfg.data.root else None,
                                     resolve_path(cfg.data.processed_dir))
    settings = InspectSettings(cv_runs.CvConfig.from_config(cfg), tracking.store_uri(cfg.mlflow.tracking_uri),
                               str(cfg.data.name), is_twin(cfg.data), resolve_path(cfg.fold_file),
                               resolve_path(cfg.data.processed_dir), OmegaConf.to_container(cfg.loader, resolve=True),
                               int(cfg.seed), resolve_path(cfg.reports_dir))
    try:
        return inspect_cv(settings, run_id=run or None, untrained=str(untrained or "0") not in ("0", "", "false"),
                          regions=regions, no_regions_reason=why)
    except InspectionError as error:
        raise SystemExit(f"inspect: {error}") from None
